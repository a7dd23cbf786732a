"""Pure-jnp reference of the top-k weighted reduce.

    out[i] = (((w[i,0] * y[i,0] + w[i,1] * y[i,1]) + ...) + w[i,k-1] * y[i,k-1]) + shared[i]

Rank order j = 0..k-1, multiply then add, exactly as the per-token loop accumulates (so grouped
and per-token dispatch agree bit for bit). XLA:CPU contracts `acc + w * y` into one FMA; every path that must agree with
this one bit for bit uses this same expression shape (the kernel below does), so they contract alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def weighted_reduce_reference(y: jax.Array, w: jax.Array, shared: jax.Array | None = None) -> jax.Array:
    """y: float32[N, k, D], w: float32[N, k], shared: float32[N, D] or None -> float32[N, D]."""
    k = y.shape[1]
    acc = w[:, 0:1] * y[:, 0]
    for j in range(1, k):
        acc = acc + w[:, j:j + 1] * y[:, j]
    if shared is not None:
        acc = acc + shared
    return acc.astype(jnp.float32)
