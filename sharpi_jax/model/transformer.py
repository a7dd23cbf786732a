"""The hybrid trunk (spec 3.1): token embedding, GDN / gated-attention blocks with MoE or dense FFN,
output norm, LM head.

Two forward forms share every layer except the GDN kernel:
- `prefill`: a bucket of rows with the chunked GDN form (fast); returns the final-normed hidden rows.
- `rows`: T rows with the recurrent GDN form, one token per scan step; returns logits, final-normed
  hidden rows and the per-row GDN snapshots. Single-token decode is `rows` on a 2-row bucket (row 1 is
  inert padding) so that every matmul has M >= 2 rows: on XLA CPU an M = 1 product uses a different
  kernel and differs in the last bits, while rows of M >= 2 products are independent of the batch.
  Hence a T-row verify and T single-token decodes agree bit for bit, row by row.

The state is duck-typed: any NamedTuple with fields k, v (per attention layer [Hkv, S, hd]), conv
(per GDN layer [Kc-1, C]) and ssm (per GDN layer [Hv, dv, dk]); see `sharpi_jax.runtime.state`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from sharpi_jax.config import ModelConfig
from sharpi_jax.model.attention import GatedAttention
from sharpi_jax.model.gated_delta_net import GatedDeltaNet
from sharpi_jax.model.layers import Linear, RMSNorm, SwiGLU
from sharpi_jax.model.moe import MoE
from sharpi_jax.quant import QTensor


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
    """One decoder block: x + mixer(norm x), then + ffn(norm h). Also the shape of the MTP block."""

    def __init__(self, c: ModelConfig, layer: int, experts: nnx.Module | None = None):
        """experts: the routed experts of a MoE block (a `moe.ExpertProvider`; None for dense models)."""
        self.layer = layer
        self.is_recurrent = c.is_recurrent(layer)
        self.attn_norm = RMSNorm(c.d_model, c.rms_eps)
        self.post_norm = RMSNorm(c.d_model, c.rms_eps)
        self.mixer = GatedDeltaNet(c) if self.is_recurrent else GatedAttention(c)
        self.is_moe = c.is_moe
        if c.is_moe and experts is None:
            raise ValueError(f"block {layer} of a MoE model needs its routed experts (an ExpertProvider)")
        self.ffn = MoE(c, experts) if c.is_moe else SwiGLU(c.d_model, c.dense_ff)

    def feed_forward(self, h: jax.Array, valid: jax.Array) -> jax.Array:
        u = self.post_norm(h)
        return self.ffn(u, valid) if self.is_moe else self.ffn(u)


class Transformer(nnx.Module):
    """The trunk of a qwen35moe / qwen35 / qwen3next model (MTP blocks excluded)."""

    def __init__(self, c: ModelConfig, experts: Callable[[int], nnx.Module] | None = None):
        """experts: layer -> the routed experts of that MoE block (a `moe.ExpertProvider`, e.g. from
        `sharpi_jax.experts`)."""
        self.config = c
        self.embed = TokenEmbedding(c.n_vocab, c.d_model)
        self.layers = nnx.List([Block(c, i, experts(i) if c.is_moe else None) for i in range(c.n_layer)])
        self.output_norm = RMSNorm(c.d_model, c.rms_eps)
        self.lm_head = Linear(c.d_model, c.n_vocab)

    # ----- forward forms -----
    def _trunk(self, state: Any, tokens: jax.Array, start: jax.Array, n_valid: jax.Array, gdn: str):
        T = tokens.shape[0]
        rows = jnp.arange(T, dtype=jnp.int32)
        positions = start + rows
        valid = rows < n_valid
        x = self.embed(tokens)
        ks, vs, convs, ssms = list(state.k), list(state.v), list(state.conv), list(state.ssm)
        snaps_conv, snaps_ssm = [], []
        ia = ig = 0
        for blk in self.layers:
            a = blk.attn_norm(x)
            if blk.is_recurrent:
                if gdn == "recurrent":
                    m, cs, ss = blk.mixer.recurrent(a, convs[ig], ssms[ig])
                    snaps_conv.append(cs)
                    snaps_ssm.append(ss)
                elif gdn == "chunked":
                    m, convs[ig], ssms[ig] = blk.mixer.chunked(a, valid, n_valid, convs[ig], ssms[ig])
                else:  # "sequential": recurrent kernel, prefill semantics (for cross-checks)
                    m, convs[ig], ssms[ig] = blk.mixer.sequential(a, valid, n_valid, convs[ig], ssms[ig])
                ig += 1
            else:
                m, ks[ia], vs[ia] = blk.mixer(a, positions, valid, ks[ia], vs[ia])
                ia += 1
            h = x + m
            x = h + blk.feed_forward(h, valid)
        hidden = self.output_norm(x)
        state = state._replace(k=tuple(ks), v=tuple(vs), conv=tuple(convs), ssm=tuple(ssms))
        return hidden, state, (tuple(snaps_conv), tuple(snaps_ssm))

    def prefill(self, state, tokens, start, n_valid, gdn: str = "chunked"):
        """Rows [start, start + n_valid) of a padded bucket `tokens` [B]. Returns (hidden [B, D], state)."""
        hidden, state, _ = self._trunk(state, tokens, start, n_valid, gdn)
        return hidden, state

    def rows(self, state, tokens, start, n_valid):
        """T >= 2 rows with the recurrent GDN form. Returns (logits [T, V], hidden [T, D], state with the
        KV rows written and the GDN state unchanged, (conv snapshots, ssm snapshots) per GDN layer)."""
        hidden, state, snaps = self._trunk(state, tokens, start, n_valid, "recurrent")
        return self.lm_head(hidden), hidden, state, snaps
