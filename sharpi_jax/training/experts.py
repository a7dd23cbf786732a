"""Float routed experts for training: the `model.moe.ExpertProvider` a trained MoE block calls.

Weights are float32 params in the GGUF numpy layout (gate, up [E, F, D]; down [E, D, F]), so they
export as they are. Two differentiable dispatches (`trainer.TrainConfig.capacity_factor`):

- capacity_factor None: every expert on every row, masked to the renormalised top-k weights (the
  inference function; E/k times the work);
- a number: top-k dispatch into per-expert buffers of capacity ceil(N k / E * capacity_factor) rows
  (gather, batched expert matmuls, weighted combine); assignments past an expert's capacity (in row
  order) are dropped. The same function unless an expert overflows; several times faster on CPU.

Each call sows the fraction of assignments kept (`nnx.Intermediate` "kept"; 1.0 when dense).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from sharpi_jax.config import ModelConfig


def _mm(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [N, in] times a numpy-order [out, in] matrix -> [N, out]."""
    return jnp.einsum("ni,oi->no", x, w)


class FloatExperts(nnx.Module):
    """One MoE layer's routed experts as float32 params, dispatched densely or by capacity."""

    def __init__(self, c: ModelConfig, capacity_factor: float | None = None):
        E, F, D = c.n_expert, c.expert_ff, c.d_model
        self.n_expert, self.k, self.capacity_factor = E, c.n_expert_used, capacity_factor
        self.gate = nnx.Param(jnp.zeros((E, F, D), jnp.float32))
        self.up = nnx.Param(jnp.zeros((E, F, D), jnp.float32))
        self.down = nnx.Param(jnp.zeros((E, D, F), jnp.float32))

    def __call__(self, u: jax.Array, sel: jax.Array, w: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """`moe.ExpertProvider` (padding rows carry zero weights, so `valid` is not needed)."""
        if self.capacity_factor is None:
            out, kept = self._dense(u, sel, w), jnp.float32(1.0)
        else:
            out, kept = self._capacity(u, sel, w)
        self.sow(nnx.Intermediate, "kept", kept)
        return out

    def _dense(self, u, sel, w):
        """Every expert on every row, weighted by the top-k weights (zero elsewhere)."""
        gate, up, down = self.gate[...], self.up[...], self.down[...]
        E, F, D = gate.shape
        dense_w = jnp.sum(jax.nn.one_hot(sel, E, dtype=u.dtype) * w[..., None], axis=-2)  # [N, E]
        hid = jax.nn.silu(_mm(u, gate.reshape(E * F, D))) * _mm(u, up.reshape(E * F, D))
        hid = hid.reshape(-1, E, F) * dense_w[..., None]
        return _mm(hid.reshape(-1, E * F), down.transpose(1, 0, 2).reshape(D, E * F))  # [E, D, F] -> [D, E*F]

    def _capacity(self, u, sel, w):
        """Top-k dispatch into per-expert buffers -> (out [N, D], fraction of assignments kept)."""
        E, k = self.n_expert, self.k
        N, D = u.shape
        cap = max(1, int(math.ceil(N * k / E * self.capacity_factor)))
        flat_e = sel.reshape(-1)  # [N*k], row-major: assignment j belongs to row j // k
        onehot = jax.nn.one_hot(flat_e, E, dtype=jnp.int32)
        rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # index within its expert
        keep = rank < cap
        slot = jnp.where(keep, flat_e * cap + rank, E * cap)  # dropped -> a dummy slot
        row = jnp.repeat(jnp.arange(N, dtype=jnp.int32), k)
        slot_row = jnp.zeros(E * cap + 1, jnp.int32).at[slot].set(row)[:-1]
        slot_used = jnp.zeros(E * cap + 1, u.dtype).at[slot].set(1.0)[:-1]
        xin = (u[slot_row] * slot_used[:, None]).reshape(E, cap, D)
        g = jnp.einsum("ecd,efd->ecf", xin, self.gate[...])
        h = jnp.einsum("ecd,efd->ecf", xin, self.up[...])
        y = jnp.einsum("ecf,edf->ecd", jax.nn.silu(g) * h, self.down[...])
        y = jnp.concatenate([y.reshape(E * cap, D), jnp.zeros((1, D), y.dtype)])
        out = jnp.sum((y[slot] * (w.reshape(-1) * keep)[:, None]).reshape(N, k, D), axis=1)
        return out, jnp.mean(keep.astype(jnp.float32))
