"""Bit-for-bit equality of arrays and pytrees: the one helper behind every "bitwise" claim of the tests.

`assert_bitwise_equal(actual, expected)` compares the tree structures, then every leaf's dtype, shape
and bit pattern: floating leaves (float16, bfloat16, float32, float64, ...) are viewed as unsigned
integers of their width (`view(np.uint32)` for float32), so +0.0 vs -0.0 and NaNs with different
payloads differ, and two NaNs with the same payload are equal. (`chex.assert_trees_all_equal` and
`np.testing.assert_array_equal` compare values: they pass +0 vs -0 and any NaN vs any NaN.)

Leaves are anything `np.asarray` takes: jax or numpy arrays, numpy scalars, Python ints/floats/bools
(Python ints and floats become int64 / float64 on both sides). Pytrees are whatever `jax.tree_util`
flattens: tuples, lists, dicts, NamedTuples, registered dataclasses, flax nnx states.
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["assert_bitwise_equal", "bit_view", "bitwise_equal"]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bit_view(x) -> np.ndarray:
    """The leaf's bits as an unsigned integer array of the same shape (bools and integers as is)."""
    a = np.asarray(x)
    if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
        return a
    if a.dtype.kind == "c":  # complex: the bits of the two float halves
        return np.ascontiguousarray(a).view(_UINT[a.dtype.itemsize // 2])
    if a.dtype.kind in "fV" and a.dtype.itemsize in _UINT:  # float16/32/64; bfloat16 and float8 (ml_dtypes)
        return np.ascontiguousarray(a).view(_UINT[a.dtype.itemsize])
    raise TypeError(f"no bit view for dtype {a.dtype}")


def _leaf_problem(path: str, a, b) -> str | None:
    """None when the two leaves are bitwise equal, else a description of the first difference."""
    if isinstance(a, str) or isinstance(b, str):
        return None if a == b else f"{path}: {a!r} != {b!r}"
    x, y = np.asarray(a), np.asarray(b)
    if x.dtype != y.dtype:
        return f"{path}: dtype {x.dtype} != {y.dtype}"
    if x.shape != y.shape:
        return f"{path}: shape {x.shape} != {y.shape}"
    bx, by = bit_view(x), bit_view(y)
    diff = np.flatnonzero(bx.reshape(-1) != by.reshape(-1))
    if not diff.size:
        return None
    i = int(diff[0])
    idx = np.unravel_index(i, x.shape) if x.shape else ()
    bits = bx.reshape(-1)[i], by.reshape(-1)[i]
    width = 2 * bx.dtype.itemsize
    return (f"{path}: {diff.size} of {x.size} values differ in their bits; first at index {tuple(map(int, idx))}: "
            f"{x.reshape(-1)[i]!r} (0x{int(bits[0]):0{width}x}) != {y.reshape(-1)[i]!r} (0x{int(bits[1]):0{width}x})")


def _flatten(tree):
    return jax.tree_util.tree_flatten_with_path(tree)


def _problems(actual, expected) -> list[str]:
    (la, ta), (lb, tb) = _flatten(actual), _flatten(expected)
    if ta != tb:
        return [f"tree structures differ:\n  actual   {ta}\n  expected {tb}"]
    out = []
    for (path, a), (_, b) in zip(la, lb):
        p = _leaf_problem(jax.tree_util.keystr(path) or "<root>", a, b)
        if p:
            out.append(p)
    return out


def bitwise_equal(actual, expected) -> bool:
    """True when the two pytrees have the same structure and every leaf the same dtype, shape and bits."""
    return not _problems(actual, expected)


def assert_bitwise_equal(actual, expected, what: str = "") -> None:
    """Raises AssertionError naming every leaf whose dtype, shape or bits differ (and the first
    differing element, with its bits in hex)."""
    problems = _problems(actual, expected)
    if problems:
        head = f"{what}: " if what else ""
        shown = problems[:8] + ([f"... and {len(problems) - 8} more leaves"] if len(problems) > 8 else [])
        raise AssertionError(head + "not bitwise equal\n" + "\n".join(shown))
