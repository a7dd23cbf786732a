"""Sampling: filters, greedy, seeded determinism, option validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharpi_jax.errors import InputError
from sharpi_jax.quant import ggml
from sharpi_jax.runtime.sampling import NATIVE_ARGMAX_FROM, SamplingParams, argmax, filter_logits, sample

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


@pytest.mark.skipif(not ggml.available(), reason="the native extension did not load")
def test_native_argmax_is_numpys_across_chunks_and_lanes():
    """On the CPU, rows of NATIVE_ARGMAX_FROM logits or more take the extension's one-pass argmax (csrc/argmax.h,
    chunks of 16384 merged in order): numpy's argmax on ties between chunks and within 8 lanes, NaNs in a chunk's
    vector part or its scalar tail (the first one wins, even in a later chunk than the maximum), -0.0 tying +0.0
    across chunks, infinities, the maximum in a row's last few elements; 1-D, batched and vmapped rows."""
    V = 2 * 16384 + 1000 + 3  # three chunks, the last with a 3-element scalar tail
    fn = jax.jit(argmax)
    assert "sharpi_argmax" in fn.lower(jax.ShapeDtypeStruct((2, V), jnp.float32)).as_text()
    assert "sharpi_argmax" not in fn.lower(jax.ShapeDtypeStruct((2, NATIVE_ARGMAX_FROM - 1), jnp.float32)).as_text()
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((12, V)).astype(np.float32)
    rows[0, [20000, 16384 + 40, 5]] = 7.0  # a tie across chunks 0 and 1: chunk 0's index
    rows[1, [16384 + 3, 16384 + 6]] = 7.0  # a tie within one 8-lane vector: the lower lane
    rows[2, V - 2] = np.nan  # a NaN in the last chunk's scalar tail beats the maximum in chunk 0
    rows[2, 100] = 50.0
    rows[3, [16384 + 900, 2 * 16384 + 17]] = np.nan  # NaNs in two chunks' vector parts: the first
    rows[3, V - 1] = np.nan
    rows[4] = -np.inf
    rows[5] = -1.0
    rows[5, 2 * 16384 + 5], rows[5, 16384 + 9] = 0.0, -0.0  # -0.0 in an earlier chunk ties +0.0
    rows[6, V - 1] = 9.0  # the maximum in the tail
    rows[7, [16384 - 1, 16384]] = np.inf  # a tie on both sides of a chunk boundary
    rows[8, V - 3] = 9.0
    rows[8, V - 1] = 9.0  # a tie inside the tail
    rows[9, 31], rows[9, 32] = 8.0, 8.0  # a tie across two vectors of the unrolled loop
    rows[10, 16384 - 1] = np.nan  # a NaN as the last element of a chunk
    rows[11, 0] = np.nan  # the very first element
    want = np.argmax(rows, axis=-1)
    assert np.array_equal(np.asarray(fn(rows)), want)
    assert np.array_equal(np.asarray(fn(rows.reshape(3, 4, V))), want.reshape(3, 4))
    assert np.array_equal(np.asarray(jax.jit(jax.vmap(argmax))(rows)), want)
    for r in rows:
        assert int(fn(r)) == int(np.argmax(r))
    for n in (NATIVE_ARGMAX_FROM, 16384, 16385):  # one chunk; a chunk and a one-element chunk
        x = rng.standard_normal((3, n)).astype(np.float32)
        x[0, n - 1] = 10.0
        x[1, [0, n - 1]] = 10.0
        assert np.array_equal(np.asarray(fn(x)), np.argmax(x, axis=-1))
