"""The hybrid trunk: token embedding, GDN / gated-attention blocks with MoE or dense FFN, output norm,
LM head; and `Block`, the decoder block the trunk and the MTP head share.

State is per layer: block i reads and returns its own cache (`cache.AttnCache` or `cache.GDNCache`),
so the trunk's state is a tuple of per-layer caches in trunk order.

Two forward forms share every layer except the GDN kernel (the block's `mode`):
- `prefill`: a bucket of rows with the chunked GDN form (fast); returns the final-normed hidden rows.
- `rows`: T rows with the recurrent GDN form, one token per scan step; returns logits, final-normed
  hidden rows and the per-row GDN snapshots. Single-token decode is `step` (`rows` keeping only the
  state after the row, no snapshots) on a 2-row bucket (row 1 is inert padding) so that every matmul
  has M >= 2 rows: on XLA CPU an M = 1 product uses a different
  kernel and differs in the last bits, while rows of M >= 2 products are independent of the batch.
  Hence a T-row verify and T single-token decodes agree bit for bit, row by row.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from sharpi_jax.config import ModelConfig, RunConfig
from sharpi_jax.model.attention import GatedAttention
from sharpi_jax.model.cache import AttnCache, GDNCache, LayerCache
from sharpi_jax.model.gated_delta_net import GatedDeltaNet
from sharpi_jax.model.layers import Linear, RMSNorm, SwiGLU
from sharpi_jax.model.moe import MoE
from sharpi_jax.model.tree import TreeRows
from sharpi_jax.quant import QTensor

# How a block runs its GDN mixer: "chunked" (prefill: the chunked WY form, state after the last valid
# row), "recurrent" (verify / decode: one token per scan step, the state left as it was and a snapshot
# after every row returned), "sequential" (the recurrent kernel with prefill semantics: the state after the
# last valid row, no snapshots; a decode step, and the check of the chunked form).
BLOCK_MODES = ("chunked", "recurrent", "sequential")


class TokenEmbedding(nnx.Module):
    """`token_embd` [n_vocab, d_model] as a QTensor in its GGUF encoding; a lookup dequantizes only
    the rows it gathers (exact)."""

    def __init__(self, n_vocab: int, d_model: int):
        self.d_model = d_model
        self.table = nnx.Param(QTensor({"w": jnp.zeros((n_vocab, d_model), jnp.float32)}, 0, (n_vocab, d_model),
                                       "float"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.table.get_value().take(ids).dequantize()


class Block(nnx.Module):
    """One decoder block: x + mixer(norm x), then + ffn(norm h). The trunk's blocks and the MTP block."""

    def __init__(self, c: ModelConfig, layer: int, experts: nnx.Module | None = None, run: RunConfig = RunConfig()):
        """experts: the routed experts of a MoE block (a `moe.ExpertProvider`; None for dense models);
        run: how it runs (the GDN chunk length)."""
        self.layer = layer
        self.is_recurrent = c.is_recurrent(layer)
        self.attn_norm = RMSNorm(c.d_model, c.rms_eps)
        self.post_norm = RMSNorm(c.d_model, c.rms_eps)
        self.mixer = GatedDeltaNet(c, run.gdn_chunk, run.gdn_solve, run.gdn_step) if self.is_recurrent else GatedAttention(c, run.attention_chunks)
        self.is_moe = c.is_moe
        if c.is_moe and experts is None:
            raise ValueError(f"block {layer} of a MoE model needs its routed experts (an ExpertProvider)")
        self.ffn = MoE(c, experts) if c.is_moe else SwiGLU(c.d_model, c.dense_ff)

    def __call__(self, x: jax.Array, cache: LayerCache, positions: jax.Array, valid: jax.Array,
                 mode: str = "chunked", tree: TreeRows | None = None, with_q: bool = False, into=None,
                 from_snapshot=None):
        """Rows x [T, D] at `positions` [T] int32; rows with valid [T] False are bucket padding (no KV
        write, no state change, zero-weight experts). Returns (x' [T, D], the block's new cache, the
        per-row GDN snapshots in mode "recurrent", else None). See BLOCK_MODES. tree (mode "recurrent"):
        draft-tree rows, each on its own root path (`sharpi_jax.model.tree`). with_q: a fourth
        output, an attention block's post-rope queries [T, Hq, hd] (None for a GDN block; SnapKV).
        into (mode "recurrent", a GDN block): a GDNCache of [T, ...] buffers its snapshots are written into
        (`GatedDeltaNet.recurrent`); from_snapshot: a GDN block starts from that snapshot of `into`, not
        from its cache.

        A batch of sequences (training): x [B, T, D] with a cache of per-sequence caches [B, ...]
        (positions and valid shared): the mixer runs per sequence, the FFN on all B*T rows at once."""
        a = self.attn_norm(x)
        if x.ndim == 3:
            if tree is not None:
                raise ValueError("draft-tree rows take one sequence, not a batch")
            mix = jax.vmap(functools.partial(self._mix, mode=mode), in_axes=(0, 0, None, None))
            m, cache, snapshot, q = mix(a, cache, positions, valid)
        else:
            m, cache, snapshot, q = self._mix(a, cache, positions, valid, mode, tree, into, from_snapshot)
        h = x + m
        out = h + self.feed_forward(h, valid), cache, snapshot
        return out + (q,) if with_q else out

    def _mix(self, a, cache, positions, valid, mode, tree=None, into=None, from_snapshot=None):
        if mode not in BLOCK_MODES:
            raise ValueError(f"mode must be one of {BLOCK_MODES}, got {mode!r}")
        if tree is not None and mode != "recurrent":
            raise ValueError("draft-tree rows need mode 'recurrent'")
        if not self.is_recurrent:
            m, k, v, q = self.mixer(a, positions, valid, cache.k, cache.v, tree, cache.slot_pos, cache.shift,
                                    with_q=True)
            return m, cache._replace(k=k, v=v), None, q
        n_valid = jnp.sum(valid, dtype=jnp.int32)  # valid rows come first
        if mode == "recurrent":
            parent = None if tree is None else tree.parent
            m, conv_snaps, ssm_snaps = self.mixer.recurrent(a, cache.conv, cache.ssm, parent, n_valid, into=into,
                                                            from_snapshot=from_snapshot)
            return m, cache, GDNCache(conv_snaps, ssm_snaps), None
        form = self.mixer.chunked if mode == "chunked" else self.mixer.sequential
        m, conv, ssm = form(a, valid, n_valid, cache.conv, cache.ssm)
        return m, GDNCache(conv, ssm), None, None

    def feed_forward(self, h: jax.Array, valid: jax.Array) -> jax.Array:
        if h.ndim == 3:  # a batch of sequences: all B*T rows at once (padding rows interleaved)
            B, T, D = h.shape
            mask = jnp.broadcast_to(valid, (B, T)).reshape(B * T)
            return self._ffn(h.reshape(B * T, D), mask, None).reshape(B, T, D)
        return self._ffn(h, valid, jnp.sum(valid, dtype=jnp.int32))  # valid rows come first

    def _ffn(self, h: jax.Array, valid: jax.Array, rows: jax.Array | None) -> jax.Array:
        """rows: only rows [0, rows) are needed (None: padding may be anywhere, `valid` says where)."""
        u = self.post_norm(h)
        return self.ffn(u, valid, rows) if self.is_moe else self.ffn(u, rows)

    def prefetch(self, x: jax.Array, valid: jax.Array) -> None:
        """Next-layer prediction: rows x [T, D] entering this block (the block before's output) routed
        by this block's MoE router as if they were its FFN input; its experts may fetch them ahead."""
        if self.is_moe and x.ndim == 2 and self.ffn.predicts:
            self.ffn.prefetch(self.post_norm(x), valid)


class Transformer(nnx.Module):
    """The trunk of a qwen35moe / qwen35 / qwen3next model (MTP blocks excluded)."""

    def __init__(self, c: ModelConfig, experts: Callable[[int], nnx.Module] | None = None,
                 run: RunConfig = RunConfig()):
        """experts: layer -> the routed experts of that MoE block (a `moe.ExpertProvider`, e.g. from
        `sharpi_jax.experts`); run: how the blocks run."""
        self.config = c
        self.embed = TokenEmbedding(c.n_vocab, c.d_model)
        self.layers = nnx.List([Block(c, i, experts(i) if c.is_moe else None, run) for i in range(c.n_layer)])
        self.output_norm = RMSNorm(c.d_model, c.rms_eps)
        self.lm_head = Linear(c.d_model, c.n_vocab)

    def _trunk(self, state: tuple[LayerCache, ...], tokens: jax.Array, start: jax.Array, n_valid: jax.Array,
               mode: str, tree: TreeRows | None = None, queries: list | None = None, into=None,
               from_snapshot=None):
        T = tokens.shape[-1]  # tokens [T], or [B, T] for a batch of sequences (training)
        rows = jnp.arange(T, dtype=jnp.int32)
        positions = start + (rows if tree is None else tree.depth)
        valid = rows < n_valid
        x = self.embed(tokens)
        caches, snapshots = [], []
        into = (None,) * len(state) if into is None else into
        for i, (blk, cache, buf) in enumerate(zip(self.layers, state, into, strict=True)):
            if i > 0:
                blk.prefetch(x, valid)  # a no-op unless its experts take predictions (residency lookahead)
            if queries is None:
                x, cache, snapshot = blk(x, cache, positions, valid, mode, tree, into=buf,
                                         from_snapshot=None if buf is None else from_snapshot)
            else:
                x, cache, snapshot, q = blk(x, cache, positions, valid, mode, tree, with_q=True)
                if q is not None:
                    queries.append(q)
            caches.append(cache)
            snapshots.append(snapshot)
        return self.output_norm(x), tuple(caches), tuple(snapshots)

    def prefill(self, state, tokens, start, n_valid, gdn: str = "chunked", with_q: bool = False):
        """Rows [start, start + n_valid) of a padded bucket `tokens` [B]. Returns (hidden [B, D], state),
        plus with_q the attention layers' post-rope queries (a tuple of [B, Hq, hd], trunk order).
        Also a batch of sequences: tokens [N, B] with a state of per-sequence caches [N, ...]."""
        queries = [] if with_q else None
        hidden, state, _ = self._trunk(state, tokens, start, n_valid, gdn, queries=queries)
        return (hidden, state, tuple(queries)) if with_q else (hidden, state)

    def rows(self, state, tokens, start, n_valid, tree: TreeRows | None = None, into=None, head: bool = True,
             from_snapshot=None):
        """T >= 2 rows with the recurrent GDN form. Returns (logits [T, V], hidden [T, D], state with the
        KV rows written and the GDN state unchanged, snapshots: per layer, a GDNCache of per-row states
        [T, ...] for a GDN layer, None for an attention layer). tree: draft-tree rows at positions
        start + tree.depth (`sharpi_jax.model.tree`); None: a chain at start, start + 1, ... into: Snapshots
        of the same shapes (e.g. the previous pass's, donated) to write the snapshots into, in place;
        from_snapshot: every GDN layer starts from that row of `into` (the previous pass's rollback,
        never copied into the state), not from `state`, whose GDN entries are then returned unread.
        head False: no LM head (logits None; the caller computes the rows it needs, `head_row`)."""
        hidden, state, snapshots = self._trunk(state, tokens, start, n_valid, "recurrent", tree, into=into,
                                               from_snapshot=from_snapshot)
        return self.lm_head(hidden, n_valid) if head else None, hidden, state, snapshots

    def head_row(self, hidden, r):
        """The LM head on row r of hidden [T, D] -> logits [V]: a 2-row bucket (row 1 padding, not
        computed), so its bits are those of row r in any product of the head (`quant.matmul`)."""
        row = jax.lax.dynamic_index_in_dim(hidden, r, keepdims=True)
        return self.lm_head(jnp.concatenate([row, row]), 1)[0]

    def step(self, state, tokens, start, n_valid):
        """`rows` for a decode step (row 0 valid, row 1 padding; n_valid 0: no row), keeping only the state
        after the valid rows: the GDN loop carries the state, not a snapshot per row. Each row's
        operations are those of `rows`, so the bits are too. Returns (logits [T, V], hidden [T, D], state)."""
        hidden, state, _ = self._trunk(state, tokens, start, n_valid, "sequential")
        return self.lm_head(hidden, n_valid), hidden, state
