"""The "xla" backend (the CPU default): GGUF encodings dequantized inside the step by XLA, or an
explicit int8 repacking of large matrices.

Layouts: float types "float_t" (expert stacks "float"); Q8_0 / Q4_K "soa" (the file's bytes split per
block field: XLA:CPU dequantizes it ~8x faster than interleaved blocks); other types "blocks";
repack="int8" (or "auto" for quantized matrices of >= INT8_AUTO_MIN_WEIGHTS weights, never expert
stacks): "int8" rows with one scale per row, lossy (|error| <= max|row| / 254 per weight).

Row stability: the float paths need M >= 2 rows (XLA:CPU lowers M = 1 to a different kernel; callers
pad a single row to two); the int8 path is exact integer arithmetic followed by elementwise scaling,
so any M gives the same bits per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sharpi_jax.gguf import quants as formats
from sharpi_jax.quant.backends.reference import DequantizingBackend, contract_last, dequantize_matmul, float_t_matmul
from sharpi_jax.quant.qtensor import FLOAT_TYPES, SOA_TYPES, Q, QTensor

# repack="auto": int8 for quantized matrices of at least this many weights (an LM head, a 35B-A3B
# layer's attention / GDN projections) on XLA:CPU, where dequantizing them in every step would dominate
# decode; smaller matrices (and every matrix of a small model) keep their exact GGUF encoding.
INT8_AUTO_MIN_WEIGHTS = 1 << 22


def quantize_rows_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row symmetric int8 quantization: x [M, K] -> (q int8 [M, K], s float32 [M, 1]), x ~= q * s
    with |x - q * s| <= s / 2. Row-local, so row-stable."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    inv = jnp.where(amax > 0, jnp.float32(127.0) / jnp.where(amax > 0, amax, 1.0), 0.0)
    q = jnp.clip(jnp.round(x * inv), -127, 127).astype(jnp.int8)
    return q, amax / jnp.float32(127.0)


def matmul_int8(x: jax.Array, data) -> jax.Array:
    """Activations in two int8 planes (x ~= q1 * s1 + q2 * s2, q2 quantizing the residual: error <=
    max|row| / 64516), stacked as 2M rows of ONE integer dot so the weights are read once; exact int32
    accumulation (|acc| <= 127 * 127 * K < 2^31 for K < 133k), then elementwise float32 scaling. A
    single plane would round activations to 1/254 of their row maximum, which outlier channels of real
    hidden states make coarse; the second plane costs no extra weight traffic."""
    m = x.shape[0]
    q1, s1 = quantize_rows_int8(x)
    q2, s2 = quantize_rows_int8(x - q1.astype(jnp.float32) * s1)
    acc = contract_last(jnp.concatenate([q1, q2]), data["q"], jnp.int32).astype(jnp.float32)
    sw = data["s"][:, 0][None, :]
    return acc[:m] * (s1 * sw) + acc[m:] * (s2 * sw)


class XlaBackend(DequantizingBackend):
    """XLA:CPU: SoA / blocks dequantized in the step, or int8 rows (see module doc)."""

    name = "xla"
    platforms = ("cpu", "gpu", "cuda", "rocm", "tpu")
    auto = 10  # the default wherever no better-ranked backend serves the platform
    repacks = (None, "auto", "int8")

    def serves(self, qtype: int, shape: tuple[int, ...]) -> bool:
        return Q(qtype) in formats.SUPPORTED_TYPES

    def layout(self, qtype: int, shape: tuple[int, ...], repack: str | None) -> str:
        qt = Q(qtype)
        stack = len(shape) == 3
        if qt in FLOAT_TYPES:
            return "float" if stack else "float_t"
        n_weights = shape[-2] * shape[-1]
        if not stack and (repack == "int8" or (repack == "auto" and n_weights >= INT8_AUTO_MIN_WEIGHTS)):
            return "int8"
        return "soa" if qt in SOA_TYPES else "blocks"

    def matmul(self, x: jax.Array, w: QTensor, **options) -> jax.Array:
        if w.layout == "float_t":
            return float_t_matmul(x, w)
        if w.layout == "int8":
            return matmul_int8(x, w.data)
        return dequantize_matmul(x, w)
