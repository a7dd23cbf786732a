"""Basic layers: Linear (weights stored [in, out]), RMSNorm, partial NEOX rope, SwiGLU, and the GGUF
block storage that some weights keep (`QuantBlocks`).

Every Linear weight is float32. GGUF matrices `{in, out}` (numpy `[out, in]`) are transposed once at
load: on XLA CPU `x @ w` with `w` [in, out] is ~1.6x faster than `x @ w.T` for decode-sized `x`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from sharpi_jax.gguf.quants import dequantize_blocks


class QuantBlocks(nnx.Variable):
    """Weights kept in (a form of) their GGUF storage: raw block rows, SoA fields or float experts."""


def blocks_shape(shape: tuple[int, ...], qtype: int) -> tuple[int, ...]:
    """uint8 shape holding a tensor of numpy `shape` in ggml type `qtype`."""
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    return (*shape[:-1], shape[-1] // bs * ts)


def dequantize_rows(raw: jax.Array, qtype: int, n_cols: int) -> jax.Array:
    """uint8 [..., row_bytes] -> float32 [..., n_cols]; exact (bitwise gguf.quants)."""
    qt = GGMLQuantizationType(qtype)
    bs, ts = GGML_QUANT_SIZES[qt]
    lead = raw.shape[:-1]
    return dequantize_blocks(raw.reshape(*lead, n_cols // bs, ts), qt).reshape(*lead, n_cols)


class Linear(nnx.Module):
    """y = x @ w, no bias; `w` float32 [d_in, d_out]."""

    def __init__(self, d_in: int, d_out: int):
        self.w = nnx.Param(jnp.zeros((d_in, d_out), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w[...]


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) * w over the last axis (weights used as stored, +1 already in)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


class RMSNorm(nnx.Module):
    """RMSNorm with a stored weight vector."""

    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def rope_inv_freq(n_rot: int, base: float) -> np.ndarray:
    """theta_d / p = base^(-2d/n_rot) for d in [0, n_rot/2), float32."""
    return (1.0 / (base ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot))).astype(np.float32)


def rope_neox(x: jax.Array, positions: jax.Array, n_rot: int, base: float, freq_scale: float = 1.0) -> jax.Array:
    """Partial NEOX rope on [T, H, hd]: dim d pairs with d + n_rot/2 for d < n_rot/2; dims >= n_rot pass.

    Text-only IMROPE (qwen35/qwen35moe, all position streams equal) is exactly this (spec 3.2 step 4).
    """
    if n_rot == 0:
        return x
    half = n_rot // 2
    inv = jnp.asarray(rope_inv_freq(n_rot, base))
    theta = (positions.astype(jnp.float32) * jnp.float32(freq_scale))[:, None] * inv[None, :]  # [T, half]
    cos, sin = jnp.cos(theta)[:, None, :], jnp.sin(theta)[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], axis=-1)


def swiglu(gate_up: jax.Array) -> jax.Array:
    """SiLU(gate) * up for a fused [..., 2F] projection laid out [gate | up]."""
    g, u = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(g) * u


class SwiGLU(nnx.Module):
    """Dense SwiGLU FFN (qwen35 `ffn_gate/up/down`; also the MoE shared expert): down(silu(gate x) * up x)."""

    def __init__(self, d_model: int, d_ff: int):
        self.gate_up = Linear(d_model, 2 * d_ff)  # [gate | up] fused at load
        self.down = Linear(d_ff, d_model)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(swiglu(self.gate_up(x)))
