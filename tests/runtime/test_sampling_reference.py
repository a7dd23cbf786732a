"""The top-k / top-p / min-p filter against a numpy reference over a full vocabulary (Qwen's 151,936
ids and the default model's 2,048): the candidate set, exactly. Reference (Hugging Face's order):
temper, keep the k largest, then the shortest prefix of the descending top-k distribution whose mass
reaches top_p (at least one token), then tokens with p >= min_p * p_max; ties at a cut are kept.
Thresholds are put halfway between two neighbouring candidates (at least 1e-4 of mass or 1e-3 of log-ratio
apart) so float32 rounding cannot move a cut."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharpi_jax.runtime.sampling import filter_logits

_filter = jax.jit(filter_logits)


def _reference(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Kept ids of tempered logits x (float64 arithmetic, an explicit walk over the sorted ids)."""
    x = x.astype(np.float64)
    order = np.argsort(-x, kind="stable")
    k = len(x) if top_k <= 0 or top_k >= len(x) else top_k
    top = order[x[order] >= x[order[k - 1]]]  # ties with the k-th kept
    probs = np.exp(x[top] - x[top[0]])
    probs /= probs.sum()
    n = len(top)
    if top_p < 1.0:  # the first place where the mass so far reaches top_p ends the prefix
        reached = np.nonzero(np.cumsum(probs) >= top_p)[0]
        n = int(reached[0]) + 1 if reached.size else len(top)
    keep = top[x[top] >= x[top[n - 1]]]
    if min_p > 0:
        keep = keep[np.exp(x[keep] - x.max()) >= min_p]
    return set(keep.tolist())


def _ours(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> set[int]:
    out = _filter(jnp.asarray(x), jnp.float32(1.0), jnp.int32(top_k), jnp.float32(top_p), jnp.float32(min_p))
    return set(np.nonzero(np.isfinite(np.asarray(out)))[0].tolist())


def _cases(rng: np.random.Generator, V: int, n: int):
    for _ in range(n):
        temperature = float(rng.choice([0.6, 1.0, 1.7]))
        logits = (rng.standard_normal(V) * rng.choice([1.0, 3.0, 8.0])).astype(np.float32)
        x = (logits / np.float32(temperature)).astype(np.float32)  # the tempered logits the filter sees
        top_k = int(rng.choice([0, 1, 5, 50, 1000, V - 1, V + 3]))
        xs = np.sort(x.astype(np.float64))[::-1]
        k = V if top_k <= 0 or top_k >= V else top_k
        p = np.exp(xs[:k] - xs[0])
        p /= p.sum()
        cum = np.cumsum(p)
        # top_p halfway between two cumulative masses (keeps j + 1), where float32 resolves them
        js = [j for j in range(min(k, 300)) if p[j] >= 1e-4 and cum[j] <= 0.999]
        top_p = 1.0
        if js and rng.random() < 0.8:
            j = int(rng.choice(js))
            top_p = float((cum[j] + (cum[j - 1] if j else 0.0)) / 2)
        # min_p halfway between two neighbouring p / p_max ratios, far enough apart
        ratio = np.exp(xs[:k] - xs[0])
        ms = [m for m in range(min(k - 1, 300)) if ratio[m + 1] >= 1e-6 and xs[m] - xs[m + 1] >= 1e-3]
        min_p = 0.0
        if ms and rng.random() < 0.5:
            m = int(rng.choice(ms))
            min_p = float((ratio[m] + ratio[m + 1]) / 2)
        yield x, top_k, top_p, min_p


@pytest.mark.parametrize("V, n", [(151_936, 5), (2_048, 30)])
def test_filter_equals_numpy_reference(V, n):
    rng = np.random.default_rng(V)
    for x, top_k, top_p, min_p in _cases(rng, V, n):
        assert _ours(x, top_k, top_p, min_p) == _reference(x, top_k, top_p, min_p), (top_k, top_p, min_p)


def test_ties_at_every_cut_are_kept():
    x = np.full(2_048, -20.0, np.float32)
    x[:6] = [5.0, 4.0, 4.0, 3.0, 3.0, 3.0]  # ties at the 2nd / 3rd and the 4th-6th places
    for top_k, top_p, min_p in ((2, 1.0, 0.0), (4, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.3), (5, 0.9, 0.1)):
        assert _ours(x, top_k, top_p, min_p) == _reference(x, top_k, top_p, min_p), (top_k, top_p, min_p)
