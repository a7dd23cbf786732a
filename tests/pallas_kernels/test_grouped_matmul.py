"""Grouped matmul: block formats, group layout, Pallas kernel (interpret mode) vs its references.

The kernel runs with `interpret=True` on CPU; interpret mode leaves unwritten outputs as NaN, so every
kernel test also asserts that no NaN is left. Shapes stay small: interpret mode is slow for grids.
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq

from sharpi_jax.pallas_kernels import grouped_matmul as gm
from sharpi_jax.pallas_kernels import quant_blocks as qb
from tests.bitwise import assert_bitwise_equal
from tests.cuda_lowering import lower_for_cuda
from tests.pallas_kernels.harness import run_kernel

GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_k": gguf.GGMLQuantizationType.Q4_K}


def _weights(rng, qtype, shape):
    """(raw storage, float32 truth from gguf.quants) for weights of `shape` [..., K]."""
    if qtype == "f32":
        w = rng.standard_normal(shape, dtype=np.float32)
        return w, w
    raw = qb.random_blocks(rng, shape, qtype)
    return raw, gq.dequantize(raw, GGML[qtype])


# ----------------------------------------------------------------------------- block formats


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k"])
def test_dequantize_matches_gguf_bitwise(qtype):
    rng = np.random.default_rng(1)
    raw, want = _weights(rng, qtype, (3, 5, 512))
    soa = jax.jit(lambda r: qb.to_soa(r, qtype, 512))(raw)
    assert_bitwise_equal(np.asarray(jax.jit(lambda s: qb.dequantize_soa(s, qtype))(soa)), want)
    assert_bitwise_equal(np.asarray(qb.soa_to_raw(soa, qtype)), raw)
    assert sum(a.nbytes for a in jax.tree.leaves(soa)) == raw.nbytes  # SoA holds the same bytes
    packed = qb.pack(jnp.asarray(raw), qtype, 512)
    assert_bitwise_equal(np.asarray(jax.jit(lambda p: qb.dequantize_packed(p, qtype))(packed)), want)


def test_dequantize_real_quantized_data():
    """Blocks from gguf's own Q8_0 quantizer and from our Q4_K quantizer round-trip through gguf."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 512)).astype(np.float32) * 0.05
    for qtype, raw in (("q8_0", gq.quantize(x, GGML["q8_0"])), ("q4_k", qb.quantize_q4_k_np(x))):
        want = gq.dequantize(raw, GGML[qtype])
        soa = qb.to_soa(jnp.asarray(raw), qtype, 512)
        assert_bitwise_equal(np.asarray(jax.jit(lambda s, q=qtype: qb.dequantize_soa(s, q))(soa)), want)
        np.testing.assert_allclose(want, x, atol=0.01)  # a real quantizer, not noise


def test_q4_k_storage_order_is_a_column_permutation():
    rng = np.random.default_rng(3)
    raw, natural = _weights(rng, "q4_k", (2, 3, 512))
    soa = qb.to_soa(jnp.asarray(raw), "q4_k", 512)
    storage = np.asarray(jax.jit(lambda s: qb.dequantize_soa(s, "q4_k", "storage"))(soa))
    perm = np.asarray(qb.storage_k_order(jnp.arange(512)[None], "q4_k"))[0]
    assert sorted(perm.tolist()) == list(range(512))
    assert_bitwise_equal(storage, natural[..., perm])
    x = rng.standard_normal((4, 512)).astype(np.float32)
    assert_bitwise_equal(np.asarray(qb.storage_k_order(jnp.asarray(x), "q4_k")), x[:, perm])


# ----------------------------------------------------------------------------- layout


def _check_layout(ids: np.ndarray, n_groups: int, block_m: int):
    lay = jax.jit(gm.group_layout, static_argnums=(1, 2))(jnp.asarray(ids, jnp.int32), n_groups, block_m)
    pos, tg = np.asarray(lay.pos), np.asarray(lay.tile_group)
    assert len(np.unique(pos)) == len(ids)  # no two rows share a slot
    assert (pos < lay.n_padded_rows).all()
    np.testing.assert_array_equal(tg[pos // block_m], ids)  # each row sits in a tile of its group
    for g in range(n_groups):  # rows of a group: ascending input order, contiguous from a tile start
        rows = pos[ids == g]
        assert (np.diff(rows) == 1).all()
        if rows.size:
            assert rows[0] % block_m == 0
    used_tiles = tg >= 0
    want_tiles = sum(-(-(ids == g).sum() // block_m) for g in range(n_groups))
    assert used_tiles.sum() == want_tiles and used_tiles[:want_tiles].all()  # -1 only at the end
    np.testing.assert_array_equal(np.asarray(lay.group_sizes), np.bincount(ids, minlength=n_groups))


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_group_layout_properties(block_m):
    rng = np.random.default_rng(4)
    for t, g in ((1, 5), (7, 3), (40, 6), (33, 64)):
        _check_layout(rng.integers(0, g, t), g, block_m)
    _check_layout(np.full(37, 2), 5, block_m)  # skewed: every row in one group
    _check_layout(np.arange(9) % 3 * 2, 8, block_m)  # unused groups in between


# ----------------------------------------------------------------------------- kernel


def _run_kernel(rng, qtype, ids, n_groups, n_out, k, block_m=16, block_n=32, block_k=64):
    raw, _ = _weights(rng, qtype, (n_groups, n_out, k))
    return run_kernel(rng, qtype, raw, k, ids, block_m, block_n, block_k)


@pytest.mark.parametrize("qtype", ["f32", "q8_0", "q4_k"])
def test_kernel_interpret_equals_reference_bitwise(qtype):
    rng = np.random.default_rng(5)
    ids = np.array([3, 0, 3, 1, 3, 3, 0, 4, 4, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3])  # group 2 unused, 3 skewed
    y, ref, lay, x, w = _run_kernel(rng, qtype, ids, n_groups=5, n_out=64, k=256)
    assert not np.isnan(y).any(), "kernel left unwritten outputs"
    assert_bitwise_equal(y, ref)
    empty = np.repeat(np.asarray(lay.tile_group) < 0, 16)
    assert empty.any() and (y[empty] == 0).all()  # unused tiles are written, with zeros
    # Independent numeric oracle: rows sorted by group through lax.ragged_dot.
    order = np.argsort(ids, kind="stable")
    rag = gm.ragged_dot_reference(x[order], w, lay.group_sizes)
    np.testing.assert_allclose(np.asarray(gm.gather_rows(jnp.asarray(y), lay))[order], np.asarray(rag),
                               rtol=2e-5, atol=2e-5)


def test_kernel_single_row_and_all_rows_one_group():
    rng = np.random.default_rng(6)
    for ids in (np.array([2]), np.full(20, 1)):
        y, ref, *_ = _run_kernel(rng, "f32", ids, n_groups=3, n_out=32, k=64, block_m=8, block_n=16, block_k=32)
        assert not np.isnan(y).any()
        assert_bitwise_equal(y, ref)


def test_kernel_rows_do_not_depend_on_the_batch():
    """A row's output is the same alone as inside a batch (interpret mode; M >= 2 tiles)."""
    rng = np.random.default_rng(7)
    k, n_out, g = 64, 32, 4
    raw, _ = _weights(rng, "q8_0", (g, n_out, k))
    packed = qb.pack(jnp.asarray(raw), "q8_0", k)
    x = jnp.asarray(rng.standard_normal((12, k), dtype=np.float32))
    ids = jnp.asarray(rng.integers(0, g, 12), jnp.int32)

    def run(xs, gs):
        lay = gm.group_layout(gs, g, 8)
        y = gm.grouped_matmul(gm.scatter_rows(xs, lay), packed, lay.tile_group, qtype="q8_0", block_m=8,
                              block_n=16, interpret=True)
        return np.asarray(gm.gather_rows(y, lay))

    full = run(x, ids)
    for i in (0, 5):
        assert_bitwise_equal(run(x[i:i + 1], ids[i:i + 1])[0], full[i])


def test_bad_arguments_raise_value_error():
    """pallas_kernels never imports sharpi_jax: its contract for bad arguments is a plain ValueError
    naming the problem (sharpi_jax.experts.dispatch checks its own inputs first and raises InputError)."""
    rng = np.random.default_rng(9)
    raw, _ = _weights(rng, "q8_0", (2, 32, 64))
    packed = qb.pack(jnp.asarray(raw), "q8_0", 64)
    lay = gm.group_layout(jnp.asarray([0, 1, 1], jnp.int32), 2, 8)
    xp = gm.scatter_rows(jnp.ones((3, 64), jnp.float32), lay)
    with pytest.raises(ValueError, match=r"q8_0 weights need fields \('qs', 'd'\)"):
        gm.grouped_matmul(xp, {"w": packed["qs"]}, lay.tile_group, qtype="q8_0", block_m=8, interpret=True)
    with pytest.raises(ValueError, match="x has 7 rows, tile_group says"):
        gm.grouped_matmul(xp[:7], packed, lay.tile_group, qtype="q8_0", block_m=8, interpret=True)
    with pytest.raises(ValueError, match=r"shapes: N=32 block_n=32 K=32 .* w K=64"):
        gm.grouped_matmul(xp[:, :32], packed, lay.tile_group, qtype="q8_0", block_m=8, interpret=True)
    with pytest.raises(ValueError, match="row length 33 is not a multiple of the block size 32"):
        qb.row_bytes("q8_0", 33)
    with pytest.raises(ValueError, match="no SoA layout for 'q6_k'"):
        qb.dequantize_soa({"d": jnp.zeros((2, 1), jnp.float16)}, "q6_k")


# ----------------------------------------------------------------------------- GPU lowering


@pytest.mark.parametrize("qtype", ["f32", "q8_0", "q4_k"])
def test_triton_lowering_on_cpu(qtype):
    """The Triton version lowers for CUDA without a GPU (compiling and running need one)."""
    rng = np.random.default_rng(8)
    k, n_out, g, bm = 256, 64, 3, 16
    raw, _ = _weights(rng, qtype, (g, n_out, k))
    packed = qb.pack(jnp.asarray(raw), qtype, k)
    lay = gm.group_layout(jnp.asarray(rng.integers(0, g, 10), jnp.int32), g, bm)
    xp = jnp.zeros((lay.n_padded_rows, k), jnp.float32)

    def f(x, w, tg):
        return gm.grouped_matmul(x, w, tg, qtype=qtype, block_m=bm, block_n=32, block_k=64)

    text = lower_for_cuda(lambda: jax.jit(f).trace(xp, packed, lay.tile_group).lower(lowering_platforms=("cuda",)))
    assert "__gpu$xla.gpu.triton" in text  # Triton, not Mosaic GPU
    assert f"grouped_matmul_{qtype}" in text
