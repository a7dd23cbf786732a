"""Pure-jnp references for the grouped matmul.

`grouped_matmul_reference` is the bitwise oracle of the kernel in interpret mode: a masked dense
formulation (every group's matrix applied to every row, then the row's own group selected), which
shares none of the kernel's tile indexing. It accumulates over K in the same `block_k` chunks, in the
same order, as the kernel, and splits the output columns into the same `block_n` tiles (XLA:CPU picks
its dot micro-kernel by the output width, so a 32-wide and a 64-wide product can differ in the last
bit), so that each output element sees the same operations. Rows are independent of the row count for
any product of >= 2 rows, so the differing row counts (all rows here, `block_m` in the kernel) are fine.

`ragged_dot_reference` is the independent numerical oracle: `jax.lax.ragged_dot` over rows sorted by
group (compare with a tolerance; its accumulation order is XLA's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import quant_blocks as qb


def dense_weights(w: dict[str, jax.Array], qtype: str) -> jax.Array:
    """Packed kernel-layout weights `[G, N, ...]` -> float32 `[G, N, K]` (exact)."""
    return qb.dequantize_packed(w, qtype)


def grouped_matmul_reference(
    x: jax.Array,
    w: jax.Array,
    tile_group: jax.Array,
    *,
    block_m: int,
    block_k: int | None = None,
    block_n: int | None = None,
) -> jax.Array:
    """y[r] = x[r] @ w[group(r)].T for the tile-aligned layout; rows of tiles with group -1 are 0.

    x: float32[n_tiles * block_m, K]; w: float32[G, N, K]; tile_group: int32[n_tiles].
    """
    n_groups, n_out, k = w.shape
    block_k = block_k or k
    block_n = block_n or n_out
    row_group = jnp.repeat(tile_group, block_m)

    def one_group(g, out):
        cols = []
        for n0 in range(0, n_out, block_n):
            acc = jnp.zeros((x.shape[0], block_n), jnp.float32)
            for k0 in range(0, k, block_k):
                acc = acc + jax.lax.dot_general(
                    x[:, k0:k0 + block_k], w[g, n0:n0 + block_n, k0:k0 + block_k], (((1,), (1,)), ((), ()))
                )
            cols.append(acc)
        acc = jnp.concatenate(cols, axis=1)
        return jnp.where((row_group == g)[:, None], acc, out)

    return jax.lax.fori_loop(0, n_groups, one_group, jnp.zeros((x.shape[0], n_out), jnp.float32))


def ragged_dot_reference(x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Rows sorted by group, `group_sizes[g]` rows each: x_sorted[r] @ w[g].T via lax.ragged_dot."""
    return jax.lax.ragged_dot(x_sorted, jnp.swapaxes(w, 1, 2), group_sizes.astype(jnp.int32))
