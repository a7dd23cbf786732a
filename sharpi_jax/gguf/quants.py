"""Dequantization of ggml block types in pure `jax.numpy`, bitwise equal to `gguf.quants.dequantize`.

The core, `dequantize_blocks`, maps a `[..., type_size]` uint8 array of ggml blocks to the
`[..., block_size]` float32 values. It is pure jnp with a static `qtype`, so it can run inside
`jax.jit` (or a Pallas kernel body) to dequantize weights on device right where they are used.
`dequantize` is the host-side convenience wrapper: it validates the byte count against the logical
shape, splits the bytes into blocks and runs a cached jitted core.

Bit parity with gguf-py. Each formula below follows gguf-py's order of operations. In that order
every product is exact in float32 (an f16 scale times small integers stays below 24 significant
bits), so XLA CPU contracting `a * b + c` into a fused multiply-add cannot change a bit: the only
rounding is the final add, as in numpy. XLA CPU also flushes subnormals to zero (inputs and
outputs of float arithmetic). F32/BF16 are pure bit moves and f16 -> f32 is an exact convert, so
the only affected case is MXFP4 with an E8M0 exponent byte of 0 or 1 (subnormal scale), which is
built from integer bits instead (see `_mxfp4`).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from jax import lax

from sharpi_jax.errors import GGUFError, UnsupportedQuantError
from sharpi_jax.gguf import iq_grids

Q = GGMLQuantizationType
QK_K = 256

__all__ = [
    "SUPPORTED_TYPES",
    "block_size",
    "byte_shape",
    "dequantize",
    "dequantize_blocks",
    "normalize_qtype",
    "type_size",
]


# ---------------------------------------------------------------------------------------------
# Bit-unpacking helpers (all operate on [n, bytes] arrays; n = number of blocks)
# ---------------------------------------------------------------------------------------------

def _f16(b: jax.Array) -> jax.Array:
    """Little-endian f16 fields [n, 2*k] uint8 -> [n, k] float32 (exact, subnormals included)."""
    b = b.astype(jnp.uint16).reshape(b.shape[0], -1, 2)
    u = b[..., 0] | (b[..., 1] << 8)
    return lax.bitcast_convert_type(u, jnp.float16).astype(jnp.float32)


def _u16(b: jax.Array) -> jax.Array:
    """Little-endian uint16 fields [n, 2*k] uint8 -> [n, k] uint16."""
    b = b.astype(jnp.uint16).reshape(b.shape[0], -1, 2)
    return b[..., 0] | (b[..., 1] << 8)


def _u32(b: jax.Array) -> jax.Array:
    """Little-endian uint32 fields [n, 4*k] uint8 -> [n, k] uint32."""
    b = b.astype(jnp.uint32).reshape(b.shape[0], -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _unpack(x: jax.Array, width: int, n_shifts: int, bits: int) -> jax.Array:
    """gguf-py's recurring `x.reshape(n, -1, 1, width) >> shifts.reshape(1, 1, S, 1) & mask`.

    [n, G*width] -> [n, G*S*width]: for each group of `width` bytes, first all the lowest `bits`-bit
    fields, then the next ones, and so on (shift s = i*bits).
    """
    n = x.shape[0]
    shifts = (jnp.arange(n_shifts, dtype=x.dtype) * bits).reshape(1, 1, n_shifts, 1)
    y = (x.reshape(n, -1, 1, width) >> shifts) & jnp.asarray((1 << bits) - 1, x.dtype)
    return y.reshape(n, -1)


def _lut16(idx: jax.Array, table: Sequence[int]) -> jax.Array:
    """Look up a 16-entry integer table with a 4-level select tree (int32 result).

    Equivalent to `jnp.take(table, idx)` but purely elementwise, so it also lowers inside Pallas
    kernels, where gathers are not generally available.
    """
    idx = idx.astype(jnp.int32)
    level = [jnp.int32(v) for v in table]
    for bit in range(4):
        sel = ((idx >> bit) & 1) == 1
        level = [jnp.where(sel, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
    return level[0]


_KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# e2m1 values doubled, as in gguf-py / ggml's kvalues_mxfp4.
_KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _get_scale_min_k4(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K packed 6-bit scales and mins: [n, 12] uint8 -> two [n, 8] uint8."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


# ---------------------------------------------------------------------------------------------
# Per-type decoders: [n, type_size] uint8 -> [n, block_size] float32
# ---------------------------------------------------------------------------------------------

def _f32(b):
    return lax.bitcast_convert_type(_u32(b), jnp.float32)


def _bf16(b):
    # Raw bit move; no float arithmetic, so subnormals and NaN payloads survive.
    return lax.bitcast_convert_type(_u16(b).astype(jnp.uint32) << 16, jnp.float32)


def _q8_0(b):
    d = _f16(b[:, :2])
    x = lax.bitcast_convert_type(b[:, 2:], jnp.int8).astype(jnp.float32)
    return x * d


def _q4_0(b):
    d = _f16(b[:, :2])
    q = _unpack(b[:, 2:], 16, 2, 4).astype(jnp.int32) - 8
    return d * q.astype(jnp.float32)


def _q4_1(b):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _unpack(b[:, 4:], 16, 2, 4).astype(jnp.float32)
    return (d * q) + m


def _q5_0(b):
    d = _f16(b[:, :2])
    qh = _unpack(_u32(b[:, 2:6]), 1, 32, 1).astype(jnp.int32)
    ql = _unpack(b[:, 6:], 16, 2, 4).astype(jnp.int32)
    q = (ql | (qh << 4)) - 16
    return d * q.astype(jnp.float32)


def _q5_1(b):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    qh = _unpack(_u32(b[:, 4:8]), 1, 32, 1).astype(jnp.int32)
    ql = _unpack(b[:, 8:], 16, 2, 4).astype(jnp.int32)
    q = (ql | (qh << 4)).astype(jnp.float32)
    return (d * q) + m


def _q2_k(b):
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).astype(jnp.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).astype(jnp.float32)).reshape(n, 16, 1)
    q = _unpack(qs, 32, 4, 2).reshape(n, 16, 16).astype(jnp.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])
    lsc = _unpack(scales[:, :8], 8, 2, 4)
    hsc = _unpack(scales[:, 8:12], 4, 4, 2)
    sc = ((lsc | (hsc << 4)).astype(jnp.int32) - 32).astype(jnp.float32)
    dl = (d * sc).reshape(n, 16, 1)
    ql = _unpack(qs, 32, 4, 2).astype(jnp.int32)
    qh = _unpack(hmask, 32, 8, 1).astype(jnp.int32) ^ 1  # offset 4 applies when the bit is 0
    q = (ql - (qh << 2)).astype(jnp.float32).reshape(n, 16, 16)
    return (dl * q).reshape(n, QK_K)


def _k4_scales(b):
    """Q4_K / Q5_K: the 8 sub-blocks' scales d * sc and offsets dmin * mn, each [n, 8, 1]."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _get_scale_min_k4(b[:, 4:16])
    return (d * sc.astype(jnp.float32)).reshape(n, 8, 1), (dmin * mn.astype(jnp.float32)).reshape(n, 8, 1)


def _q4_k(b):
    n = b.shape[0]
    dl, dm = _k4_scales(b)
    q = _unpack(b[:, 16:], 32, 2, 4).reshape(n, 8, 32).astype(jnp.float32)
    return (dl * q - dm).reshape(n, QK_K)


def _q5_k(b):
    n = b.shape[0]
    dl, dm = _k4_scales(b)
    qh = _unpack(b[:, 16:48], 32, 8, 1)
    ql = _unpack(b[:, 48:], 32, 2, 4)
    q = (ql | (qh << 4)).reshape(n, 8, 32).astype(jnp.float32)
    return (dl * q - dm).reshape(n, QK_K)


def _q6_k(b):
    n = b.shape[0]
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = _f16(b[:, 208:210])
    sc = lax.bitcast_convert_type(scales, jnp.int8).astype(jnp.float32)
    dl = (d * sc).reshape(n, 16, 1)
    lo = _unpack(ql, 64, 2, 4)
    hi = _unpack(qh, 32, 4, 2)
    q = ((lo | (hi << 4)).astype(jnp.int32) - 32).astype(jnp.float32).reshape(n, 16, 16)
    return (dl * q).reshape(n, QK_K)


def _iq4_nl(b):
    d = _f16(b[:, :2])
    q = _lut16(_unpack(b[:, 2:], 16, 2, 4), _KVALUES_IQ4NL).astype(jnp.float32)
    return d * q


def _iq4_xs(b):
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    sh = _unpack(_u16(b[:, 2:4]), 1, 8, 2)
    sl = _unpack(b[:, 4:8], 1, 2, 4)  # byte k's low nibble is scale 2k, its high nibble 2k+1
    sc = ((sl.astype(jnp.int32) | (sh.astype(jnp.int32) << 4)) - 32).astype(jnp.float32)
    dl = (d * sc).reshape(n, 8, 1)
    q = _lut16(_unpack(b[:, 8:], 16, 2, 4), _KVALUES_IQ4NL).astype(jnp.float32).reshape(n, 8, 32)
    return (dl * q).reshape(n, QK_K)


def _mxfp4(b):
    e = b[:, :1].astype(jnp.uint32)
    k = _lut16(_unpack(b[:, 1:], 16, 2, 4), _KVALUES_MXFP4)
    # ggml_e8m0_to_fp32_half: 2^(e-128), i.e. bits (e-1) << 23 for e >= 2; e < 2 is handled below.
    d = lax.bitcast_convert_type((jnp.maximum(e, 2) - 1) << 23, jnp.float32)
    normal = lax.bitcast_convert_type(d * k.astype(jnp.float32), jnp.uint32)
    # e < 2: d is subnormal and XLA CPU would flush d and the product to zero, so build |k| * 2^(e-128)
    # = m * 2^-149 with m = |k| << (e + 21) from bits. m < 2^23 is a subnormal whose bits are m;
    # otherwise float(m) (exact, m has <= 2 significant bits) rescaled by 2^-149 in the exponent field.
    m = jnp.abs(k).astype(jnp.uint32) << (e + 21)
    m_as_normal = lax.bitcast_convert_type(m.astype(jnp.float32), jnp.uint32) - jnp.uint32(149 << 23)
    tiny = jnp.where(m < (1 << 23), m, m_as_normal) | jnp.where(k < 0, jnp.uint32(0x80000000), jnp.uint32(0))
    return lax.bitcast_convert_type(jnp.where(e < 2, tiny, normal), jnp.float32)


def _tq1_0(b):
    n = b.shape[0]
    qs, qh, d = b[:, :48], b[:, 48:52], _f16(b[:, 52:54])
    # Base-3 digits: multiplying a byte by 3^i (mod 256) brings digit i to the top; (x * 3) >> 8 reads it.
    pow3 = jnp.asarray([1, 3, 9, 27, 81], jnp.uint8).reshape(1, 1, 5, 1)
    q0 = (qs[:, :32].reshape(n, 1, 1, 32) * pow3).reshape(n, -1)
    q1 = (qs[:, 32:].reshape(n, 1, 1, 16) * pow3).reshape(n, -1)
    q2 = (qh.reshape(n, 1, 1, 4) * pow3[:, :, :4]).reshape(n, -1)
    q = jnp.concatenate([q0, q1, q2], axis=-1).astype(jnp.uint16)
    q = ((q * 3) >> 8).astype(jnp.int32) - 1
    return d * q.astype(jnp.float32)


def _tq2_0(b):
    d = _f16(b[:, 64:66])
    q = _unpack(b[:, :64], 32, 4, 2).astype(jnp.int32) - 1
    return d * q.astype(jnp.float32)


def _ue4m3_half(x: jax.Array) -> jax.Array:
    """NVFP4's unsigned E4M3 scale bytes (bias 7) -> float32, halved (the doubled e2m1 convention).

    0x00 and 0x7F decode to 0. The powers of two are built from exponent bits (exact, as numpy's)."""
    e = (x.astype(jnp.int32) >> 3) & 0xF
    man = (x & 7).astype(jnp.float32)
    sub = man * jnp.float32(2.0 ** -9)
    pow2 = lax.bitcast_convert_type((e - 7 + 127) << 23, jnp.float32)
    raw = jnp.where(e == 0, sub, (jnp.float32(1.0) + man / jnp.float32(8.0)) * pow2)
    return jnp.where((x == 0) | (x == 0x7F), jnp.float32(0.0), raw * jnp.float32(0.5))


def _nvfp4(b):
    n = b.shape[0]
    d = _ue4m3_half(b[:, :4]).reshape(n, 4, 1)
    qs = b[:, 4:].reshape(n, 4, 8)
    k = _lut16(jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1), _KVALUES_MXFP4)
    return (d * k.astype(jnp.float32)).reshape(n, 64)


def _table(qtype) -> jax.Array:
    return jnp.asarray(iq_grids.grid(qtype))


def _sign_bits(x: jax.Array) -> jax.Array:
    """Bytes [...] -> float32 [..., 8] of +1 / -1 per bit (bit i set: -1), lowest bit first."""
    bits = (x[..., None] >> jnp.arange(8, dtype=x.dtype)) & 1
    return jnp.where(bits == 0, jnp.float32(1), jnp.float32(-1))


def _ksigns(idx: jax.Array) -> jax.Array:
    """7-bit sign indices -> float32 [..., 8] signs through ggml's ksigns_iq2xs table."""
    return _sign_bits(jnp.take(jnp.asarray(iq_grids.KSIGNS), idx.astype(jnp.int32), axis=0))


def _nibbles(x: jax.Array) -> jax.Array:
    """[n, k] bytes -> [n, 2k]: each byte's low nibble, then its high nibble."""
    return _unpack(x, 1, 2, 4)


def _iq2_xxs(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    aux = _u32(b[:, 2:]).reshape(n, 8, 2)
    db = (d * (jnp.float32(0.5) + (aux[..., 1] >> 28).astype(jnp.float32)) * jnp.float32(0.25)).reshape(n, 8, 1, 1)
    signs = _ksigns((aux[..., 1:2] >> jnp.asarray([0, 7, 14, 21], jnp.uint32)) & 0x7F)  # [n, 8, 4, 8]
    grid = jnp.take(_table(Q.IQ2_XXS), b[:, 2:].reshape(n, 8, 8)[..., :4].astype(jnp.int32), axis=0)
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_xs(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs = _u16(b[:, 2:66])  # [n, 32]
    sc = _nibbles(b[:, 66:74]).astype(jnp.float32)
    db = (d * (jnp.float32(0.5) + sc) * jnp.float32(0.25)).reshape(n, 16, 1, 1)
    signs = _ksigns(qs >> 9).reshape(n, 16, 2, 8)
    grid = jnp.take(_table(Q.IQ2_XS), (qs & 511).astype(jnp.int32), axis=0).reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_s(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs, sb, qh, scales = b[:, 2:34], b[:, 34:66], b[:, 66:74], b[:, 74:82]
    db = (d * (jnp.float32(0.5) + _nibbles(scales).astype(jnp.float32)) * jnp.float32(0.25)).reshape(n, 16, 1, 1)
    signs = _sign_bits(sb).reshape(n, 16, 2, 8)
    idx = qs.astype(jnp.int32) | (_unpack(qh, 1, 4, 2).astype(jnp.int32) << 8)
    grid = jnp.take(_table(Q.IQ2_S), idx, axis=0).reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq3_xxs(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs, aux = b[:, 2:66], _u32(b[:, 66:98])  # aux [n, 8]
    db = (d * (jnp.float32(0.5) + (aux >> 28).astype(jnp.float32)) * jnp.float32(0.5)).reshape(n, 8, 1, 1)
    signs = _ksigns((aux[..., None] >> jnp.asarray([0, 7, 14, 21], jnp.uint32)) & 0x7F)  # [n, 8, 4, 8]
    grid = jnp.take(_table(Q.IQ3_XXS), qs.astype(jnp.int32), axis=0).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq3_s(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs, qh, sb, scales = b[:, 2:66], b[:, 66:74], b[:, 74:106], b[:, 106:110]
    db = (d * (1 + 2 * _nibbles(scales).astype(jnp.int32)).astype(jnp.float32)).reshape(n, 8, 1, 1)
    signs = _sign_bits(sb).reshape(n, 8, 4, 8)
    idx = qs.astype(jnp.int32) | (_unpack(qh, 1, 8, 1).astype(jnp.int32) << 8)
    grid = jnp.take(_table(Q.IQ3_S), idx, axis=0).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


_IQ1_DELTA = 0.125  # ggml's IQ1S_DELTA / IQ1M_DELTA


def _iq1_s(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs, qh = b[:, 2:34], _u16(b[:, 34:50])  # qh [n, 8]
    dl = (d * (2 * ((qh >> 12) & 7).astype(jnp.int32) + 1).astype(jnp.float32)).reshape(n, 8, 1, 1)
    delta = jnp.where((qh & 0x8000) == 0, jnp.float32(_IQ1_DELTA), jnp.float32(-_IQ1_DELTA)).reshape(n, 8, 1, 1)
    hi = (qh[..., None] >> jnp.asarray([0, 3, 6, 9], jnp.uint16)) & 7
    idx = qs.astype(jnp.int32) | (hi.reshape(n, 32).astype(jnp.int32) << 8)
    grid = jnp.take(_table(Q.IQ1_S), idx, axis=0).reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


def _iq1_m(b):
    n = b.shape[0]
    qs, qh, sc = b[:, :32], b[:, 32:48], _u16(b[:, 48:56])  # sc [n, 4]
    # The f16 super-block scale is spread over the top nibbles of the four scale words.
    d16 = ((sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000))
    d = lax.bitcast_convert_type(d16, jnp.float16).astype(jnp.float32).reshape(n, 1)
    s = (sc[..., None] >> jnp.asarray([0, 3, 6, 9], jnp.uint16)) & 7
    dl = (d * (2 * s.reshape(n, 16).astype(jnp.int32) + 1).astype(jnp.float32)).reshape(n, 8, 2, 1, 1)
    h = _nibbles(qh)  # [n, 32]: per qs byte, its 4-bit high part (3 index bits + the delta sign)
    idx = qs.astype(jnp.int32) | ((h & 7).astype(jnp.int32) << 8)
    delta = jnp.where((h & 8) == 0, jnp.float32(_IQ1_DELTA), jnp.float32(-_IQ1_DELTA)).reshape(n, 8, 2, 2, 1)
    grid = jnp.take(_table(Q.IQ1_S), idx, axis=0).reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


_DECODERS: dict[GGMLQuantizationType, Callable[[jax.Array], jax.Array]] = {
    Q.F32: _f32,
    Q.F16: _f16,
    Q.BF16: _bf16,
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.IQ4_NL: _iq4_nl,
    Q.IQ4_XS: _iq4_xs,
    Q.MXFP4: _mxfp4,
    Q.TQ1_0: _tq1_0,
    Q.TQ2_0: _tq2_0,
    Q.IQ1_S: _iq1_s,
    Q.IQ1_M: _iq1_m,
    Q.IQ2_XXS: _iq2_xxs,
    Q.IQ2_XS: _iq2_xs,
    Q.IQ2_S: _iq2_s,
    Q.IQ3_XXS: _iq3_xxs,
    Q.IQ3_S: _iq3_s,
}
if hasattr(Q, "NVFP4") and Q.NVFP4 in GGML_QUANT_SIZES:  # gguf >= 0.18 knows NVFP4
    _DECODERS[Q.NVFP4] = _nvfp4

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_DECODERS)

_SUPPORTED_NAMES = ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=lambda t: t.value))


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

def _where(name: str | None) -> str:
    return f"tensor {name!r}: " if name else ""


def normalize_qtype(qtype, *, name: str | None = None) -> GGMLQuantizationType:
    """Map a `GGMLQuantizationType`, its int value or its name ("Q4_K", case-insensitive) to the enum.

    Raises `UnsupportedQuantError` for values/names gguf does not know at all. Does not check that
    sharpi-jax can dequantize the type (see `SUPPORTED_TYPES`).
    """
    if isinstance(qtype, GGMLQuantizationType):
        return qtype
    if isinstance(qtype, str):
        try:
            return GGMLQuantizationType[qtype.strip().upper()]
        except KeyError:
            raise UnsupportedQuantError(
                f"{_where(name)}unknown ggml quant type {qtype!r} (supported: {_SUPPORTED_NAMES})"
            ) from None
    if isinstance(qtype, (int, np.integer)) and not isinstance(qtype, bool):
        try:
            return GGMLQuantizationType(int(qtype))
        except ValueError:
            raise UnsupportedQuantError(
                f"{_where(name)}unknown ggml quant type id {int(qtype)} (supported: {_SUPPORTED_NAMES})"
            ) from None
    raise UnsupportedQuantError(f"{_where(name)}not a ggml quant type: {qtype!r}")


def _supported(qtype, name: str | None = None) -> GGMLQuantizationType:
    qt = normalize_qtype(qtype, name=name)
    if qt not in SUPPORTED_TYPES:
        raise UnsupportedQuantError(
            f"{_where(name)}unsupported ggml quant type {qt.name} (supported: {_SUPPORTED_NAMES})"
        )
    return qt


def _sizes(qtype, name: str | None = None) -> tuple[int, int]:
    qt = normalize_qtype(qtype, name=name)
    if qt not in GGML_QUANT_SIZES:
        raise UnsupportedQuantError(f"{_where(name)}ggml quant type {qt.name} has no known block size")
    return GGML_QUANT_SIZES[qt]


def block_size(qtype) -> int:
    """Number of values per ggml block (1 for F32/F16/BF16). Works for any type gguf knows."""
    return _sizes(qtype)[0]


def type_size(qtype) -> int:
    """Number of bytes per ggml block. Works for any type gguf knows."""
    return _sizes(qtype)[1]


def byte_shape(qtype, shape: Sequence[int], *, name: str | None = None) -> tuple[int, ...]:
    """uint8 shape `[..., last * type_size / block_size]` holding a tensor of logical `shape`.

    Raises `GGUFError` if the last dimension is not a multiple of the block size.
    """
    shape = _check_shape(shape, name)
    bs, ts = _sizes(qtype, name)
    if not shape:
        if bs != 1:
            raise GGUFError(f"{_where(name)}a scalar cannot be stored as {normalize_qtype(qtype).name}")
        return (ts,)
    if shape[-1] % bs:
        raise GGUFError(
            f"{_where(name)}last dimension {shape[-1]} of shape {shape} is not a multiple of the "
            f"{normalize_qtype(qtype).name} block size {bs}"
        )
    return (*shape[:-1], shape[-1] // bs * ts)


def _check_shape(shape, name: str | None) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise GGUFError(f"{_where(name)}invalid tensor shape {shape!r}") from None
    if any(s < 0 for s in shape):
        raise GGUFError(f"{_where(name)}negative dimension in tensor shape {shape}")
    return shape


def dequantize_blocks(blocks: jax.Array, qtype) -> jax.Array:
    """Decode ggml blocks: uint8 `[..., type_size]` -> float32 `[..., block_size]`.

    Pure jnp; `qtype` must be static under `jax.jit`. Bitwise equal to gguf-py's dequantization.
    """
    qt = _supported(qtype)
    bs, ts = GGML_QUANT_SIZES[qt]
    blocks = jnp.asarray(blocks)
    if blocks.dtype != jnp.uint8:
        raise GGUFError(f"{qt.name} blocks must be uint8, got {blocks.dtype}")
    if blocks.ndim == 0 or blocks.shape[-1] != ts:
        raise GGUFError(f"{qt.name} blocks must have a last dimension of {ts} bytes, got shape {blocks.shape}")
    lead = blocks.shape[:-1]
    out = _DECODERS[qt](blocks.reshape(-1, ts))
    return out.reshape(*lead, bs)


@functools.lru_cache(maxsize=None)
def _jitted(qt: GGMLQuantizationType) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(functools.partial(dequantize_blocks, qtype=qt))


def _as_bytes(raw, name: str | None) -> np.ndarray | jax.Array:
    """Flat uint8 view of `raw` (zero-copy for contiguous numpy arrays / mmaps)."""
    if isinstance(raw, jax.Array):
        if raw.dtype != jnp.uint8:
            if raw.dtype == jnp.bool_:
                raise GGUFError(f"{_where(name)}cannot interpret a bool array as tensor bytes")
            raw = lax.bitcast_convert_type(raw, jnp.uint8)
        return raw.reshape(-1)
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return np.frombuffer(raw, dtype=np.uint8)
    arr = np.asarray(raw)
    if arr.dtype != np.uint8:
        if arr.dtype.kind not in "uif" or arr.dtype.byteorder == ">":
            raise GGUFError(f"{_where(name)}cannot interpret a {arr.dtype} array as tensor bytes")
        arr = np.ascontiguousarray(arr).view(np.uint8)
    return arr.reshape(-1)


def dequantize(raw, qtype, shape: Sequence[int], *, name: str | None = None) -> jax.Array:
    """Dequantize a ggml tensor's bytes to a float32 `jax.Array` of numpy-order `shape`.

    `raw`: the tensor's bytes (uint8 array of any shape, e.g. `GGUFReader` tensor `.data` or a zero
    copy mmap view); for F32/F16/BF16 already-typed arrays are accepted and viewed as bytes.
    `qtype`: `GGMLQuantizationType`, its int value or its name. `shape`: reversed ggml `ne`.
    `name`: optional tensor name for error messages.
    """
    qt = _supported(qtype, name)
    bs, ts = GGML_QUANT_SIZES[qt]
    shape = _check_shape(shape, name)
    bshape = byte_shape(qt, shape, name=name)
    data = _as_bytes(raw, name)
    n_bytes = int(np.prod(bshape, dtype=np.int64))
    if data.size != n_bytes:
        raise GGUFError(
            f"{_where(name)}{qt.name} tensor of shape {shape} needs {n_bytes} bytes, got {data.size}"
        )
    if qt == Q.F32 and isinstance(data, np.ndarray):
        # Host-side view: no arithmetic, so no subnormal flushing; avoids a byte-combining pass.
        return jnp.asarray(data.view(np.float32).reshape(shape))
    n_blocks = n_bytes // ts
    out = _jitted(qt)(jnp.asarray(data).reshape(n_blocks, ts))
    return out.reshape(shape)
