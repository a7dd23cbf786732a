"""Sampling: filters, greedy, seeded determinism, option validation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sharpi_jax.errors import InputError
from sharpi_jax.runtime.sampling import SamplingParams, argmax, filter_logits, sample

LOGITS = jnp.log(jnp.asarray([0.05, 0.4, 0.1, 0.3, 0.15], jnp.float32))


def _kept(**kw):
    args = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | kw
    x = filter_logits(LOGITS, *(jnp.asarray(args[k]) for k in ("temperature", "top_k", "top_p", "min_p")))
    return sorted(np.nonzero(np.isfinite(np.asarray(x)))[0].tolist())


def test_filters():
    assert _kept() == [0, 1, 2, 3, 4]
    assert _kept(top_k=2) == [1, 3]
    assert _kept(top_k=1) == [1]
    assert _kept(top_p=0.5) == [1, 3]  # 0.4 < 0.5, then 0.4 + 0.3 reaches it
    assert _kept(top_p=0.4) == [1]
    assert _kept(top_p=0.71) == [1, 3, 4]
    assert _kept(min_p=0.3) == [1, 3, 4]  # p >= 0.3 * 0.4 = 0.12
    assert _kept(top_k=3, min_p=0.5) == [1, 3]


def test_greedy_and_seeded():
    assert int(sample(LOGITS, SamplingParams(), 0)) == 1
    assert int(sample(LOGITS, SamplingParams(temperature=1.0, top_k=1, seed=3), 5)) == 1
    p = SamplingParams(temperature=1.0, seed=42)
    draws = [int(sample(LOGITS, p, i)) for i in range(400)]
    assert draws == [int(sample(LOGITS, p, i)) for i in range(400)]  # a function of (seed, index)
    freq = np.bincount(draws, minlength=5) / len(draws)
    np.testing.assert_allclose(freq, [0.05, 0.4, 0.1, 0.3, 0.15], atol=0.08)
    other = [int(sample(LOGITS, SamplingParams(temperature=1.0, seed=43), i)) for i in range(400)]
    assert draws != other


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                                dict(min_p=-0.1), dict(min_p=2.0), dict(seed=-1), dict(temperature=float("nan")),
                                dict(top_k=1.5), dict(temperature="hot")])
def test_bad_options(kw):
    with pytest.raises(InputError):
        SamplingParams(**kw)


def test_argmax_is_numpys_on_ties_nans_and_infinities():
    """The greedy token (a max, then the lowest index holding it) is numpy's argmax: the lowest index on
    ties (-0.0 ties +0.0), the first NaN where there is one, index 0 of an all -inf row; on a real-sized
    row and batched rows (any leading shape) too."""
    rows = np.zeros((7, 11), np.float32)
    rows[0, [2, 7]] = 1.0  # a tie
    rows[1, [3, 5]] = np.nan  # NaNs beat every value: the first
    rows[1, 0] = np.inf
    rows[2, :] = -np.inf
    rows[3, 4], rows[3, 6] = -0.0, 0.0
    rows[3, :4] = rows[3, 5] = rows[3, 7:] = -1.0
    rows[4, 10] = np.inf
    rows[5] = np.random.default_rng(0).standard_normal(11)
    rows[6, 9] = np.finfo(np.float32).max
    assert np.array_equal(np.asarray(argmax(rows)), np.argmax(rows, axis=-1))
    big = np.random.default_rng(1).standard_normal((2, 3, 248320)).astype(np.float32)
    big[0, 1, [17, 200000]] = 9.0
    assert np.array_equal(np.asarray(argmax(big)), np.argmax(big, axis=-1))
    assert np.asarray(argmax(big[1, 2])).shape == () and int(argmax(big[1, 2])) == int(np.argmax(big[1, 2]))
