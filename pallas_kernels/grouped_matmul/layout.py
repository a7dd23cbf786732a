"""Group-padded row layout shared by the grouped-matmul kernel and its reference.

Rows (expert assignments) are bucketed by group with a stable sort, and each group's bucket is padded
to a whole number of `block_m`-row tiles, so that every row tile belongs to exactly one group. The
number of tiles is data-dependent, so it is bounded statically:

    sum_g ceil(c_g / bm) <= (T + min(G, T) * (bm - 1)) // bm

Unused tiles carry group -1; the kernel writes zeros there, so no output row is left unwritten.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


def max_tiles(n_rows: int, n_groups: int, block_m: int) -> int:
    """Static upper bound on the row tiles that `n_rows` rows in `n_groups` groups need."""
    used = min(n_groups, n_rows)
    return max(1, (n_rows + used * (block_m - 1)) // block_m)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pos", "tile_group", "group_sizes"],
                   meta_fields=["block_m"])
@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Where each row goes in the padded, tile-aligned buffer.

    pos: int32[T]            padded row index of input row t (rows of one group ascending in t)
    tile_group: int32[n_tiles]  group of each `block_m`-row tile, -1 for unused tiles
    group_sizes: int32[G]    rows per group
    """

    pos: jax.Array
    tile_group: jax.Array
    group_sizes: jax.Array
    block_m: int

    @property
    def n_padded_rows(self) -> int:
        return self.tile_group.shape[0] * self.block_m


def group_layout(group_ids: jax.Array, n_groups: int, block_m: int) -> GroupLayout:
    """Buckets `group_ids` (int32[T], values in [0, n_groups)) into block_m-aligned group tiles."""
    (t,) = group_ids.shape
    n_tiles = max_tiles(t, n_groups, block_m)
    sizes = jnp.bincount(group_ids, length=n_groups).astype(jnp.int32)
    tiles = (sizes + block_m - 1) // block_m
    tiles_end = jnp.cumsum(tiles)
    tile_start = tiles_end - tiles
    row_start = jnp.cumsum(sizes) - sizes
    order = jnp.argsort(group_ids, stable=True)
    sorted_ids = group_ids[order]
    rank = jnp.arange(t, dtype=jnp.int32) - row_start[sorted_ids]
    pos_sorted = tile_start[sorted_ids] * block_m + rank
    pos = jnp.zeros((t,), jnp.int32).at[order].set(pos_sorted.astype(jnp.int32))
    tile_ids = jnp.arange(n_tiles, dtype=jnp.int32)
    tile_group = jnp.searchsorted(tiles_end, tile_ids, side="right").astype(jnp.int32)
    tile_group = jnp.where(tile_ids < tiles_end[-1], tile_group, -1)
    return GroupLayout(pos=pos, tile_group=tile_group, group_sizes=sizes, block_m=block_m)


def scatter_rows(x: jax.Array, layout: GroupLayout) -> jax.Array:
    """[T, K] rows -> [n_padded_rows, K], zeros in padding rows."""
    out = jnp.zeros((layout.n_padded_rows, x.shape[1]), x.dtype)
    return out.at[layout.pos].set(x, unique_indices=True)


def gather_rows(y: jax.Array, layout: GroupLayout) -> jax.Array:
    """[n_padded_rows, N] -> [T, N] in the original row order (exact)."""
    return y[layout.pos]
