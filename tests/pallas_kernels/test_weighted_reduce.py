"""Top-k weighted reduce: Pallas kernel (interpret mode) vs the jnp reference, and the reference's
rank-order semantics against plain numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharpi_jax.pallas_kernels.weighted_reduce import weighted_reduce, weighted_reduce_reference
from tests.bitwise import assert_bitwise_equal
from tests.cuda_lowering import lower_for_cuda

_ref = jax.jit(weighted_reduce_reference)


def _inputs(rng, n, k, d):
    y = jnp.asarray(rng.standard_normal((n, k, d), dtype=np.float32))
    w = jnp.asarray(rng.random((n, k), dtype=np.float32))
    s = jnp.asarray(rng.standard_normal((n, d), dtype=np.float32))
    return y, w, s


@pytest.mark.parametrize("n,k,d", [(1, 1, 32), (5, 3, 64), (9, 8, 128), (16, 5, 96), (3, 7, 32)])
def test_kernel_interpret_equals_reference_bitwise(n, k, d):
    rng = np.random.default_rng(n * 100 + k)
    y, w, s = _inputs(rng, n, k, d)
    for shared in (None, s):
        out = np.asarray(weighted_reduce(y, w, shared, block_rows=4, block_d=32, interpret=True))
        assert out.shape == (n, d)
        assert not np.isnan(out).any(), "kernel left unwritten outputs"
        assert_bitwise_equal(out, np.asarray(_ref(y, w, shared)))


def test_reference_is_rank_order_multiply_then_add():
    """Sequential in rank order: (1e8 + -1e8) + 1 = 1, whereas pairing 1 with 1e8 first would lose it."""
    y = jnp.asarray(np.array([[[1e8], [-1e8], [1.0]], [[1e8], [1.0], [-1e8]]], np.float32))
    w = jnp.ones((2, 3), jnp.float32)
    out = np.asarray(_ref(y, w))
    assert_bitwise_equal(out, np.array([[1.0], [0.0]], np.float32))
    # k = 1 is a single rounding: equal to numpy bit for bit.
    rng = np.random.default_rng(0)
    y1, w1, _ = _inputs(rng, 6, 1, 40)
    assert_bitwise_equal(np.asarray(_ref(y1, w1)), np.asarray(w1)[:, :1] * np.asarray(y1)[:, 0])


def test_reference_matches_float64_sum():
    rng = np.random.default_rng(1)
    y, w, s = _inputs(rng, 7, 8, 64)
    want = np.einsum("nk,nkd->nd", np.asarray(w, np.float64), np.asarray(y, np.float64)) + np.asarray(s)
    np.testing.assert_allclose(np.asarray(_ref(y, w, s)), want, rtol=1e-5, atol=1e-5)


def test_bad_tiles_raise_value_error():
    """A plain ValueError naming the tiles (pallas_kernels does not import sharpi_jax's errors)."""
    y, w, s = _inputs(np.random.default_rng(3), 4, 2, 32)
    with pytest.raises(ValueError, match="tiles must be powers of two: block_rows=3"):
        weighted_reduce(y, w, s, block_rows=3, interpret=True)


def test_triton_lowering_on_cpu():
    rng = np.random.default_rng(2)
    y, w, s = _inputs(rng, 10, 8, 256)
    text = lower_for_cuda(lambda: jax.jit(lambda *a: weighted_reduce(*a)).trace(y, w, s).lower(
        lowering_platforms=("cuda",)))
    assert "__gpu$xla.gpu.triton" in text
