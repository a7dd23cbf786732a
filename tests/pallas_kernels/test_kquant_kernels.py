"""Q5_K / Q6_K (and every other kernel type) in the grouped-matmul kernel: layout, interpret mode, CUDA lowering.

The kernel layout's dequantization is compared bitwise with `gguf.quants` on random blocks and on real
llama.cpp-quantized blocks (the quant-zoo fixtures); the kernel in interpret mode bitwise with its
masked-dense reference (`grouped_matmul_reference`, same 32-column K chunks) and, within 2e-5, with
`lax.ragged_dot`. Shape classes follow the 35B-A3B-shaped Q4_K_M / Q5_K_M / Q6_K slices (WORKSPACE,
"Type mix of K-quant files"): K = 512 (routed `ffn_down_exps`) and K = 2048 (everything else), N a
multiple of 64 or only of 32 (`ssm_alpha` / `ssm_beta`: 32 rows). The fast tier keeps the block
structure with fewer rows and groups; `-m slow` runs the slice's own N x K and every M in 1..64.
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq

from sharpi_jax.pallas_kernels import KERNEL_TYPES
from sharpi_jax.pallas_kernels import grouped_matmul as gm
from sharpi_jax.pallas_kernels import quant_blocks as qb
from tests.bitwise import assert_bitwise_equal
from tests.cuda_lowering import lower_for_cuda
from tests.pallas_kernels.harness import run_kernel
from tests.conftest import fixture_path

KQUANTS = ("q4_k", "q5_k", "q6_k")
GGML = {q: gguf.GGMLQuantizationType[q.upper()] for q in ("q8_0", *KQUANTS)}
# Kernel-layout bytes per 256 weights (the quant_blocks module doc), and the GGUF file's.
KERNEL_BYTES_PER_256 = {"q8_0": 272, "q4_k": 148, "q5_k": 180, "q6_k": 210}
GGUF_BYTES_PER_256 = {"q8_0": 272, "q4_k": 144, "q5_k": 176, "q6_k": 210}
# Matrices (N, K) of the 35B-A3B-shaped slice by class (n_expert 256, d_model 2048, expert_ff 512).
SLICE_SHAPES = {
    "attn_q / attn_qkv (N 8192)": (8192, 2048),
    "ssm_out / attn_output (K 4096)": (2048, 4096),
    "attn_k / attn_v (N 512)": (512, 2048),
    "ssm_alpha / ssm_beta (N 32)": (32, 2048),
    "ffn_gate/up_exps (per expert)": (512, 2048),
    "ffn_down_exps (per expert)": (2048, 512),
}


def _run(rng, qtype, ids, n_groups, n_out, k, block_m=16, block_n=32, raw=None):
    """Kernel (interpret mode) and its bitwise reference on rows `ids` of `n_groups` groups."""
    if raw is None:
        raw = qb.random_blocks(rng, (n_groups, n_out, k), qtype)
    ids = jnp.asarray(ids, jnp.int32)
    y, ref, lay, x, w = run_kernel(rng, qtype, raw, k, ids, block_m, block_n)
    assert not np.isnan(y).any(), "kernel left unwritten outputs"
    assert_bitwise_equal(y, ref)
    order = np.argsort(np.asarray(ids), kind="stable")
    rag = gm.ragged_dot_reference(x[order], w, lay.group_sizes)
    np.testing.assert_allclose(np.asarray(gm.gather_rows(jnp.asarray(y), lay))[order], np.asarray(rag),
                               rtol=2e-5, atol=2e-5)
    return y, lay


# ----------------------------------------------------------------------------- layout


def test_kernel_types_are_the_kernel_layouts():
    """The exported type set is exactly what `pack` and the kernel read (one list, no drift)."""
    assert set(KERNEL_TYPES) == set(qb.KERNEL_FIELDS) == set(gm.WEIGHT_FIELDS)
    assert {"q5_k", "q6_k"} <= set(KERNEL_TYPES)


@pytest.mark.parametrize("qtype", ["q8_0", *KQUANTS])
def test_kernel_layout_dequant_matches_gguf_bitwise(qtype):
    rng = np.random.default_rng(11)
    raw = qb.random_blocks(rng, (3, 5, 768), qtype)
    want = gq.dequantize(raw, GGML[qtype])
    assert np.isfinite(want).all() and np.abs(want).max() > 0.01
    packed = jax.jit(lambda r: qb.pack(r, qtype, 768))(jnp.asarray(raw))
    assert_bitwise_equal(np.asarray(jax.jit(lambda p: qb.dequantize_packed(p, qtype))(packed)), want)
    assert tuple(packed) == qb.KERNEL_FIELDS[qtype] or set(packed) == set(qb.KERNEL_FIELDS[qtype])
    n_256 = 3 * 5 * 768 // 256
    assert sum(a.nbytes for a in packed.values()) == KERNEL_BYTES_PER_256[qtype] * n_256
    assert raw.nbytes == GGUF_BYTES_PER_256[qtype] * n_256
    assert qb.kernel_k(packed, qtype) == 768


@pytest.mark.parametrize("qtype,zoo", [("q5_k", "zoo-Q5_K_S.gguf"), ("q6_k", "zoo-Q6_K.gguf"),
                                       ("q4_k", "zoo-Q4_K_S.gguf")])
def test_kernel_layout_real_llama_cpp_blocks(qtype, zoo):
    """Blocks written by llama-quantize (real scale / min / high-bit patterns): the kernel layout
    dequantizes them bitwise as gguf does, and the kernel's grouped product on the real expert stack
    equals the reference bitwise."""
    from sharpi_jax.gguf.reader import GGUFFile

    f = GGUFFile(fixture_path("quant-zoo", zoo))
    tensors = [(n, t) for n, t in f.tensors.items() if t.qtype.name.lower() == qtype]
    assert tensors, f"{zoo} holds no {qtype} tensor"
    for name, t in tensors:
        raw = np.asarray(f.raw(name)).reshape(*t.shape[:-1], -1)
        want = gq.dequantize(raw, GGML[qtype])
        got = jax.jit(lambda r, k=t.shape[-1]: qb.dequantize_packed(qb.pack(r, qtype, k), qtype))(jnp.asarray(raw))
        assert_bitwise_equal(np.asarray(got), want.reshape(t.shape))
    exps = [(n, t) for n, t in tensors if n.endswith("ffn_down_exps.weight")]
    if exps and qtype != "q4_k":  # (Q4_K's kernel: test_grouped_matmul.py)
        name, t = exps[0]
        raw = np.asarray(f.raw(name)).reshape(*t.shape[:-1], -1)
        _run(np.random.default_rng(12), qtype, [1, 3, 3, 0, 3], t.shape[0], t.shape[1], t.shape[2], block_n=64,
             raw=raw)


def test_q6_k_tile_index_is_ggufs_order():
    """The kernel's (byte offset, shift) per 32-column sub-block reproduces gguf's reshapes."""
    idx = np.arange(256)
    ql = (idx[:128].reshape(2, 1, 64) + np.zeros((1, 2, 1), int)).reshape(8, 32)  # gguf: [h][shift][64]
    qh = (idx[:64].reshape(2, 1, 32) + np.zeros((1, 4, 1), int)).reshape(8, 32)  # gguf: [h][shift][32]
    for sub in range(8):
        ql_off, shift_l, qh_off, shift_h = qb.q6_k_tile_index(sub)
        np.testing.assert_array_equal(ql[sub], ql_off + np.arange(32))
        np.testing.assert_array_equal(qh[sub], qh_off + np.arange(32))
        assert shift_l == [0, 4][(sub // 2) % 2] and shift_h == [0, 2, 4, 6][sub % 4]


# ----------------------------------------------------------------------------- kernel, interpret mode


@pytest.mark.parametrize("qtype", ["q5_k", "q6_k"])
def test_grouped_with_empty_experts_and_padding(qtype):
    """Experts: 5 groups, group 2 empty, group 3 skewed (two tiles), padding rows in every tile."""
    rng = np.random.default_rng(13)
    ids = np.array([3, 0, 3, 1, 3, 3, 0, 4, 4, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3])
    y, lay = _run(rng, qtype, ids, n_groups=5, n_out=32, k=512)
    empty = np.repeat(np.asarray(lay.tile_group) < 0, 16)
    assert empty.any() and (y[empty] == 0).all()


@pytest.mark.parametrize("qtype,m,n_out,block_n", [
    ("q5_k", 1, 32, 32),   # M = 1 (decode); the ssm_alpha / ssm_beta class: N only a multiple of 32
    ("q6_k", 64, 64, 64),  # M = 64: four full row tiles
])
def test_dense_one_group_rows(qtype, m, n_out, block_n):
    """A dense matrix is one group: M rows (sampled from 1..64 here, all of them under -m slow)."""
    _run(np.random.default_rng(14 + m), qtype, np.zeros(m, int), 1, n_out, 256, block_n=block_n)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", KQUANTS)
def test_every_m_from_1_to_64(qtype):
    rng = np.random.default_rng(15)
    for m in range(1, 65):
        _run(rng, qtype, rng.integers(0, 3, m), 3, 32, 256, block_n=32)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", KQUANTS)
@pytest.mark.parametrize("cls", list(SLICE_SHAPES))
def test_slice_shapes(qtype, cls):
    """The slice's own N x K per shape class, 4 rows (dense: one group)."""
    n_out, k = SLICE_SHAPES[cls]
    _run(np.random.default_rng(16), qtype, np.zeros(4, int), 1, n_out, k, block_n=min(64, n_out))


# ----------------------------------------------------------------------------- GPU lowering


@pytest.mark.parametrize("qtype", ["q5_k", "q6_k"])
def test_triton_lowering_on_cpu(qtype):
    """The Q5_K / Q6_K kernels lower for CUDA through Triton here (compiling and running need a GPU)."""
    rng = np.random.default_rng(17)
    k, n_out, g, bm = 512, 64, 3, 16
    packed = qb.pack(jnp.asarray(qb.random_blocks(rng, (g, n_out, k), qtype)), qtype, k)
    lay = gm.group_layout(jnp.asarray(rng.integers(0, g, 10), jnp.int32), g, bm)
    xp = jnp.zeros((lay.n_padded_rows, k), jnp.float32)

    def f(x, w, tg):
        return gm.grouped_matmul(x, w, tg, qtype=qtype, block_m=bm, block_n=64)

    text = lower_for_cuda(lambda: jax.jit(f).trace(xp, packed, lay.tile_group).lower(lowering_platforms=("cuda",)))
    assert "__gpu$xla.gpu.triton" in text
    assert f"grouped_matmul_{qtype}" in text
