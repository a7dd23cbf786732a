"""The residency replay against hand-counted cases and its own invariants."""

from __future__ import annotations

import numpy as np
import pytest

from sharpi_jax.experts.residency.simulate import simulate


def _trace(seed, L=3, T=30, E=10, k=2):
    rng = np.random.default_rng(seed)
    sel = np.stack([[rng.choice(E, k, replace=False) for _ in range(T)] for _ in range(L)])
    return sel, rng.random((L, T, E))


def test_static_counts_by_hand():
    sel = np.array([[[0, 1], [2, 3], [0, 4]]])  # one layer, three tokens; slots hold experts 0, 1
    out = simulate(sel, None, 2, "static", [[0, 1, 2, 3, 4]])
    assert out["demand_per_token"] == pytest.approx(3 / 3)  # 2, 3, then 4
    assert out["hit_rate"] == pytest.approx(3 / 6)
    lru = simulate(sel, None, 2, "lru", [[0, 1, 2, 3, 4]])  # 2, 3 replace 0, 1; then 0 and 4 miss
    assert lru["demand_per_token"] == pytest.approx(4 / 3)


def test_a_perfect_predictor_leaves_no_demand_after_layer_0():
    sel, _ = _trace(0)
    L, T, E = sel.shape[0], sel.shape[1], 10
    early = np.zeros((L, T, E))
    np.put_along_axis(early, sel, 1.0, axis=2)
    for policy in ("static", "lru"):
        base = simulate(sel, early, 3, policy, [list(range(E))] * L)
        pf = simulate(sel, early, 3, policy, [list(range(E))] * L, prefetch="next_layer")
        layer0 = simulate(sel[:1], None, 3, policy, [list(range(E))])["demand_per_token"]
        assert pf["demand_per_token"] == pytest.approx(layer0)
        assert layer0 < base["demand_per_token"]
        assert pf["hit_rate"] > base["hit_rate"]


@pytest.mark.parametrize("seed", [1, 2])
def test_invariants(seed):
    sel, early = _trace(seed)
    L, T, k = sel.shape
    E = 10
    everything = simulate(sel, early, E, "lru", [list(range(E))] * L, prefetch="next_layer")
    assert everything["demand_per_token"] == 0 and everything["hit_rate"] == 1.0
    for rows in (1, 3):
        for policy in ("static", "frequency", "lru"):
            out = simulate(sel, early, 4, policy, [list(range(E))] * L, rows=rows, advance=rows)
            assert 0 < out["demand_per_token"] <= L * k
            assert out["total_per_token"] == out["demand_per_token"] + out["prefetch_per_token"]
    with pytest.raises(ValueError):
        simulate(sel, early, 4, "slru", [list(range(E))] * L)
