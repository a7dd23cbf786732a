"""`attend`: the chunked online softmax over the used part of the KV cache.

Against a float64 softmax over the whole cache (tolerance), and against itself run row by row, along a
tree's root paths and with far-reaching neighbours (bitwise): a row's bits depend only on its own
query, position and the slots it sees, however many chunks the call visits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharpi_jax.model.attention import CHUNK, attend, chunk_size
from sharpi_jax.model.tree import TreeRows, tree_arrays
from tests.bitwise import assert_bitwise_equal

HKV, G, HD, S = 2, 2, 32, 4 * CHUNK
SCALE = np.float32(1 / np.sqrt(HD))
_attend = jax.jit(attend, static_argnums=9)


def _cache(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((HKV, S, HD)).astype(np.float32), rng.standard_normal((HKV, S, HD)).astype(np.float32))


def _q(T, seed=1):
    return np.random.default_rng(seed).standard_normal((HKV, G, T, HD)).astype(np.float32)


def _run(q, k, v, positions, valid=None, tree=None, slot_pos=None, shift=None, chunks="used"):
    T = q.shape[2]
    valid = np.ones(T, bool) if valid is None else valid
    o = _attend(jnp.asarray(q.reshape(HKV, G * T, HD)), SCALE, jnp.asarray(k), jnp.asarray(v),
                jnp.asarray(positions, jnp.int32), jnp.asarray(valid), tree,
                None if slot_pos is None else jnp.asarray(slot_pos), None if shift is None else jnp.int32(shift),
                chunks)
    return np.asarray(o).reshape(HKV, G, T, HD)


def test_chunk_size():
    assert chunk_size(4096) == CHUNK and chunk_size(512) == CHUNK
    assert chunk_size(CHUNK) == CHUNK and chunk_size(192) == 192 and chunk_size(1000) == 1000


def test_matches_float64_softmax_over_the_whole_cache():
    """Rows in the first chunk, on both sides of chunk boundaries and in the last slot: within 2e-6
    relative of softmax(q k^T / sqrt(hd)) v over slots <= position in float64."""
    k, v = _cache()
    positions = np.array([0, 5, 255, 256, 257, 600, 767, S - 1], np.int32)
    q = _q(len(positions))
    out = _run(q, k, v, positions)
    for t, p in enumerate(positions):
        for h in range(HKV):
            s = q[h, :, t].astype(np.float64) @ k[h, : p + 1].astype(np.float64).T * float(SCALE)
            w = np.exp(s - s.max(axis=-1, keepdims=True))
            ref = (w / w.sum(axis=-1, keepdims=True)) @ v[h, : p + 1].astype(np.float64)
            np.testing.assert_allclose(out[h, :, t], ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("positions", [[254, 255, 256, 257], [10, 900, 11, 512, 513, 3, 767, 1000]])
def test_rows_are_bitwise_independent_of_their_batch(positions):
    """Each row of a batch == the same row alone in a decode-shaped 2-row call (second row padding),
    although the batch visits as many chunks as its farthest row."""
    k, v = _cache()
    positions = np.array(positions, np.int32)
    q = _q(len(positions))
    batch = _run(q, k, v, positions)
    for t, p in enumerate(positions):
        one = _run(np.concatenate([q[:, :, t:t + 1], q[:, :, :1]], axis=2), k, v, np.array([p, 0], np.int32),
                   np.array([True, False]))
        assert_bitwise_equal(batch[:, :, t], one[:, :, 0])


@pytest.mark.parametrize("evicted", [False, True], ids=["full", "snapkv"])
def test_tree_rows_equal_decode_along_their_root_path_across_a_chunk_boundary(evicted):
    """A draft tree whose base sits 2 slots before a chunk boundary: every node attends (bitwise) as a
    single decode row whose cache holds the node's root path at slots base .. base + depth. snapkv: the
    context compacted (per KV head, a different subset of 600 positions kept in 254 slots, shift 346),
    the tree at logical positions 600.., physical slots 254..: still decode's bits along each path."""
    k, v = _cache()
    base = CHUNK - 2
    slot_pos = shift = None
    logical = base
    if evicted:
        shift, logical = 346, base + 346
        rng = np.random.default_rng(11)
        slot_pos = np.stack([np.concatenate([np.sort(rng.choice(logical, base, replace=False)),
                                             np.arange(base, S) + shift]) for _ in range(HKV)]).astype(np.int32)
    parent = [-1, 0, 0, 1, 1, 3, 2]
    T = len(parent)
    depth, par, anc = tree_arrays(parent, T)
    rng = np.random.default_rng(7)
    new_k = rng.standard_normal((HKV, T, HD)).astype(np.float32)
    new_v = rng.standard_normal((HKV, T, HD)).astype(np.float32)
    tk, tv = k.copy(), v.copy()
    tk[:, base:base + T], tv[:, base:base + T] = new_k, new_v  # node t's K/V at physical slot base + t
    q = _q(T, seed=3)
    tree = TreeRows(jnp.asarray(depth), jnp.asarray(par), jnp.asarray(base + np.arange(T, dtype=np.int32)),
                    jnp.asarray(base + anc))
    out = _run(q, tk, tv, logical + depth, tree=tree, slot_pos=slot_pos, shift=shift)
    for t in range(T):
        path = [int(anc[t, d]) for d in range(depth[t] + 1)]  # root .. t, as rows
        dk, dv = k.copy(), v.copy()
        dk[:, base:base + len(path)], dv[:, base:base + len(path)] = new_k[:, path], new_v[:, path]
        one = _run(np.concatenate([q[:, :, t:t + 1], q[:, :, :1]], axis=2), dk, dv,
                   np.array([logical + depth[t], 0], np.int32), np.array([True, False]), slot_pos=slot_pos, shift=shift)
        assert_bitwise_equal(out[:, :, t], one[:, :, 0])


def test_all_chunks_is_bitwise_used_chunks_and_differentiable():
    """chunks="all" (training: a static loop over every chunk) gives the bits of chunks="used" (the
    loop stops at the farthest row's chunk), and has a reverse-mode gradient."""
    k, v = _cache()
    positions = np.array([3, 250, 300, 10], np.int32)
    q = _q(len(positions))
    assert_bitwise_equal(_run(q, k, v, positions, chunks="all"), _run(q, k, v, positions))
    qh = jnp.asarray(q.reshape(HKV, G * len(positions), HD))
    g = jax.grad(lambda qh: jnp.sum(attend(qh, SCALE, jnp.asarray(k), jnp.asarray(v), jnp.asarray(positions),
                                           jnp.ones(len(positions), bool), chunks="all")))(qh)
    assert np.all(np.isfinite(np.asarray(g))) and np.any(np.asarray(g) != 0)
