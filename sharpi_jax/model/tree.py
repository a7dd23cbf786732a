"""Draft-tree rows for one trunk (or MTP) pass: every row sees the context plus its own ancestors.

A tree pass runs T rows (nodes) whose parents come before them (parent index < row index; -1 = the
committed state). Node t sits at LOGICAL position base + depth[t] (RoPE, causal mask) but writes its
K/V to the PHYSICAL slot slots[t] (base + t: siblings share a logical position, not a slot).

Attention: a row must give bitwise the result of a single-token decode along its root path, whose cache
holds the path's K/V at slots base..base + depth. So each row reads the cache through its own view:
slot s < base is the context, slot base + d (d <= depth) is its ancestor at depth d (`anc[t, d]`, a
physical slot), slots past its position are masked exactly as in decode. Scores are computed against
physical slots with decode's shapes (a chunk of the context, and one block of physical slots at the
tree's base holding the tree's rows), then gathered into each row's view (`view_columns`); softmax and
the value sum run over the view, so every reduction has decode's order and operands.

GDN: the recurrent form starts each row from its parent's snapshot (`parent`), see
`GatedDeltaNet.recurrent`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class TreeRows(NamedTuple):
    """depth [T] (root 0), parent [T] (row index, -1 = the committed state), slots [T] (physical KV
    slot of each row), anc [T, W] (physical slot of the ancestor at depth d of row t for d <= depth[t],
    the row itself at d = depth[t]; entries past the depth are ignored). Slots of an uncompacted cache:
    a SnapKV-compacted layer maps them to slot - shift (`GatedAttention`)."""

    depth: jax.Array
    parent: jax.Array
    slots: jax.Array
    anc: jax.Array


def tree_arrays(parent, n_valid: int, n_rows: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host-side (depth [T], parent [T], anc [T, T]) int32 for rows whose first n_valid entries of
    `parent` form one tree rooted at row 0 (parent[0] = -1, 0 <= parent[t] < t). anc[t, d] is the row of
    t's ancestor at depth d (t itself at its depth; d past it: d). Padding rows: a root at depth 0.
    Raises ValueError for anything else."""
    parent = np.asarray(parent, np.int64).reshape(-1)
    T = len(parent) if n_rows is None else int(n_rows)
    if not 1 <= n_valid <= min(T, len(parent)):
        raise ValueError(f"n_valid = {n_valid} rows of a tree of {len(parent)} parents (width {T})")
    p = parent[:n_valid]
    t = np.arange(n_valid)
    if p[0] != -1 or np.any(p[1:] < 0) or np.any(p[1:] >= t[1:]):
        raise ValueError(f"parents must be -1 for row 0 and in [0, t) for row t, got {p.tolist()}")
    depth = np.zeros(T, np.int32)
    par = np.full(T, -1, np.int32)
    anc = np.tile(np.arange(T, dtype=np.int32), (T, 1))
    anc[:, 0] = 0
    for i in range(1, n_valid):
        par[i] = p[i]
        depth[i] = depth[p[i]] + 1
        anc[i, :depth[i]] = anc[p[i], :depth[i]]
        anc[i, depth[i]] = i
    return depth, par, anc


def view_columns(anc: jax.Array, base: jax.Array, slots: jax.Array, C: int) -> jax.Array:
    """[T, n] int32: where row t finds view slot slots[j] in [a chunk of C physical slots starting at
    slots[0] | a block of C physical slots starting at base]: the context slot itself (the chunk's
    column j), or, in the tree region [base, base + W), its ancestor at that depth (anc[t, d], a
    physical slot in the block; a tree spans fewer than C slots)."""
    rel = slots - base
    W = anc.shape[1]
    in_tree = (rel >= 0) & (rel < W)
    own = jnp.take_along_axis(anc, jnp.broadcast_to(jnp.clip(rel, 0, W - 1), (anc.shape[0], slots.shape[0])), axis=1)
    col = jnp.arange(slots.shape[0], dtype=jnp.int32)
    return jnp.where(in_tree[None, :], C + jnp.clip(own - base, 0, C - 1), col[None, :])
