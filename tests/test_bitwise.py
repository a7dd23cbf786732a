"""The bitwise-equality helper (tests/bitwise.py) fails on what value comparisons let through."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from tests.bitwise import assert_bitwise_equal, bit_view, bitwise_equal

FLOATS = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
NAN_BITS = {np.float16: (0x7E00, 0x7E01, np.uint16), ml_dtypes.bfloat16: (0x7FC0, 0x7FC1, np.uint16),
            np.float32: (0x7FC00000, 0x7FC00001, np.uint32),
            np.float64: (0x7FF8000000000000, 0x7FF8000000000001, np.uint64)}


class State(NamedTuple):
    k: tuple
    ssm: jnp.ndarray
    pos: int


def _tree(leaf):
    """A nested pytree (NamedTuple of tuples, dict, list) with `leaf` deep inside."""
    return {"state": State(k=(np.arange(6, dtype=np.float32).reshape(2, 3), leaf), ssm=jnp.ones((2, 2)), pos=3),
            "tokens": [1, 2, 3], "accepted": np.int32(2)}


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_signed_zero_differs(dtype):
    pos, neg = np.array([1.0, 0.0, 2.0], dtype), np.array([1.0, -0.0, 2.0], dtype)
    np.testing.assert_array_equal(pos, neg)  # a value comparison lets it through
    with pytest.raises(AssertionError, match=r"1 of 3 values differ in their bits; first at index \(1,\)"):
        assert_bitwise_equal(pos, neg)
    with pytest.raises(AssertionError, match=r"\['state'\]\.k\[1\]"):  # the leaf is named by its path
        assert_bitwise_equal(_tree(pos), _tree(neg))
    assert_bitwise_equal(_tree(neg), _tree(neg.copy()))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_nan_payloads(dtype):
    a_bits, b_bits, uint = NAN_BITS[dtype]
    a = np.array([a_bits, 0], uint).view(dtype)
    b = np.array([b_bits, 0], uint).view(dtype)
    assert np.isnan(a[0].astype(np.float64)) and np.isnan(b[0].astype(np.float64))
    with pytest.raises(AssertionError, match="differ in their bits"):
        assert_bitwise_equal(a, b)
    assert_bitwise_equal(a, a.copy())  # the same NaN bits are equal (a value comparison says NaN != NaN)
    assert_bitwise_equal(jnp.asarray(a), a.copy()) if dtype != np.float64 else None


def test_identical_trees_pass():
    leaf = np.array([[np.nan, -0.0, np.inf], [1e-45, -1.0, 3.0]], np.float32)
    assert_bitwise_equal(_tree(leaf), _tree(leaf.copy()))
    assert_bitwise_equal(jnp.asarray(leaf), leaf)  # jax vs numpy arrays
    assert bitwise_equal(_tree(leaf), _tree(leaf.copy()))
    ints = {"a": np.arange(5, dtype=np.int32), "b": np.array([True, False]), "c": np.uint8(7)}
    assert_bitwise_equal(ints, {k: np.copy(v) for k, v in ints.items()})


def test_int_leaves_and_scalars():
    assert_bitwise_equal([1, 2, 3], [1, 2, 3])
    with pytest.raises(AssertionError, match=r"\[2\]: 1 of 1 values differ"):
        assert_bitwise_equal([1, 2, 3], [1, 2, 4])
    with pytest.raises(AssertionError, match="dtype int32 != int64"):
        assert_bitwise_equal(np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64))


def test_dtype_shape_and_structure_differences_fail():
    x = np.zeros(4, np.float32)
    with pytest.raises(AssertionError, match="dtype float32 != float64"):
        assert_bitwise_equal(x, x.astype(np.float64))  # same values, different bits
    with pytest.raises(AssertionError, match=r"shape \(4,\) != \(2, 2\)"):
        assert_bitwise_equal(x, x.reshape(2, 2))
    with pytest.raises(AssertionError, match="tree structures differ"):
        assert_bitwise_equal((x, x), [x, x])
    with pytest.raises(AssertionError, match="tree structures differ"):
        assert_bitwise_equal({"a": x}, {"b": x})
    with pytest.raises(AssertionError, match="tree structures differ"):
        assert_bitwise_equal(State((x,), x, 1), (((x,), x, 1)))


def test_nnx_state():
    class Lin(nnx.Module):
        def __init__(self, w):
            self.w = nnx.Param(jnp.asarray(w))

    w = np.array([[0.5, 0.0], [1.0, 2.0]], np.float32)
    a, b = nnx.state(Lin(w)), nnx.state(Lin(w.copy()))
    assert_bitwise_equal(a, b)
    w[0, 1] = -0.0
    with pytest.raises(AssertionError, match=r"w.*differ in their bits; first at index \(0, 1\)"):
        assert_bitwise_equal(a, nnx.state(Lin(w)))


def test_bit_view_widths():
    for dtype, uint in ((np.float16, np.uint16), (ml_dtypes.bfloat16, np.uint16), (np.float32, np.uint32),
                        (np.float64, np.uint64)):
        assert bit_view(np.ones(2, dtype)).dtype == uint
    assert bit_view(np.ones(2, np.complex64)).shape == (4,)
    assert bit_view(np.arange(3)).dtype == np.arange(3).dtype
