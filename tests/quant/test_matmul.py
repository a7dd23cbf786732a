"""The quant layer: QTensor layouts hold the file's values, and every matmul backend agrees with the
reference (exact dequantization + float32 dot) to its stated tolerance, row by row."""

from __future__ import annotations

import importlib

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharpi_jax.errors import InputError, UnsupportedQuantError
from sharpi_jax.quant import MatrixFormat, matmul, pack, pack_rows, reference_matmul, resolve_kernels, weight_layout
from sharpi_jax.quant import ggml as qtensor_ggml
from sharpi_jax.quant import qtensor
from sharpi_jax.quant.backends.xla import quantize_rows_int8
from sharpi_jax.pallas_kernels import quant_blocks as qb
from tests.bitwise import assert_bitwise_equal
from tests.cuda_lowering import lower_for_cuda
from tests.gguf.test_quants import _random_blocks as random_blocks

Q = gguf.GGMLQuantizationType
N, K = 64, 256


def _raw(qt: Q, rng, rows=N, cols=K) -> np.ndarray:
    """Valid GGUF bytes [rows, row_bytes] of type qt (gguf's quantizer, or random valid blocks)."""
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if qt == Q.F32:
        return w.view(np.uint8)
    if qt == Q.F16:
        return w.astype(np.float16).view(np.uint8)
    if qt == Q.Q4_K:
        return qb.quantize_q4_k_np(w)
    if qt == Q.Q6_K:  # gguf has no Q6_K quantizer: random valid blocks (finite f16 super-block scale d)
        blocks = rng.integers(0, 256, (rows * cols // 256, 210), dtype=np.uint8)
        blocks[:, 208:210] = (rng.uniform(0.5, 1.5, (len(blocks), 1)) * 2**-12).astype(np.float16).view(np.uint8)
        return blocks.reshape(rows, -1)
    if qt == Q.Q5_K:  # nor a Q5_K one
        return qb.random_blocks(rng, (rows, cols), "q5_k")
    if qt in NEW_TYPES:  # no gguf quantizer: random blocks with finite scales, extreme scales first
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        return random_blocks(qt, int(rng.integers(1 << 30)), rows * cols // bs).reshape(rows, -1)
    return np.asarray(gguf.quants.quantize(w, qt)).reshape(rows, -1)


# The i-quants, ternary and NVFP4 types: held as GGUF blocks, dequantized exactly.
NEW_TYPES = [Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.TQ1_0, Q.TQ2_0, Q.NVFP4]
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_K, Q.Q5_0, Q.Q5_K, Q.Q6_K, *NEW_TYPES]
EXACT_LAYOUTS = ("float", "float_t", "blocks", "soa", "kernel")


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_layouts_hold_the_files_values(qt):
    """Every exact layout dequantizes bitwise to gguf.quants.dequantize; the others raise clearly."""
    raw = _raw(qt, np.random.default_rng(int(qt)))
    want = np.asarray(gguf.quants.dequantize(raw, qt), np.float32).reshape(N, K)
    held = []
    for layout in EXACT_LAYOUTS:
        try:
            w = pack(jnp.asarray(raw), int(qt), (N, K), layout)
        except UnsupportedQuantError as e:
            assert qt.name in str(e) and layout in str(e)
            continue
        held.append(layout)
        assert w.shape == (N, K) and w.layout == layout
        assert_bitwise_equal(w.dequantize(), want)
        if layout in ("blocks", "soa"):
            assert w.nbytes == raw.nbytes == w.gguf_nbytes  # the same bytes, nothing expanded
    assert "blocks" in held  # every supported type can stay in its GGUF bytes


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_int8_repack_error_bound(qt):
    """The lossy int8 repacking is within half a step of the exact value, per weight."""
    raw = _raw(qt, np.random.default_rng(3))
    exact = np.asarray(gguf.quants.dequantize(raw, qt), np.float32).reshape(N, K)
    w = pack(jnp.asarray(raw), int(qt), (N, K), "int8")
    s = np.asarray(w.data["s"])
    assert w.data["q"].dtype == jnp.int8 and w.nbytes == N * K + 4 * N
    err = np.abs(np.asarray(w.dequantize()) - exact)
    assert (err <= s * 0.5001).all()  # half a step, plus float32 rounding of w * (127 / max)
    np.testing.assert_allclose(s[:, 0], np.abs(exact).max(-1) / 127, rtol=1e-6)


def test_pack_rows_chunks_int8_like_the_whole(monkeypatch):
    """Row-chunked int8 repacking (bounded memory for an LM head) equals packing in one go."""
    raw = _raw(Q.Q6_K, np.random.default_rng(4), rows=40)
    whole = pack_rows(raw, int(Q.Q6_K), K, "int8")
    monkeypatch.setattr(qtensor, "CHUNK_VALUES", 3 * K)  # 3 rows per chunk, ragged last chunk
    chunked = pack_rows(raw, int(Q.Q6_K), K, "int8")
    assert_bitwise_equal(chunked.data["q"], whole.data["q"])
    assert_bitwise_equal(chunked.data["s"], whole.data["s"])


LAYOUT_TOLERANCE = {"float": 1e-6, "float_t": 1e-6, "blocks": 1e-6, "soa": 1e-6, "kernel": 1e-6,
                    "int8": 1.5e-2}  # int8: weights rounded to 1/254 of their row max (activations ~exact)


@pytest.mark.parametrize("qt", [Q.F32, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.IQ1_M, Q.NVFP4],
                         ids=lambda t: t.name)
def test_matmul_layouts_match_the_reference(qt):
    rng = np.random.default_rng(5)
    raw = _raw(qt, rng)
    x = jnp.asarray(rng.standard_normal((5, K), dtype=np.float32))
    ref = np.asarray(reference_matmul(x, pack(jnp.asarray(raw), int(qt), (N, K), "blocks")))
    want = x @ np.asarray(gguf.quants.dequantize(raw, qt), np.float32).reshape(N, K).T
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-6)
    for layout in (*EXACT_LAYOUTS, "int8"):
        try:
            w = pack(jnp.asarray(raw), int(qt), (N, K), layout)
        except UnsupportedQuantError:
            continue
        y = np.asarray(matmul(x, w))
        rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        assert rel <= LAYOUT_TOLERANCE[layout], (layout, rel)


def test_int8_matmul_error_is_bounded_by_the_activation_planes():
    """Against the repacked weights themselves, the int8 path only rounds activations, in two planes:
    |error| <= (max|x_row| / 254 / 254 + float32 rounding) * sum|w_row| per output."""
    rng = np.random.default_rng(6)
    w = pack(jnp.asarray(_raw(Q.Q8_0, rng)), int(Q.Q8_0), (N, K), "int8")
    x = rng.standard_normal((7, K)).astype(np.float32) * 3
    x[:, 5] *= 40  # an outlier channel, as real hidden states have
    wq = np.asarray(w.dequantize(), np.float64)  # the repacked weights, exactly
    want = x.astype(np.float64) @ wq.T
    got = np.asarray(jax.jit(matmul)(jnp.asarray(x), w), np.float64)
    amax = np.abs(x).max(-1, keepdims=True)
    bound = (amax / 254 / 254 * 1.01 + amax * 2**-22) * np.abs(wq).sum(-1)[None, :]
    assert (np.abs(got - want) <= bound).all()
    one_plane = np.round(x / (amax / 127)) * (amax / 127) @ wq.T  # what a single plane would give
    assert np.abs(one_plane - want).max() > 20 * np.abs(got - want).max()


@pytest.mark.parametrize("layout", ["float_t", "soa", "blocks", "int8", "kernel"])
def test_rows_do_not_depend_on_the_batch(layout):
    """What batched == sequential verify rests on: a row's product is the same bits alone (as a
    2-row bucket) and inside any batch of M >= 2 rows (int8: any M, even 1)."""
    qt = Q.F32 if layout == "float_t" else Q.Q8_0
    rng = np.random.default_rng(7)
    w = pack(jnp.asarray(_raw(qt, rng)), int(qt), (N, K), layout)
    f = jax.jit(matmul)
    x = jnp.asarray(rng.standard_normal((16, K), dtype=np.float32))
    for m in (2, 3, 8, 16):
        full = np.asarray(f(x[:m], w))
        for i in range(m):
            alone = np.asarray(f(jnp.stack([x[i], jnp.zeros(K)]), w))[0]
            assert_bitwise_equal(full[i], alone)
    if layout == "int8":
        assert_bitwise_equal(np.asarray(f(x[3:4], w))[0], np.asarray(f(x, w))[3])


def test_layout_policy():
    assert weight_layout("xla", int(Q.F32), (N, K)) == "float_t"
    assert weight_layout("xla", int(Q.BF16), (N, K)) == "float_t"
    assert weight_layout("xla", int(Q.Q4_K), (N, K)) == "soa"
    assert weight_layout("xla", int(Q.Q6_K), (N, K)) == "blocks"
    assert weight_layout("xla", int(Q.Q6_K), (N, K), "int8") == "int8"
    assert weight_layout("xla", int(Q.Q6_K), (N, K), "auto") == "blocks"  # small: exact
    assert weight_layout("xla", int(Q.Q6_K), (248320, 2048), "auto") == "int8"  # an LM head
    assert weight_layout("pallas", int(Q.Q4_K), (248320, 2048), "auto") == "kernel"
    assert weight_layout("reference", int(Q.Q4_K), (N, K)) == "blocks"
    assert weight_layout("pallas", int(Q.Q4_K), (N, K)) == "kernel"
    assert weight_layout("pallas", int(Q.Q6_K), (N, K)) == "kernel"  # in-kernel Q5_K / Q6_K
    assert weight_layout("pallas", int(Q.Q5_K), (N, K)) == "kernel"
    assert weight_layout("pallas", int(Q.Q5_0), (N, K)) == "blocks"  # no in-kernel Q5_0: dequantize + dot
    assert weight_layout("pallas", int(Q.Q8_0), (17, K)) == "kernel"  # 17 outputs: rows padded to 32
    cpu_default = "ggml" if qtensor_ggml.available() else "xla"  # ggml where its extension is built
    assert resolve_kernels("auto", "cpu") == cpu_default and resolve_kernels("auto", "gpu") == "pallas"
    for bad in (lambda: resolve_kernels("cuda"), lambda: MatrixFormat("xla", "int4"),
                lambda: MatrixFormat("pallas", "int8")):
        with pytest.raises(InputError):
            bad()


@pytest.mark.parametrize("qt", [Q.F32, Q.Q6_K], ids=lambda t: t.name)
def test_kernel_layout_pads_rows_to_a_tile(qt):
    """A matrix of 17 outputs (a router of n_expert + 1 rows) is held with rows zero-padded to 32, and
    its product and dequantization are those of the 17 rows."""
    rng = np.random.default_rng(9)
    raw = _raw(qt, rng, rows=17)
    w = pack(jnp.asarray(raw), int(qt), (17, K), "kernel")
    assert w.shape == (17, K) and all(a.shape[0] == 32 for a in w.data.values())
    want = np.asarray(gguf.quants.dequantize(raw, qt), np.float32).reshape(17, K)
    assert_bitwise_equal(w.dequantize(), want)
    x = jnp.asarray(rng.standard_normal((3, K), dtype=np.float32))
    y = np.asarray(matmul(x, w))
    assert y.shape == (3, 17)
    np.testing.assert_allclose(y, np.asarray(x) @ want.T, rtol=1e-5, atol=1e-5)


def test_matmul_shape_mismatch_is_a_clear_error():
    w = pack(jnp.asarray(_raw(Q.Q8_0, np.random.default_rng(8))), int(Q.Q8_0), (N, K), "soa")
    with pytest.raises(InputError, match="do not contract"):
        matmul(jnp.zeros((2, K + 32)), w)


def test_kernel_layout_lowers_for_triton_on_cpu():
    """The Pallas backend's dense matmul (one group of the grouped kernel) lowers for CUDA here."""
    w = pack(jnp.asarray(_raw(Q.Q4_K, np.random.default_rng(9))), int(Q.Q4_K), (N, K), "kernel")
    text = lower_for_cuda(lambda: jax.jit(lambda x, w: matmul(x, w, interpret=False)).trace(
        jnp.zeros((2, K)), w).lower(lowering_platforms=("cuda",)))
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("layout", ["soa", "blocks"])
def test_large_matrices_dequantize_in_chunks_with_the_same_bits(monkeypatch, layout):
    """An LM-head-sized matrix is dequantized chunk by chunk inside the step (bounded memory); the
    result is bitwise the one-shot product, so chunking cannot break batched == sequential parity."""
    mm = importlib.import_module("sharpi_jax.quant.backends.reference")  # the dequantize-then-dot path
    rng = np.random.default_rng(10)
    w = pack(jnp.asarray(_raw(Q.Q8_0, rng, rows=96)), int(Q.Q8_0), (96, K), layout)
    x = jnp.asarray(rng.standard_normal((4, K), dtype=np.float32))
    whole = jax.jit(matmul)(x, w)
    monkeypatch.setattr(mm, "DEQUANT_CHUNK_VALUES", 32 * K)
    assert mm._n_chunks(96, K) == 3
    assert_bitwise_equal(jax.jit(matmul)(x, w), whole)
