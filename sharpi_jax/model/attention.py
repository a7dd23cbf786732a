"""Gated full attention (the output gated by sigmoid of a per-head gate) over a fixed-size KV cache.

Per row: QG = W_q a holds [q_h | gate_h] per head; q and k get a per-head RMSNorm, then partial NEOX
rope; softmax(q k^T / sqrt(hd)) v per q-head (GQA: q-head h reads kv-head h // (Hq/Hkv)); the output
is multiplied by sigmoid(gate) (the un-normalised gate) before W_o.

Cache layout per layer: k and v [Hkv, S, hd] float32 (S = max_context), post-norm post-rope K, raw V.
New rows are scattered to their positions first (invalid rows are dropped), then every row attends over
the WHOLE cache with the mask `kv_pos <= row_pos`. The reduction over S therefore has the same shape
and order for a single decode row and for a row of a multi-row verify: masked entries contribute exact
zeros, so per-row results are bitwise independent of how many rows are processed together.

A compacted cache (SnapKV eviction) passes `slot_pos` [Hkv, S] (the logical position of each slot, per
KV head) and `shift`: rows are written to slot position - shift and the mask is
`slot_pos <= row_pos`, per KV head. Without them, slot s is position s (the original path, unchanged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sharpi_jax.config import ModelConfig
from sharpi_jax.model.layers import Linear, RMSNorm, rope_neox
from sharpi_jax.model.tree import TreeRows, view_scores, view_sources, view_values


class GatedAttention(nnx.Module):
    """Gated full attention with a fused [q+gate | k | v] input projection."""

    def __init__(self, c: ModelConfig):
        self.n_head, self.n_head_kv, self.head_dim = c.n_head, c.n_head_kv, c.head_dim
        self.n_rot, self.rope_base, self.rope_freq_scale = c.n_rot, c.rope_base, c.rope_freq_scale
        hd = c.head_dim
        self.w_qkv = Linear(c.d_model, 2 * c.n_head * hd + 2 * c.n_head_kv * hd)
        self.w_o = Linear(c.n_head * hd, c.d_model)
        self.q_norm = RMSNorm(hd, c.rms_eps)
        self.k_norm = RMSNorm(hd, c.rms_eps)

    def __call__(self, x: jax.Array, positions: jax.Array, valid: jax.Array, cache_k: jax.Array,
                 cache_v: jax.Array, tree: TreeRows | None = None, slot_pos: jax.Array | None = None,
                 shift: jax.Array | None = None, with_q: bool = False):
        """x [T, D] normed input, positions [T] int32 (logical), valid [T] bool -> (out [T, D], cache_k,
        cache_v), plus the post-rope queries q [T, Hq, hd] with with_q (SnapKV's observation window).
        tree: draft-tree rows (K/V written to tree.slots, each row sees the context and its ancestors,
        `sharpi_jax.model.tree`); positions[0] - tree.depth[0] is the tree's base position.
        slot_pos [Hkv, S], shift: an evicted (SnapKV-compacted) cache, `sharpi_jax.model.cache.AttnCache`."""
        if tree is not None and slot_pos is not None:
            raise ValueError("tree verify over an evicted (SnapKV) KV cache is not supported")
        T = x.shape[0]
        Hq, Hkv, hd = self.n_head, self.n_head_kv, self.head_dim
        G = Hq // Hkv
        S = cache_k.shape[1]
        n_valid = jnp.sum(valid, dtype=jnp.int32)  # valid rows come first; the rest is bucket padding
        y = self.w_qkv(x, n_valid)
        qg = y[:, : 2 * Hq * hd].reshape(T, Hq, 2, hd)  # interleaved per head: [q_h | gate_h]
        q, gate = qg[:, :, 0], qg[:, :, 1]
        k = y[:, 2 * Hq * hd: 2 * Hq * hd + Hkv * hd].reshape(T, Hkv, hd)
        v = y[:, 2 * Hq * hd + Hkv * hd:].reshape(T, Hkv, hd)
        q = rope_neox(self.q_norm(q), positions, self.n_rot, self.rope_base, self.rope_freq_scale)
        k = rope_neox(self.k_norm(k), positions, self.n_rot, self.rope_base, self.rope_freq_scale)

        # Scatter the new rows; invalid (padding) rows get an out-of-range index and are dropped.
        if tree is not None:
            idx = jnp.where(valid, tree.slots, S)
        else:
            idx = jnp.where(valid, positions if shift is None else positions - shift, S)
        cache_k = cache_k.at[:, idx, :].set(k.transpose(1, 0, 2), mode="drop")
        cache_v = cache_v.at[:, idx, :].set(v.transpose(1, 0, 2), mode="drop")

        qh = q.reshape(T, Hkv, G, hd).transpose(1, 2, 0, 3).reshape(Hkv, G * T, hd)
        scores = jnp.einsum("bmd,bsd->bms", qh, cache_k) * jnp.float32(1.0 / (hd ** 0.5))
        if tree is not None:
            src = view_sources(tree.anc, positions[0] - tree.depth[0], S)
            scores = view_scores(scores, src)
        if slot_pos is None:
            mask = jnp.arange(S, dtype=jnp.int32)[None, :] <= positions[:, None]  # [T, S]
            mask = jnp.broadcast_to(mask[None], (G, T, S)).reshape(1, G * T, S)
        else:
            mask = slot_pos[:, None, :] <= positions[None, :, None]  # [Hkv, T, S]
            mask = jnp.broadcast_to(mask[:, None], (Hkv, G, T, S)).reshape(Hkv, G * T, S)
        scores = jnp.where(mask, scores, -jnp.inf)
        p = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
        p = p / jnp.sum(p, axis=-1, keepdims=True)
        if tree is None:
            o = jnp.einsum("bms,bsd->bmd", p, cache_v)  # [Hkv, G*T, hd]
        else:
            o = view_values(p, cache_v, src)
        o = o.reshape(Hkv, G, T, hd).transpose(2, 0, 1, 3).reshape(T, Hq, hd)
        o = o * jax.nn.sigmoid(gate)
        out = self.w_o(o.reshape(T, Hq * hd), n_valid)
        return (out, cache_k, cache_v, q) if with_q else (out, cache_k, cache_v)
