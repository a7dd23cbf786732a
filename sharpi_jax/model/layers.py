"""Basic layers: Linear (weights as QTensors), RMSNorm, partial NEOX rope, SwiGLU, and the variable
kind of routed-expert stacks (`QuantBlocks`).

A Linear's weight is the GGUF matrix `[out, in]` held as a tuple of QTensors stacked along the
outputs (a fused projection whose parts have different ggml types keeps one QTensor per run of equal
types); `sharpi_jax.quant.matmul` computes each part in the layout the kernel backend chose at load.
A freshly constructed Linear holds one float32 part (training and synthetic use).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from sharpi_jax.quant import QTensor, matmul


class QuantBlocks(nnx.Variable):
    """A routed-expert stack: a QTensor [E, rows, cols] in its backend's layout (not trained)."""


def float_weight(w_in_out: jax.Array) -> tuple[QTensor]:
    """A float32 `[d_in, d_out]` matrix as a Linear weight (one exact "float_t" QTensor part)."""
    w = jnp.asarray(w_in_out, jnp.float32)
    return (QTensor({"w": w}, 0, (int(w.shape[1]), int(w.shape[0])), "float_t"),)  # ggml type 0 = F32


class Linear(nnx.Module):
    """y = x @ W.T, no bias; W [d_out, d_in] as a tuple of QTensor row blocks (see module doc)."""

    def __init__(self, d_in: int, d_out: int):
        self.d_in, self.d_out = d_in, d_out
        self.w = nnx.Param(float_weight(jnp.zeros((d_in, d_out), jnp.float32)))

    def parts(self) -> tuple[QTensor, ...]:
        return tuple(self.w.get_value())

    def __call__(self, x: jax.Array, rows: jax.Array | None = None) -> jax.Array:
        """x [M, d_in] -> [M, d_out]; leading batch axes [..., d_in] are flattened into one matmul.
        rows: only x rows [0, rows) are needed (bucket padding after them; `quant.matmul`)."""
        if x.ndim > 2:
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        ys = [matmul(x, p, rows=rows) for p in self.parts()]
        return ys[0] if len(ys) == 1 else jnp.concatenate(ys, axis=-1)

    def dequantize(self) -> jax.Array:
        """The float32 `[d_out, d_in]` matrix (tests)."""
        return jnp.concatenate([p.dequantize() for p in self.parts()], axis=0)


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

    Text-only IMROPE (qwen35/qwen35moe, all position streams equal) is exactly this: llama.cpp's
    multi-section rope with every section given the same position.
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

    def __call__(self, x: jax.Array, rows: jax.Array | None = None) -> jax.Array:
        """rows: only x rows [0, rows) are needed (`Linear`)."""
        return self.down(swiglu(self.gate_up(x, rows)), rows)
