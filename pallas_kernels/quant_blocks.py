"""Kernel-side layouts of ggml Q8_0 / Q4_K / Q5_K / Q6_K blocks and their in-tile dequantization,
bitwise equal to `gguf.quants`. The GGUF-layout dequantizer of every block type is `sharpi_jax.gguf.quants` (the one
implementation the tests compare everything against); this module only re-lays the same bytes out for
XLA:CPU and the Pallas kernels (it imports no sharpi_jax code).

Three layouts of the same bits:

- GGUF ("raw") layout: a row of K weights is `K // block_size` blocks of `type_size` bytes, exactly as
  the file stores them (`uint8[..., K // block_size * type_size]`).
- SoA layout (the XLA paths): one array per block field, same bytes as GGUF. Interleaved 34- or
  144-byte blocks defeat XLA:CPU's vectorizer (dequantizing a Q8_0 matrix from raw blocks measured
  ~8x slower than from these arrays), so a loader converts once with `to_soa`:

  Q8_0: `d f16[..., K/32]`, `qs int8[..., K]`                                        (34 B / 32 w)
  Q4_K: `d f16[..., K/256]`, `dmin f16[..., K/256]`, `scales uint8[..., K/256, 12]` (packed 6-bit),
        `qs uint8[..., K/2]` (ggml nibble order)                                    (144 B / 256 w)

- Kernel layout (Pallas/Triton, `pack`): one array per field, every field a whole number of bytes per
  weight row, since Triton only loads power-of-two tiles. Bytes per 256 weights (GGUF in brackets):

  f32 / f16: `w float32[..., K]`                                                   (1024 B)
  Q8_0: as SoA, `qs int8[..., K]`, `d f16[..., K/32]`                                (272 B [272])
  Q4_K: as SoA with the 12 packed scale bytes unpacked to `sc`, `mn uint8[..., K/32]`:
        `qs uint8[..., K/2]`, `d`, `dmin f16[..., K/256]`, `sc`, `mn`              (148 B [144])
  Q5_K: Q4_K's fields plus `qh uint8[..., K/8]` (bit j of byte l: 5th bit of weight l of sub-block j)
                                                                                   (180 B [176])
  Q6_K: `ql uint8[..., K/2]`, `qh uint8[..., K/4]`, `sc int8[..., K/16]`, `d f16[..., K/256]`
        (the GGUF block's own fields, split)                                       (210 B [210])

Every dequantization keeps gguf's operation order (`x * d` for Q8_0; `(d * sc) * q - dmin * mn` for
Q4_K / Q5_K; `(d * sc) * (q - 32)` for Q6_K). All products are exact in float32 (an f16 scale times
small integers: at most 11 + 8 + 6 = 25 significant bits for Q6_K, whose |q - 32| <= 32 makes it 24),
so XLA's FMA contraction cannot change a bit, and the kernel tiles reproduce `gguf.quants` exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK8_0 = 32
Q8_0_TYPE_SIZE = 34
QK_K = 256
Q4_K_TYPE_SIZE = 144
Q4_K_SCALE_SIZE = 12

# The ggml types the kernels read (their kernel layouts are `pack`'s), by lower-case type name: the one
# list of what the Pallas backend serves.
KERNEL_TYPES = ("f32", "f16", "q8_0", "q4_k", "q5_k", "q6_k")
# qtype name -> (block_size, type_size), from gguf's table. "f32"/"f16" are one-element "blocks".
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    q: tuple(GGML_QUANT_SIZES[GGMLQuantizationType[q.upper()]]) for q in KERNEL_TYPES}
QUANTIZED = ("q8_0", "q4_k")  # the types with a SoA layout
# Kernel-layout fields per type (the pallas_call argument order).
KERNEL_FIELDS = {
    "f32": ("w",),
    "f16": ("w",),
    "q8_0": ("qs", "d"),
    "q4_k": ("qs", "d", "dmin", "sc", "mn"),
    "q5_k": ("qs", "qh", "d", "dmin", "sc", "mn"),
    "q6_k": ("ql", "qh", "sc", "d"),
}


def row_bytes(qtype: str, n_cols: int) -> int:
    """Bytes of one row of `n_cols` weights in the GGUF layout of `qtype`."""
    block, size = BLOCK_SIZES[qtype]
    if n_cols % block:
        raise ValueError(f"{qtype}: row length {n_cols} is not a multiple of the block size {block}")
    return n_cols // block * size


# ----------------------------------------------------------------------------- scales


def q4_k_scale_min(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8[..., 12] packed 6-bit scales/mins -> (sc, mn) uint8[..., 8] (gguf Q4_K.get_scale_min)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


# ----------------------------------------------------------------------------- SoA layout

SOA_FIELDS = {"q8_0": ("d", "qs"), "q4_k": ("d", "dmin", "scales", "qs")}


def to_soa(raw: jax.Array, qtype: str, n_cols: int) -> dict[str, jax.Array]:
    """GGUF rows uint8[..., row_bytes] -> the SoA dict (same bytes; see module doc). Jittable."""
    lead = raw.shape[:-1]
    block, size = BLOCK_SIZES[qtype]
    nb = n_cols // block
    blocks = raw.reshape(lead + (nb, size))
    d = jax.lax.bitcast_convert_type(blocks[..., 0:2], jnp.float16)
    if qtype == "q8_0":
        qs = jax.lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).reshape(lead + (n_cols,))
        return {"d": d, "qs": qs}
    if qtype == "q4_k":
        return {
            "d": d,
            "dmin": jax.lax.bitcast_convert_type(blocks[..., 2:4], jnp.float16),
            "scales": blocks[..., 4:16],
            "qs": blocks[..., 16:].reshape(lead + (nb * 128,)),
        }
    raise ValueError(f"no SoA layout for {qtype!r}")


def soa_to_raw(soa: dict[str, jax.Array], qtype: str) -> jax.Array:
    """Inverse of `to_soa` (tests)."""
    d = jax.lax.bitcast_convert_type(soa["d"], jnp.uint8)
    lead, nb = soa["d"].shape[:-1], soa["d"].shape[-1]
    if qtype == "q8_0":
        qs = jax.lax.bitcast_convert_type(soa["qs"], jnp.uint8).reshape(lead + (nb, QK8_0))
        return jnp.concatenate([d, qs], axis=-1).reshape(lead + (nb * Q8_0_TYPE_SIZE,))
    dmin = jax.lax.bitcast_convert_type(soa["dmin"], jnp.uint8)
    qs = soa["qs"].reshape(lead + (nb, 128))
    return jnp.concatenate([d, dmin, soa["scales"], qs], axis=-1).reshape(lead + (nb * Q4_K_TYPE_SIZE,))


def dequantize_soa(soa: dict[str, jax.Array], qtype: str, k_order: str = "natural") -> jax.Array:
    """SoA rows -> float32[..., K], bitwise equal to gguf.quants (same operation order).

    k_order "natural": columns in weight order. "storage": columns in the order the bytes hold them,
    which for Q4_K is all low nibbles, then all high nibbles ((half, super-block, chunk, lane) order):
    interleaving the two halves back costs XLA:CPU a non-vectorized concatenate (measured ~10x slower
    than the dequantization itself). A product over K then takes its input through `storage_k_order`.
    """
    if qtype == "q8_0":
        qs, d = soa["qs"], soa["d"]
        lead, n = qs.shape[:-1], qs.shape[-1]
        x = qs.reshape(lead + (n // QK8_0, QK8_0)).astype(jnp.float32)
        return (x * d.astype(jnp.float32)[..., None]).reshape(lead + (n,))
    if qtype == "q4_k":
        lead, nb = soa["d"].shape[:-1], soa["d"].shape[-1]
        sc, mn = q4_k_scale_min(soa["scales"])  # [..., nb, 8]
        scale = (soa["d"].astype(jnp.float32)[..., None] * sc.astype(jnp.float32)).reshape(lead + (nb, 4, 2, 1))
        dm = (soa["dmin"].astype(jnp.float32)[..., None] * mn.astype(jnp.float32)).reshape(lead + (nb, 4, 2, 1))
        # Materialize the (small) per-sub-block scales: fused, XLA:CPU recomputes the 6-bit unpack
        # and the f16 conversions for every weight (measured 2x slower). Values are unchanged.
        scale, dm = jax.lax.optimization_barrier((scale, dm))
        qs = soa["qs"].reshape(lead + (nb, 4, 32))
        # Low nibbles are sub-block 2c of chunk c, high nibbles sub-block 2c + 1.
        lo = scale[..., 0, :] * (qs & 0x0F).astype(jnp.float32) - dm[..., 0, :]
        hi = scale[..., 1, :] * (qs >> 4).astype(jnp.float32) - dm[..., 1, :]
        if k_order == "storage":
            half = lead + (nb * 128,)
            return jnp.concatenate([lo.reshape(half), hi.reshape(half)], axis=-1)
        return jnp.stack([lo, hi], axis=-2).reshape(lead + (nb * QK_K,))
    raise ValueError(f"no SoA layout for {qtype!r}")


def storage_k_order(x: jax.Array, qtype: str) -> jax.Array:
    """Permutes the last axis (K) of activations into `dequantize_soa(..., "storage")` column order."""
    if qtype != "q4_k":
        return x
    lead, k = x.shape[:-1], x.shape[-1]
    nb = k // QK_K
    x = x.reshape(lead + (nb, 4, 2, 32))
    x = jnp.moveaxis(x, -2, len(lead))  # (half, nb, chunk, lane)
    return x.reshape(lead + (k,))


# ----------------------------------------------------------------------------- packed layout


def soa_to_kernel(soa: dict[str, jax.Array], qtype: str) -> dict[str, jax.Array]:
    """SoA -> kernel layout: Q8_0 unchanged; Q4_K scales unpacked to `sc`/`mn` uint8[..., K/32]."""
    if qtype == "q8_0":
        return {"qs": soa["qs"], "d": soa["d"]}
    if qtype == "q4_k":
        lead, nb = soa["d"].shape[:-1], soa["d"].shape[-1]
        sc, mn = q4_k_scale_min(soa["scales"])
        return {"qs": soa["qs"], "d": soa["d"], "dmin": soa["dmin"],
                "sc": sc.reshape(lead + (nb * 8,)), "mn": mn.reshape(lead + (nb * 8,))}
    raise ValueError(f"no kernel layout for {qtype!r}")


def pack(raw: jax.Array, qtype: str, n_cols: int) -> dict[str, jax.Array]:
    """Packs GGUF rows of `qtype` for the kernels; float weights become {"w": float32 rows}."""
    if qtype in ("f32", "f16"):
        return {"w": raw.astype(jnp.float32)}
    if qtype in QUANTIZED:
        return soa_to_kernel(to_soa(raw, qtype, n_cols), qtype)
    if qtype not in KERNEL_FIELDS:
        raise ValueError(f"no kernel layout for {qtype!r}")
    lead = raw.shape[:-1]
    nb = n_cols // QK_K
    blocks = raw.reshape(lead + (nb, BLOCK_SIZES[qtype][1]))
    field = lambda a, b: blocks[..., a:b].reshape(lead + (nb * (b - a),))  # noqa: E731
    f16 = lambda a: jax.lax.bitcast_convert_type(blocks[..., a:a + 2], jnp.float16)  # noqa: E731
    if qtype == "q5_k":
        sc, mn = q4_k_scale_min(blocks[..., 4:16])
        return {"qs": field(48, 176), "qh": field(16, 48), "d": f16(0), "dmin": f16(2),
                "sc": sc.reshape(lead + (nb * 8,)), "mn": mn.reshape(lead + (nb * 8,))}
    return {"ql": field(0, 128), "qh": field(128, 192), "d": f16(208),  # q6_k
            "sc": jax.lax.bitcast_convert_type(field(192, 208), jnp.int8)}


def kernel_k(packed: dict[str, jax.Array], qtype: str) -> int:
    """K (weights per row) of kernel-layout weights."""
    if qtype in ("f32", "f16"):
        return packed["w"].shape[-1]
    if qtype == "q8_0":
        return packed["qs"].shape[-1]
    return packed["d"].shape[-1] * QK_K


def dequant_tile_q8_0(qs: jax.Array, d: jax.Array) -> jax.Array:
    """One 32-column Q8_0 tile: qs int8[R, 32], d f16[R, 1] -> float32[R, 32]. Kernel-safe."""
    return qs.astype(jnp.float32) * d.astype(jnp.float32)


def dequant_tile_q4_k(
    q_bytes: jax.Array, shift: jax.Array, d: jax.Array, dmin: jax.Array, sc: jax.Array, mn: jax.Array
) -> jax.Array:
    """One 32-column Q4_K sub-block tile -> float32[R, 32]. Kernel-safe.

    q_bytes uint8[R, 32] are the 32 bytes holding the sub-block's nibbles (low nibbles for even
    sub-blocks, high for odd: `shift` 0 or 4); d, dmin f16[R, 1] of the super-block; sc, mn uint8[R, 1].
    """
    q = ((q_bytes.astype(jnp.int32) >> shift) & 0x0F).astype(jnp.float32)
    scale = d.astype(jnp.float32) * sc.astype(jnp.float32)
    dm = dmin.astype(jnp.float32) * mn.astype(jnp.float32)
    return scale * q - dm


def dequant_tile_q5_k(
    q_bytes: jax.Array, shift: jax.Array, qh_bytes: jax.Array, bit: jax.Array,
    d: jax.Array, dmin: jax.Array, sc: jax.Array, mn: jax.Array,
) -> jax.Array:
    """One 32-column Q5_K sub-block tile -> float32[R, 32]. Kernel-safe.

    As Q4_K, plus qh_bytes uint8[R, 32], the super-block's 32 high-bit bytes, whose bit `bit` (the
    sub-block index 0..7) is each weight's 5th bit.
    """
    lo = (q_bytes.astype(jnp.int32) >> shift) & 0x0F
    hi = (qh_bytes.astype(jnp.int32) >> bit) & 0x01
    q = (lo | (hi << 4)).astype(jnp.float32)
    scale = d.astype(jnp.float32) * sc.astype(jnp.float32)
    dm = dmin.astype(jnp.float32) * mn.astype(jnp.float32)
    return scale * q - dm


def dequant_tile_q6_k(
    ql_bytes: jax.Array, shift_l: jax.Array, qh_bytes: jax.Array, shift_h: jax.Array,
    d: jax.Array, sc_lo: jax.Array, sc_hi: jax.Array,
) -> jax.Array:
    """One 32-column Q6_K tile -> float32[R, 32]. Kernel-safe.

    ql_bytes uint8[R, 32] hold the low 4 bits (>> shift_l, 0 or 4), qh_bytes uint8[R, 32] the high 2
    bits (>> shift_h, 0/2/4/6); d f16[R, 1]; sc_lo, sc_hi int8[R, 1] scale the tile's first and second
    16 columns (Q6_K has one scale per 16 weights).
    """
    lo = (ql_bytes.astype(jnp.int32) >> shift_l) & 0x0F
    hi = (qh_bytes.astype(jnp.int32) >> shift_h) & 0x03
    q = ((lo | (hi << 4)) - 32).astype(jnp.float32)
    df = d.astype(jnp.float32)
    first = jax.lax.broadcasted_iota(jnp.int32, (1,) * (q.ndim - 1) + (32,), q.ndim - 1) < 16
    scale = jnp.where(first, df * sc_lo.astype(jnp.float32), df * sc_hi.astype(jnp.float32))
    return scale * q


def q6_k_tile_index(sub):
    """Where 32-column sub-block `sub` (0..7 within its super-block) of Q6_K lives, as
    (ql byte offset, ql shift, qh byte offset, qh shift) inside the super-block. Bit arithmetic only
    (kernel-safe): gguf's order is ql [2 halves][2 shifts][64 bytes], qh [2 halves][4 shifts][32 bytes]."""
    h, s, part = sub >> 2, (sub >> 1) & 1, sub & 1
    return h * 64 + part * 32, s * 4, h * 32, (sub & 3) * 2


def dequantize_packed(packed: dict[str, jax.Array], qtype: str) -> jax.Array:
    """Packed layout -> float32 rows (the reference for the kernels' in-tile dequantization)."""
    if qtype in ("f32", "f16"):
        return packed["w"].astype(jnp.float32)
    if qtype == "q8_0":
        qs, d = packed["qs"], packed["d"]
        lead, n = qs.shape[:-1], qs.shape[-1]
        x = qs.reshape(lead + (n // QK8_0, QK8_0))
        return dequant_tile_q8_0(x, d[..., None]).reshape(lead + (n,))
    if qtype == "q4_k":
        qs = packed["qs"]
        lead, nb = qs.shape[:-1], qs.shape[-1] // 128
        q = qs.reshape(lead + (nb, 4, 1, 32))
        q = jnp.broadcast_to(q, lead + (nb, 4, 2, 32)).reshape(lead + (nb, 8, 32))
        shift = jnp.array([0, 4] * 4, jnp.int32).reshape(8, 1)
        rep = lambda a: jnp.repeat(a, 8, axis=-1).reshape(lead + (nb, 8, 1))  # noqa: E731
        sc = packed["sc"].reshape(lead + (nb, 8, 1))
        mn = packed["mn"].reshape(lead + (nb, 8, 1))
        w = dequant_tile_q4_k(q, shift, rep(packed["d"]), rep(packed["dmin"]), sc, mn)
        return w.reshape(lead + (nb * QK_K,))
    if qtype in ("q5_k", "q6_k"):
        nb = packed["d"].shape[-1]
        lead = packed["d"].shape[:-1]
        rep = lambda a: jnp.repeat(a, 8, axis=-1).reshape(lead + (nb, 8, 1))  # noqa: E731
        sub = np.arange(8).reshape(8, 1)
        if qtype == "q5_k":
            q = jnp.repeat(packed["qs"].reshape(lead + (nb, 4, 1, 32)), 2, axis=-2).reshape(lead + (nb, 8, 32))
            qh = jnp.broadcast_to(packed["qh"].reshape(lead + (nb, 1, 32)), lead + (nb, 8, 32))
            w = dequant_tile_q5_k(q, jnp.asarray((sub & 1) * 4), qh, jnp.asarray(sub), rep(packed["d"]),
                                  rep(packed["dmin"]), packed["sc"].reshape(lead + (nb, 8, 1)),
                                  packed["mn"].reshape(lead + (nb, 8, 1)))
        else:
            ql_off, shift_l, qh_off, shift_h = q6_k_tile_index(sub)
            ql = packed["ql"].reshape(lead + (nb, 128))[..., ql_off + np.arange(32)]  # [..., nb, 8, 32]
            qh = packed["qh"].reshape(lead + (nb, 64))[..., qh_off + np.arange(32)]
            sc = packed["sc"].reshape(lead + (nb, 8, 2))
            w = dequant_tile_q6_k(ql, jnp.asarray(shift_l), qh, jnp.asarray(shift_h), rep(packed["d"]),
                                  sc[..., 0:1], sc[..., 1:2])
        return w.reshape(lead + (nb * QK_K,))
    raise ValueError(f"unsupported qtype {qtype!r}")


# ----------------------------------------------------------------------------- numpy helpers


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype: str) -> np.ndarray:
    """Valid random GGUF blocks for rows of `shape[-1]` weights (finite f16 scales), numpy uint8."""
    *lead, n_cols = shape
    block, size = BLOCK_SIZES[qtype]
    nb = int(np.prod(lead, dtype=np.int64)) * (n_cols // block)
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    # Weights of magnitude ~0.05: Q8_0 d * 127, Q4_K (d * 63) * 15 - dmin * 63, Q5_K (d * 63) * 31 -
    # dmin * 63, Q6_K (d * 127) * 32.
    d_scale, dmin_scale = {"q8_0": (2.0**-11, 0.0), "q4_k": (2.0**-14, 2.0**-11),
                           "q5_k": (2.0**-15, 2.0**-11), "q6_k": (2.0**-16, 0.0)}[qtype]
    d_at = 208 if qtype == "q6_k" else 0
    raw[:, d_at:d_at + 2] = (rng.uniform(0.5, 1.5, size=(nb, 1)) * d_scale).astype(np.float16).view(np.uint8)
    if qtype in ("q4_k", "q5_k"):
        raw[:, 2:4] = (rng.uniform(0.5, 1.5, size=(nb, 1)) * dmin_scale).astype(np.float16).view(np.uint8)
    return raw.reshape(tuple(lead) + (n_cols // block * size,))


def quantize_q4_k_np(x: np.ndarray) -> np.ndarray:
    """A simple float -> Q4_K quantizer (valid blocks, not ggml's exact search), numpy.

    gguf-py has no Q4_K quantizer; synthetic benchmarks and tests only need well-formed blocks whose
    dequantization approximates `x`. Returns uint8[..., n_cols/256*144].
    """
    *lead, n_cols = x.shape
    nb = int(np.prod(lead, dtype=np.int64)) * (n_cols // QK_K)
    xb = x.reshape(nb, 8, 32).astype(np.float32)
    lo = np.minimum(xb.min(axis=-1), 0.0)
    hi = np.maximum(xb.max(axis=-1), 0.0)
    scale = (hi - lo) / 15.0
    mins = -lo
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d.astype(np.float32)[:, None]), 0)
        mn = np.where(dmin[:, None] > 0, np.rint(mins / dmin.astype(np.float32)[:, None]), 0)
    sc = np.clip(sc, 0, 63).astype(np.uint8)
    mn = np.clip(mn, 0, 63).astype(np.uint8)
    eff_d = d.astype(np.float32)[:, None] * sc
    eff_m = dmin.astype(np.float32)[:, None] * mn
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff_d[..., None] > 0, np.rint((xb + eff_m[..., None]) / eff_d[..., None]), 0)
    q = np.clip(q, 0, 15).astype(np.uint8)  # [nb, 8, 32]
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(nb, 128)
    scales = np.zeros((nb, 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    out = np.concatenate([d.reshape(nb, 1).view(np.uint8), dmin.reshape(nb, 1).view(np.uint8), scales, qs], axis=1)
    return out.reshape(tuple(lead) + (n_cols // QK_K * Q4_K_TYPE_SIZE,))
