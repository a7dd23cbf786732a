"""Grouped (ragged) matmul over expert groups.

- `layout`: group bucketing into `block_m`-aligned row tiles (shared by kernel and reference).
- `reference`: pure-jnp oracles (bitwise: masked dense with the kernel's K chunks; numeric: ragged_dot).
- `pallas_triton`: the Pallas kernel, lowered through Triton on GPU, `interpret=True` on CPU.
"""

from .layout import GroupLayout, gather_rows, group_layout, max_tiles, scatter_rows
from .pallas_triton import WEIGHT_FIELDS, grouped_matmul
from .reference import dense_weights, grouped_matmul_reference, ragged_dot_reference

__all__ = [
    "GroupLayout",
    "WEIGHT_FIELDS",
    "dense_weights",
    "gather_rows",
    "group_layout",
    "grouped_matmul",
    "grouped_matmul_reference",
    "max_tiles",
    "ragged_dot_reference",
    "scatter_rows",
]
