"""Routed-expert stacks for tests and benchmarks: GGUF bytes of random experts, laid out as QTensor
stacks (gate [E, F, D], up [E, F, D], down [E, D, F]) by a `quant.MatrixFormat`, as a loader would."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from sharpi_jax.pallas_kernels import quant_blocks as qb
from sharpi_jax.quant import MatrixFormat, QTensor
from sharpi_jax.testing.synthetic import random_blocks

def expert_shapes(n_expert: int, d_ff: int, d_model: int) -> tuple[tuple[int, int, int], ...]:
    """Numpy shapes of (gate, up, down) stacks."""
    return (n_expert, d_ff, d_model), (n_expert, d_ff, d_model), (n_expert, d_model, d_ff)


def quantize(x: np.ndarray, qtype: int) -> np.ndarray:
    """float32 [..., cols] -> GGUF bytes uint8 [..., row_bytes] of `qtype` (F32 / F16 / BF16 as their
    bytes; Q4_K by a simple quantizer, gguf-py having none; other types by gguf.quants)."""
    x = np.asarray(x, np.float32)
    qt = Q(qtype)
    if qt == Q.F32:
        return x.view(np.uint8).reshape(*x.shape[:-1], -1)
    if qt == Q.F16:
        return x.astype(np.float16).view(np.uint8).reshape(*x.shape[:-1], -1)
    if qt == Q.Q4_K:
        return qb.quantize_q4_k_np(x)
    return np.asarray(gq.quantize(x, qt))


def random_expert_bytes(rng: np.random.Generator, n_expert: int, d_ff: int, d_model: int,
                        qtypes: int | Sequence[int], scale: float | None = None) -> tuple[np.ndarray, ...]:
    """(gate, up, down) GGUF bytes of N(0, scale^2) experts (default 1/sqrt(fan_in)) quantized to
    `qtypes` (one type, or one per matrix), one expert at a time (no float copy of all E)."""
    qtypes = (qtypes,) * 3 if isinstance(qtypes, (int, np.integer)) else tuple(qtypes)
    out = []
    for (e, rows, cols), q in zip(expert_shapes(n_expert, d_ff, d_model), qtypes):
        s = scale if scale is not None else cols**-0.5
        out.append(np.stack([quantize(rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(s), q)
                             for _ in range(e)]))
    return tuple(out)


def synthetic_expert_bytes(rng: np.random.Generator, n_expert: int, d_ff: int, d_model: int,
                           qtypes: int | Sequence[int]) -> tuple[np.ndarray, ...]:
    """Fast (gate, up, down) bytes for speed work: random valid blocks (finite scales) of quantized
    types, N(0, 1/fan_in) floats otherwise. Never for correctness against real models."""
    qtypes = (qtypes,) * 3 if isinstance(qtypes, (int, np.integer)) else tuple(qtypes)
    out = []
    for q, shape in zip(qtypes, expert_shapes(n_expert, d_ff, d_model)):
        if Q(q) in (Q.F32, Q.F16, Q.BF16):
            out.append(quantize(rng.standard_normal(shape, dtype=np.float32) * np.float32(shape[-1] ** -0.5), q))
        else:
            out.append(random_blocks(rng, Q(q), shape, 0.05))
    return tuple(out)


def expert_stacks(raws: Sequence[np.ndarray], qtypes: int | Sequence[int], fmt: MatrixFormat = MatrixFormat(),
                  backend: str | None = None) -> tuple[QTensor, QTensor, QTensor]:
    """(gate, up, down) bytes -> QTensor stacks laid out by `fmt` (one backend for all three: `backend`,
    default `fmt.experts_backend`), as `sharpi_jax.experts.provider` loads them."""
    qtypes = (qtypes,) * 3 if isinstance(qtypes, (int, np.integer)) else tuple(int(q) for q in qtypes)
    shapes = expert_shapes(raws[0].shape[0], raws[0].shape[1], raws[2].shape[1])
    backend = backend or fmt.experts_backend(qtypes, shapes)
    return tuple(fmt.pack(np.asarray(r), int(q), s, backend) for r, q, s in zip(raws, qtypes, shapes))
