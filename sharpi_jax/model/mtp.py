"""The MTP (NextN) head: one extra full-attention block that drafts the token after next.

Per row, a token x at position p paired with a final-normed hidden h (the target's h[p-1] when catching
up, the head's own previous output when drafting):

    c  = [RMSNorm(embed(x), enorm) ; RMSNorm(h, hnorm)]       # embedding FIRST
    u  = eh_proj c                                            # [2D] -> [D]
    y  = Block(u)     # the trunk's block type: gated attention over the head's OWN KV cache
                      # (an AttnCache), then MoE (or dense SwiGLU) FFN
    h' = RMSNorm(y, shared_head_norm)                         # chained into the next draft step
    logits = lm_head h'

`embed` / `lm_head` are the trunk's `token_embd` / `output` (the same arrays, not copies) unless the
file has `nextn.embed_tokens` / `nextn.shared_head_head`; `shared_head_norm` falls back to
`output_norm`. Like the trunk, every product sees M >= 2 rows (callers pad single rows to 2), so a row's
result is bitwise independent of how many rows are processed together: one draft step and a multi-row
KV catch-up agree row for row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sharpi_jax.config import ModelConfig, RunConfig
from sharpi_jax.model.cache import AttnCache
from sharpi_jax.model.layers import Linear, RMSNorm
from sharpi_jax.model.tree import TreeRows
from sharpi_jax.model.transformer import Block, TokenEmbedding


class MTPHead(nnx.Module):
    """The MTP block of a qwen35moe / qwen35 / qwen3next model with its embedding and LM head."""

    def __init__(self, c: ModelConfig, experts: nnx.Module | None = None, run: RunConfig = RunConfig()):
        """experts: the block's routed experts (a `moe.ExpertProvider`; MoE archs)."""
        if not c.has_mtp:
            raise ValueError("config has no MTP block (nextn_predict_layers = 0)")
        self.config = c
        D = c.d_model
        self.embed = TokenEmbedding(c.n_vocab, D)
        self.enorm = RMSNorm(D, c.rms_eps)
        self.hnorm = RMSNorm(D, c.rms_eps)
        self.eh_proj = Linear(2 * D, D)
        self.block = Block(c, c.mtp_layer, experts, run)
        self.shared_head_norm = RMSNorm(D, c.rms_eps)
        self.lm_head = Linear(D, c.n_vocab)

    def __call__(self, tokens: jax.Array, h: jax.Array, start: jax.Array, n_valid: jax.Array,
                 cache: AttnCache, tree: TreeRows | None = None, with_q: bool = False):
        """Rows (tokens [T], h [T, D]) at positions start.. (rows >= n_valid are padding: no KV write,
        zero-weight experts), over the head's own KV cache. Returns (h' [T, D] post shared_head_norm,
        cache), plus with_q the block's post-rope queries [T, Hq, hd] (SnapKV). tree: draft-tree rows at
        positions start + tree.depth (`sharpi_jax.model.tree`). Also a batch of sequences (training):
        tokens [B, T], h [B, T, D], a cache [B, ...]."""
        T = tokens.shape[-1]
        rows = jnp.arange(T, dtype=jnp.int32)
        positions = start + (rows if tree is None else tree.depth)
        valid = rows < n_valid
        c = jnp.concatenate([self.enorm(self.embed(tokens)), self.hnorm(h)], axis=-1)
        mode = "chunked" if tree is None else "recurrent"  # the MTP block is attention: the mode is moot
        rows = None if tokens.ndim > 1 else jnp.sum(valid, dtype=jnp.int32)  # valid rows come first
        y, cache, _, q = self.block(self.eh_proj(c, rows), cache, positions, valid, mode, tree, with_q=True)
        return (self.shared_head_norm(y), cache, q) if with_q else (self.shared_head_norm(y), cache)

    def logits(self, h: jax.Array, rows: jax.Array | int | None = None) -> jax.Array:
        """LM head on post-norm rows [T >= 2, D] -> [T, V]; rows: only rows [0, rows) are needed
        (`Linear`: a 2-row bucket's padding row costs nothing on a row-stable backend)."""
        return self.lm_head(h, rows)
