"""Gated full attention (the output gated by sigmoid of a per-head gate) over a fixed-size KV cache.

Per row: QG = W_q a holds [q_h | gate_h] per head; q and k get a per-head RMSNorm, then partial NEOX
rope; softmax(q k^T / sqrt(hd)) v per q-head (GQA: q-head h reads kv-head h // (Hq/Hkv)); the output
is multiplied by sigmoid(gate) (the un-normalised gate) before W_o.

Cache layout per layer: k and v [Hkv, S, hd] float32 (S = max_context), post-norm post-rope K, raw V.
New rows are scattered to their positions first (invalid rows are dropped), then every row attends with
the mask `kv_pos <= row_pos` over the chunks of the cache that some valid row can see (`attend`: an
online softmax over aligned chunks, so a step costs the used context, not max_context). Every chunk is
computed with the same shapes for a single decode row and for a row of a multi-row verify, a chunk a
row cannot see leaves it untouched, and the softmax denominator is a fixed pairwise sum: per-row
results are bitwise independent of how many rows are processed together.

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
from sharpi_jax.model.tree import TreeRows, view_columns


CHUNK = 256  # KV slots per attention chunk (when it divides max_context)


def chunk_size(n_slots: int) -> int:
    """Slots per chunk for a cache of n_slots: CHUNK when it divides n_slots, else one chunk of them all
    (aligned chunks: a chunk never straddles the end of the cache)."""
    return CHUNK if n_slots > CHUNK and n_slots % CHUNK == 0 else n_slots


def pairwise_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis as a fixed pairwise tree of elementwise adds -> [..., 1]. XLA:CPU's reduce
    picks its summation order from the shape (8 or more rows are vectorised across rows), which would
    make a row's softmax denominator depend on how many rows run together; elementwise adds cannot."""
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:  # zero padding: x + 0 == x for the non-negative probabilities summed here
        x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (width - n,), x.dtype)], axis=-1)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x


def _tree_region(tree: TreeRows, positions: jax.Array, shift: jax.Array | None, cache_k: jax.Array,
                 cache_v: jax.Array, C: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The tree's base slot (its logical base position, then its physical slot) and the keys and values
    of the C physical slots from there [Hkv, C, hd]: the block tree rows read their tree region from."""
    base = positions[0] - tree.depth[0]
    base = base if shift is None else base - shift
    idx = jnp.clip(base + jnp.arange(C, dtype=jnp.int32), 0, cache_k.shape[1] - 1)
    return base, cache_k[:, idx, :], cache_v[:, idx, :]


def _visible(slots: jax.Array, s0: jax.Array, row_pos: jax.Array, slot_pos: jax.Array | None,
             tree: TreeRows | None, base: jax.Array | None) -> jax.Array:
    """Which view slots of one chunk each row sees -> bool [1 or Hkv, T, C]: a slot up to the row's
    position (over a compacted cache, by the slot's logical position `slot_pos`); in a tree's region a
    row sees its ancestors (depth <= its own), not by slot."""
    C = slots.shape[0]
    if slot_pos is None:
        seen = slots[None, None, :] <= row_pos  # [1, T, C]
    else:
        sp = jax.lax.dynamic_slice_in_dim(slot_pos, s0, C, axis=1)
        seen = sp[:, None, :] <= row_pos  # [Hkv, T, C]
    if tree is not None:
        rel = slots - base
        in_tree = (rel >= 0) & (rel < tree.anc.shape[1])
        seen = jnp.where(in_tree[None, None, :], (rel[None, :] <= tree.depth[:, None])[None], seen)
    return seen


def _online_softmax_step(carry: tuple, sc: jax.Array, seen: jax.Array, weighted_values) -> tuple:
    """One chunk of the online softmax: (max, sum, acc) updated with scores sc [Hkv, G*T, C] where
    `seen`; a row that sees no slot of the chunk keeps its carry untouched (`where`, for bit parity)."""
    m, l, acc = carry
    sc = jnp.where(seen, sc, -jnp.inf)
    live = jnp.any(seen, axis=-1, keepdims=True)  # rows that see a slot of this chunk
    m_new = jnp.where(live, jnp.maximum(m, jnp.max(sc, axis=-1, keepdims=True)), m)
    p = jnp.where(seen, jnp.exp(sc - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    pv = weighted_values(p)
    l = jnp.where(live, l * alpha + pairwise_sum(p), l)
    acc = jnp.where(live, acc * alpha + pv, acc)
    return m_new, l, acc


def attend(qh: jax.Array, scale: jax.Array, cache_k: jax.Array, cache_v: jax.Array, positions: jax.Array,
           valid: jax.Array, tree: TreeRows | None = None, slot_pos: jax.Array | None = None,
           shift: jax.Array | None = None, chunks: str = "used") -> jax.Array:
    """softmax(scale * q k^T) v over the used chunks of the cache: qh [Hkv, G*T, hd] (row m = g*T + t)
    -> [Hkv, G*T, hd].

    An online softmax over aligned chunks of `chunk_size(S)` slots, visiting chunks 0 .. the last one
    any valid row can see (a `fori_loop` with a data-dependent trip count), so a step reads the used
    part of the cache, not all max_context slots (chunks="all": a static loop over every chunk, the same
    bits, reverse-mode differentiable for training). Bit parity: every chunk is computed with the same
    shapes whatever the rows; a chunk in which a row sees nothing leaves that row's (max, sum, acc)
    untouched (`where`, not arithmetic), so a row's result depends only on its own chunks 0..c(row),
    not on how many rows run together or how far the others reach.
    Tree rows read each view slot through `view_columns` (the context from the chunk, the tree region
    from one block of C physical slots at the tree's base, scored with the same shapes) and see a tree
    slot when it holds an ancestor; over a compacted cache (slot_pos, shift) the tree's slots start at
    its base position - shift, as a decode row's would."""
    Hkv, GT, hd = qh.shape
    T = positions.shape[0]
    G = GT // T
    S = cache_k.shape[1]
    C = chunk_size(S)
    # The last view slot any valid row reads: its own position (compacted: its slot, position - shift).
    reach = positions if shift is None else positions - shift
    n_chunks = jnp.max(jnp.where(valid, reach, 0)) // C + 1
    row_pos = positions[None, :, None]  # [1, T, 1]

    def scores_of(k):  # [Hkv, C, hd] -> [Hkv, G*T, C]
        return jnp.einsum("bmd,bsd->bms", qh, k) * scale

    if tree is not None:
        base, tree_k, tree_v = _tree_region(tree, positions, shift, cache_k, cache_v, C)
        tree_s = scores_of(tree_k)

    def body(c, carry):
        s0 = c * C
        k = jax.lax.dynamic_slice_in_dim(cache_k, s0, C, axis=1)
        v = jax.lax.dynamic_slice_in_dim(cache_v, s0, C, axis=1)
        slots = s0 + jnp.arange(C, dtype=jnp.int32)
        sc = scores_of(k)
        if tree is not None:
            col = view_columns(tree.anc, base, slots, C)  # [T, C] into [chunk | tree block]
            both = jnp.concatenate([sc, tree_s], axis=-1).reshape(Hkv, G, T, 2 * C)
            sc = jnp.take_along_axis(both, col[None, None], axis=3).reshape(Hkv, GT, C)
        seen = _visible(slots, s0, row_pos, slot_pos, tree, base if tree is not None else None)
        seen = jnp.broadcast_to(seen[:, None], (seen.shape[0], G, T, C)).reshape(-1, GT, C)

        def weighted_values(p):  # [Hkv, G*T, C] -> [Hkv, G*T, hd]
            if tree is None:
                return jnp.einsum("bms,bsd->bmd", p, v)
            vv = jnp.concatenate([v, tree_v], axis=1)[:, col, :]  # [Hkv, T, C, hd]: each row's view
            pt = p.reshape(Hkv, G, T, C).transpose(0, 2, 1, 3)
            return jnp.einsum("btgs,btsd->btgd", pt, vv).transpose(0, 2, 1, 3).reshape(Hkv, GT, hd)

        return _online_softmax_step(carry, sc, seen, weighted_values)

    init = (jnp.full((Hkv, GT, 1), -jnp.inf, jnp.float32), jnp.zeros((Hkv, GT, 1), jnp.float32),
            jnp.zeros((Hkv, GT, hd), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_chunks if chunks == "used" else S // C, body, init)
    return acc / l


class GatedAttention(nnx.Module):
    """Gated full attention with a fused [q+gate | k | v] input projection."""

    def __init__(self, c: ModelConfig, chunks: str = "used"):
        self.chunks = chunks  # RunConfig.attention_chunks
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
        `sharpi_jax.model.tree`); positions[0] - tree.depth[0] is the tree's base position. Its slots and
        ancestors are slots of an uncompacted cache; a compacted one takes them at slot - shift.
        slot_pos [Hkv, S], shift: an evicted (SnapKV-compacted) cache, `sharpi_jax.model.cache.AttnCache`."""
        T = x.shape[0]
        Hq, Hkv, hd = self.n_head, self.n_head_kv, self.head_dim
        if tree is not None and shift is not None:  # a compacted cache: the tree's slots move down by shift
            tree = tree._replace(slots=tree.slots - shift, anc=tree.anc - shift)
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
        o = attend(qh, jnp.float32(1.0 / (hd ** 0.5)), cache_k, cache_v, positions, valid, tree, slot_pos, shift,
                   self.chunks)
        o = o.reshape(Hkv, G, T, hd).transpose(2, 0, 1, 3).reshape(T, Hq, hd)
        o = o * jax.nn.sigmoid(gate)
        out = self.w_o(o.reshape(T, Hq * hd), n_valid)
        return (out, cache_k, cache_v, q) if with_q else (out, cache_k, cache_v)
