"""Routing statistics of a trace (`sharpi_jax.runtime.routing`): what expert placement can exploit.

Pure numpy on the experts each token picks at one MoE layer, `sel` [T, k] (distinct ids in [0, E)):

- `load_skew`: how unevenly the T*k assignments spread over the E experts (coefficient of variation,
  max over mean, entropy normalised to 1 = uniform);
- `reuse`: the share of a token's experts the next token picks again;
- `draft_overlap`: the share of a token's experts that at least one of the next d tokens picks (the
  rows its d drafts fill in a verify pass when they are accepted);
- `pass_union`: distinct experts a verify pass of w consecutive rows needs (k <= union <= w*k);
- `prediction`: precision / recall of the top-n experts of an early router (next-layer prediction)
  against the experts actually picked.
"""

from __future__ import annotations

import numpy as np


def load_skew(sel: np.ndarray, n_expert: int) -> dict[str, float]:
    """{cv, max_over_mean, entropy}: the spread of the T*k assignments over n_expert experts."""
    load = np.bincount(np.asarray(sel).ravel(), minlength=n_expert).astype(np.float64)
    mean = load.mean()
    p = load / load.sum()
    nz = p[p > 0]
    return {"cv": float(load.std() / mean), "max_over_mean": float(load.max() / mean),
            "entropy": float(-(nz * np.log(nz)).sum() / np.log(n_expert))}


def _member(sel: np.ndarray, n_expert: int) -> np.ndarray:
    """[T, E] bool: expert e is among row t's picks."""
    m = np.zeros((sel.shape[0], n_expert), bool)
    np.put_along_axis(m, sel, True, axis=1)
    return m


def reuse(sel: np.ndarray, n_expert: int) -> float:
    """Mean over t of |S_t & S_{t+1}| / k."""
    m = _member(sel, n_expert)
    return float((m[:-1] & m[1:]).sum(axis=1).mean() / sel.shape[1])


def draft_overlap(sel: np.ndarray, n_expert: int, drafts: int) -> float:
    """Mean over t of |S_t & (S_{t+1} | ... | S_{t+d})| / k, over the t that have d successors."""
    m = _member(sel, n_expert)
    T = m.shape[0] - drafts
    ahead = np.zeros((T, n_expert), bool)
    for j in range(1, drafts + 1):
        ahead |= m[j: j + T]
    return float((m[:T] & ahead).sum(axis=1).mean() / sel.shape[1])


def pass_union(sel: np.ndarray, n_expert: int, rows: int) -> float:
    """Mean distinct experts of `rows` consecutive tokens (a verify pass of 1 + drafts rows)."""
    m = _member(sel, n_expert)
    T = m.shape[0] - rows + 1
    union = np.zeros((T, n_expert), bool)
    for j in range(rows):
        union |= m[j: j + T]
    return float(union.sum(axis=1).mean())


def prediction(early: np.ndarray, sel: np.ndarray, n: int) -> dict[str, float]:
    """{precision, recall} of the top-n of `early` [T, E] (ties by lower id) against `sel` [T, k]."""
    E = early.shape[1]
    guess = np.argsort(-early, axis=1, kind="stable")[:, :n]
    hit = (_member(guess, E) & _member(sel, E)).sum(axis=1)
    return {"precision": float(hit.mean() / n), "recall": float(hit.mean() / sel.shape[1])}
