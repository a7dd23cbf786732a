"""Routing statistics against brute-force set arithmetic on random and hand-made traces."""

from __future__ import annotations

import numpy as np
import pytest

from sharpi_jax.experts import routing_stats as rs


def _random_sel(T, E, k, seed):
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(E, k, replace=False) for _ in range(T)])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_against_sets(seed):
    T, E, k, d = 40, 12, 3, 2
    sel = _random_sel(T, E, k, seed)
    S = [set(r) for r in sel]
    assert rs.reuse(sel, E) == pytest.approx(np.mean([len(S[t] & S[t + 1]) / k for t in range(T - 1)]))
    want = np.mean([len(S[t] & set().union(*S[t + 1: t + 1 + d])) / k for t in range(T - d)])
    assert rs.draft_overlap(sel, E, d) == pytest.approx(want)
    assert rs.pass_union(sel, E, d + 1) == pytest.approx(np.mean([len(set().union(*S[t: t + d + 1]))
                                                                  for t in range(T - d)]))
    load = np.array([sum(e in s for s in S) for e in range(E)], float)
    skew = rs.load_skew(sel, E)
    assert skew["cv"] == pytest.approx(load.std() / load.mean())
    assert skew["max_over_mean"] == pytest.approx(load.max() / load.mean())
    p = load[load > 0] / load.sum()
    assert skew["entropy"] == pytest.approx(-(p * np.log(p)).sum() / np.log(E))
    early = np.random.default_rng(seed + 10).random((T, E))
    for n in (k, 2 * k):
        guess = [set(np.argsort(-row)[:n]) for row in early]
        hits = np.mean([len(g & s) for g, s in zip(guess, S)])
        assert rs.prediction(early, sel, n) == pytest.approx({"precision": hits / n, "recall": hits / k})


def test_extremes():
    E, k = 8, 2
    same = np.tile([3, 5], (10, 1))
    assert rs.reuse(same, E) == 1.0 and rs.pass_union(same, E, 4) == 2.0
    assert rs.load_skew(same, E)["max_over_mean"] == pytest.approx(E / k)
    uniform = np.array([[2 * i % E, (2 * i + 1) % E] for i in range(8)])  # every expert twice
    assert rs.load_skew(uniform, E) == pytest.approx({"cv": 0.0, "max_over_mean": 1.0, "entropy": 1.0})
    assert rs.reuse(uniform, E) == 0.0
    onehot = np.zeros((8, E))
    np.put_along_axis(onehot, uniform, 1.0, axis=1)
    assert rs.prediction(onehot, uniform, k) == {"precision": 1.0, "recall": 1.0}
