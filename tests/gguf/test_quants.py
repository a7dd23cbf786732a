"""Bitwise parity of sharpi_jax.gguf.quants with gguf-py's numpy dequantization."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from sharpi_jax.errors import GGUFError, UnsupportedQuantError
from sharpi_jax.gguf import quants
from tests.bitwise import assert_bitwise_equal
from tests.conftest import FIXTURES


def _fixture_ggufs() -> list:
    files = sorted([*FIXTURES.glob("quant-zoo/*.gguf"), *FIXTURES.glob("tiny-*/*.gguf")])
    if not files:  # (under CI=true the session has already stopped: conftest.pytest_sessionstart)
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"reference GGUFs not found under {FIXTURES}"))]
    return [pytest.param(p, id=f"{p.parent.name}/{p.name}") for p in files]


def _reference(raw: np.ndarray, qtype: Q) -> np.ndarray:
    with warnings.catch_warnings():  # gguf-py warns on inf products (MXFP4 with e=255)
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)


def _assert_bitwise(ours, ref: np.ndarray, what: str = "") -> None:
    assert ref.dtype == np.float32, what
    assert_bitwise_equal(np.asarray(ours), ref, what)


# --- random blocks with sanitised scale fields ----------------------------------------------

# Byte offsets of the f16 scale fields in each block (ggml-common.h layouts).
_F16_FIELDS = {
    Q.F16: (0,),
    Q.Q8_0: (0,),              # d, qs[32]
    Q.Q4_0: (0,),              # d, qs[16]
    Q.Q4_1: (0, 2),            # d, m, qs[16]
    Q.Q5_0: (0,),              # d, qh[4], qs[16]
    Q.Q5_1: (0, 2),            # d, m, qh[4], qs[16]
    Q.Q2_K: (80, 82),          # scales[16], qs[64], d, dmin
    Q.Q3_K: (108,),            # hmask[32], qs[64], scales[12], d
    Q.Q4_K: (0, 2),            # d, dmin, scales[12], qs[128]
    Q.Q5_K: (0, 2),            # d, dmin, scales[12], qh[32], qs[128]
    Q.Q6_K: (208,),            # ql[128], qh[64], scales[16], d
    Q.IQ4_NL: (0,),            # d, qs[16]
    Q.IQ4_XS: (0,),            # d, scales_h (u16), scales_l[4], qs[128]
    Q.TQ1_0: (52,),            # qs[48], qh[4], d
    Q.TQ2_0: (64,),            # qs[64], d
    Q.IQ2_XXS: (0,),           # d, qs (u16)[32]
    Q.IQ2_XS: (0,),            # d, qs (u16)[32], scales[8]
    Q.IQ2_S: (0,),             # d, qs[32], signs[32], qh[8], scales[8]
    Q.IQ3_XXS: (0,),           # d, qs[64], scales_and_signs[32]
    Q.IQ3_S: (0,),             # d, qs[64], qh[8], signs[32], scales[4]
    Q.IQ1_S: (0,),             # d, qs[32], qh (u16)[8]
}

# Extreme finite f16 scales: +-65504, +-smallest subnormal, +-0, smallest normal, largest subnormal, 1.
_F16_SPECIAL = np.array([0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0000, 0x8000, 0x0400, 0x03FF, 0x3C00],
                        dtype=np.uint16)
_BF16_SPECIAL = np.array([0x7F7F, 0xFF7F, 0x0001, 0x8001, 0x0000, 0x8000, 0x0080, 0x3F80], dtype=np.uint16)
_F32_SPECIAL = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001, 0, 0x80000000, 0x00800000],
                        dtype=np.uint32)
N_BLOCKS = 128


def _finite(bits: np.ndarray, exp_mask: int, special: np.ndarray) -> np.ndarray:
    """Replace inf/NaN bit patterns by finite ones and put the special values first."""
    bits = bits.copy()
    bad = (bits & exp_mask) == exp_mask
    bits[bad] &= ~np.asarray(exp_mask >> 1, bits.dtype)  # clear the exponent's top bit
    k = min(len(special), len(bits))
    bits[:k] = special[:k]
    return bits


def _random_blocks(qtype: Q, seed: int, n_blocks: int = N_BLOCKS) -> np.ndarray:
    """Random blocks of `qtype` whose scale fields are finite (extreme values first)."""
    rng = np.random.default_rng(seed)
    ts = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    if qtype == Q.F32:
        bits = _finite(blocks.view(np.uint32).reshape(-1), 0x7F800000, _F32_SPECIAL)
        return bits.view(np.uint8).reshape(n_blocks, ts)
    if qtype == Q.BF16:
        bits = _finite(blocks.view(np.uint16).reshape(-1), 0x7F80, _BF16_SPECIAL)
        return bits.view(np.uint8).reshape(n_blocks, ts)
    if qtype == Q.MXFP4:
        # E8M0 exponent byte (every value is finite): extremes first, 0 and 1 give subnormal scales,
        # 255 overflows the larger e2m1 values to inf in gguf-py too; the rest stays random.
        blocks[:6, 0] = [0, 1, 2, 127, 254, 255]
        return blocks
    if qtype == Q.NVFP4:
        # Four UE4M3 sub-block scales (every byte is finite): zero, 0x7F (read as zero), the largest,
        # the sign bit set (ignored), subnormals first; the rest stays random.
        blocks[:2, :4] = [[0x00, 0x7F, 0x7E, 0xFF], [0x80, 0x01, 0x07, 0x08]]
        return blocks
    if qtype == Q.IQ1_M:
        # The f16 super-block scale is spread over the top nibbles of the four u16 scale words.
        words = np.ascontiguousarray(blocks[:, 48:56]).view(np.uint16)
        d = _finite(words[:, 0].copy(), 0x7C00, _F16_SPECIAL)
        words &= 0x0FFF
        for i in range(4):
            words[:, i] |= ((d >> (4 * i)) & 0xF) << 12
        blocks[:, 48:56] = words.view(np.uint8)
        return blocks
    for j, off in enumerate(_F16_FIELDS[qtype]):
        field = np.ascontiguousarray(blocks[:, off:off + 2]).view(np.uint16).reshape(-1)
        field = _finite(field, 0x7C00, np.roll(_F16_SPECIAL, 3 * j))
        blocks[:, off:off + 2] = field.view(np.uint8).reshape(n_blocks, 2)
    return blocks


_ALL = sorted(quants.SUPPORTED_TYPES, key=lambda t: t.value)


@functools.lru_cache(maxsize=None)
def _jit_blocks(qtype: Q):
    return jax.jit(quants.dequantize_blocks, static_argnums=1)


@pytest.mark.parametrize("qtype", _ALL, ids=lambda t: t.name)
def test_random_blocks_bitwise(qtype: Q):
    blocks = _random_blocks(qtype, seed=qtype.value)
    bs = GGML_QUANT_SIZES[qtype][0]
    ref = _reference(blocks, qtype).reshape(N_BLOCKS, bs)
    assert not np.isnan(ref).any(), "test data must be NaN-free"

    _assert_bitwise(quants.dequantize_blocks(blocks, qtype), ref, "eager dequantize_blocks")
    _assert_bitwise(_jit_blocks(qtype)(blocks, qtype), ref, "jitted dequantize_blocks")
    # The wrapper: flat bytes with a 2-d logical shape.
    shape = (4, N_BLOCKS * bs // 4)
    _assert_bitwise(quants.dequantize(blocks.reshape(-1), qtype, shape), ref.reshape(shape), "dequantize")


def test_mxfp4_every_exponent_and_code():
    """All 256 E8M0 exponents times all 16 e2m1 codes (subnormal and overflowing scales included)."""
    blocks = np.zeros((256, 17), np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = [lo | ((15 - lo) << 4) for lo in range(16)]  # every code in both nibbles
    ref = _reference(blocks, Q.MXFP4)
    assert ((ref != 0) & (np.abs(ref) < np.finfo(np.float32).tiny)).any()  # subnormal outputs exist
    _assert_bitwise(_jit_blocks(Q.MXFP4)(blocks, Q.MXFP4), ref, "jitted")


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: t.name)
def test_float_types_accept_typed_arrays(qtype: Q):
    blocks = _random_blocks(qtype, seed=7)
    ref = _reference(blocks, qtype).reshape(8, -1)
    typed = blocks.reshape(-1).view({Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.uint16}[qtype])
    _assert_bitwise(quants.dequantize(typed.reshape(8, -1), qtype, (8, typed.size // 8)), ref, "typed input")


# The types the fixtures' quant zoo has no file of: random valid blocks written into a GGUF by gguf-py's
# writer, read back through GGUFFile (header, offsets, mmap view) and dequantized.
_NOT_IN_ZOO = [Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.TQ1_0, Q.TQ2_0, Q.NVFP4]


def test_types_outside_the_zoo_through_a_written_gguf(tmp_path):
    from sharpi_jax.gguf import GGUFFile

    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(path, "qwen35moe")
    written = {}
    for qtype in _NOT_IN_ZOO:
        bs, ts = GGML_QUANT_SIZES[qtype]
        rows = _random_blocks(qtype, seed=100 + qtype.value).reshape(8, -1)  # 8 rows of 16 blocks
        w.add_tensor(f"t.{qtype.name}", rows, raw_shape=rows.shape, raw_dtype=qtype)
        written[qtype] = (rows, (8, rows.shape[1] // ts * bs))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with GGUFFile(path) as f:
        for qtype, (rows, shape) in written.items():
            info = f.tensor(f"t.{qtype.name}")
            assert (info.qtype, info.shape) == (qtype, shape)
            ref = _reference(rows, qtype).reshape(shape)
            assert not np.isnan(ref).any()
            _assert_bitwise(f.dequantize(f"t.{qtype.name}"), ref, qtype.name)


# --- every tensor of the reference GGUFs ------------------------------------------------------

@pytest.mark.parametrize("path", _fixture_ggufs())
def test_fixture_gguf_tensors_bitwise(path: Path):
    reader = gguf.GGUFReader(path)
    seen = set()
    for t in reader.tensors:
        qtype = Q(t.tensor_type)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        ours = quants.dequantize(t.data, qtype, shape, name=t.name)
        ref = _reference(t.data, qtype).reshape(shape)
        _assert_bitwise(ours, ref, f"{path.name}:{t.name} ({qtype.name})")
        seen.add(qtype)
    assert seen <= quants.SUPPORTED_TYPES


# --- API: qtype forms, sizes, errors ----------------------------------------------------------

def test_qtype_forms():
    blocks = _random_blocks(Q.Q4_K, seed=1)[:4]
    ref = _reference(blocks, Q.Q4_K).reshape(4, 256)
    for form in (Q.Q4_K, int(Q.Q4_K), np.int32(Q.Q4_K), "Q4_K", "q4_k"):
        _assert_bitwise(quants.dequantize(blocks, form, (4, 256)), ref, f"qtype as {form!r}")
        _assert_bitwise(quants.dequantize_blocks(blocks, form), ref, f"blocks, qtype as {form!r}")
    assert quants.block_size("Q4_K") == 256 and quants.type_size(Q.Q4_K) == 144
    assert quants.block_size(int(Q.Q8_0)) == 32 and quants.type_size("Q8_0") == 34
    assert quants.byte_shape(Q.Q4_K, (3, 512)) == (3, 288)
    assert quants.byte_shape("F32", (2, 5)) == (2, 20)
    assert all(isinstance(t, Q) for t in quants.SUPPORTED_TYPES) and len(quants.SUPPORTED_TYPES) == 26
    for t in quants.SUPPORTED_TYPES:
        assert (quants.block_size(t), quants.type_size(t)) == GGML_QUANT_SIZES[t]


def _gguf_py_dequantizes(qtype: Q) -> bool:
    ts = GGML_QUANT_SIZES[qtype][1]
    try:
        gguf.quants.dequantize(np.zeros((1, ts), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def test_every_type_gguf_py_dequantizes_is_supported():
    """The supported set is exactly what the installed gguf-py can dequantize (26 types in gguf 0.19)."""
    theirs = {t for t in Q if t in GGML_QUANT_SIZES and _gguf_py_dequantizes(t)}
    assert quants.SUPPORTED_TYPES == theirs


@pytest.mark.parametrize("qtype", [Q.Q8_K, Q.Q8_1, "Q8_K", int(Q.Q1_0), Q.I32])
def test_unsupported_type_named(qtype):
    name = quants.normalize_qtype(qtype).name
    bs, ts = GGML_QUANT_SIZES[quants.normalize_qtype(qtype)]
    raw = np.zeros(ts, np.uint8)
    with pytest.raises(UnsupportedQuantError, match=rf"unsupported ggml quant type {name}\b"):
        quants.dequantize(raw, qtype, (bs,))
    with pytest.raises(UnsupportedQuantError, match=name):
        quants.dequantize_blocks(raw.reshape(1, ts), qtype)


def test_unknown_type():
    with pytest.raises(UnsupportedQuantError, match="NOPE"):
        quants.dequantize(np.zeros(4, np.uint8), "NOPE", (1,))
    with pytest.raises(UnsupportedQuantError, match="9999"):
        quants.dequantize(np.zeros(4, np.uint8), 9999, (1,))


def test_bad_sizes_raise_gguf_error():
    raw = np.zeros(2 * 144, np.uint8)
    with pytest.raises(GGUFError, match=r"blk\.0\.w.*needs 432 bytes, got 288"):
        quants.dequantize(raw, Q.Q4_K, (3, 256), name="blk.0.w")
    with pytest.raises(GGUFError, match="not a multiple of the Q4_K block size 256"):
        quants.dequantize(raw, Q.Q4_K, (2, 128))
    with pytest.raises(GGUFError, match="block size 32"):
        quants.byte_shape("Q8_0", (4, 33))
    with pytest.raises(GGUFError, match="last dimension of 144 bytes"):
        quants.dequantize_blocks(np.zeros((2, 143), np.uint8), Q.Q4_K)
    with pytest.raises(GGUFError, match="uint8"):
        quants.dequantize_blocks(np.zeros((2, 144), np.int32), Q.Q4_K)


def test_jit_inside_larger_function():
    """The core composes with other ops under jit (e.g. a dequantize-then-matmul expert)."""
    blocks = _random_blocks(Q.Q8_0, seed=3)[:8]
    ref = _reference(blocks, Q.Q8_0).reshape(8, 32)

    @jax.jit
    def f(b):
        return quants.dequantize_blocks(b, Q.Q8_0).reshape(8, 32)

    assert f(blocks).shape == (8, 32)
    _assert_bitwise(f(blocks), ref, "inside jit")


def test_blocks_keep_leading_dims():
    blocks = _random_blocks(Q.Q4_K, seed=5)
    ref = _reference(blocks, Q.Q4_K).reshape(2, N_BLOCKS // 2, 256)
    _assert_bitwise(_jit_blocks(Q.Q4_K)(blocks.reshape(2, N_BLOCKS // 2, -1), Q.Q4_K), ref, "3-d blocks")
