"""The top-k weighted reduce as a Pallas kernel (Triton on GPU, `interpret=True` on CPU).

Grid: (row tiles, feature tiles). Each program loads, for its rows and feature columns, the k expert
outputs and weights and accumulates them in rank order with the same expression as the reference:

    acc = w0 * y0;  acc = acc + w_j * y_j  (j = 1..k-1);  acc = acc + shared

Triton wants power-of-two tiles, and k (1..8, any) is not one, so `y` is viewed as [N, k * D] and
passed k times, rank j's BlockSpec selecting columns [j * D + d0, j * D + d0 + block_d); `w` likewise
with (block_rows, 1) tiles. Nothing is copied: the k operands are the same buffer. Rows are padded
to a whole number of row tiles (and the padding sliced off), so every output element is written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def _kernel(*refs, k: int, has_shared: bool):
    y_refs, w_refs = refs[:k], refs[k:2 * k]
    rest = refs[2 * k:]
    o_ref = rest[-1]
    acc = w_refs[0][...] * y_refs[0][...]
    for j in range(1, k):
        acc = acc + w_refs[j][...] * y_refs[j][...]
    if has_shared:
        acc = acc + rest[0][...]
    o_ref[...] = acc


def _pick_block_d(d: int, block_d: int) -> int:
    b = 1 << (min(block_d, d).bit_length() - 1)  # largest power of two <= both
    while d % b:
        b //= 2
    return b


@functools.partial(jax.jit, static_argnames=("block_rows", "block_d", "interpret", "num_warps", "num_stages"))
def weighted_reduce(
    y: jax.Array,
    w: jax.Array,
    shared: jax.Array | None = None,
    *,
    block_rows: int = 8,
    block_d: int = 256,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 1,
) -> jax.Array:
    """y: float32[N, k, D], w: float32[N, k], shared: float32[N, D] | None -> float32[N, D].

    D must have a power-of-two factor to tile (`block_d` is halved until it divides D).
    """
    n, k, d = y.shape
    bd = _pick_block_d(d, block_d)
    if bd & (bd - 1) or block_rows & (block_rows - 1):
        raise ValueError(f"tiles must be powers of two: block_rows={block_rows}, block_d={bd} (D={d})")
    n_pad = -(-n // block_rows) * block_rows
    pad = ((0, n_pad - n),)
    y2 = jnp.pad(y.astype(jnp.float32).reshape(n, k * d), pad + ((0, 0),))
    w2 = jnp.pad(w.astype(jnp.float32), pad + ((0, 0),))
    nd = d // bd
    y_specs = [pl.BlockSpec((block_rows, bd), lambda i, c, j=j: (i, j * nd + c)) for j in range(k)]
    w_specs = [pl.BlockSpec((block_rows, 1), lambda i, c, j=j: (i, j)) for j in range(k)]
    args = [y2] * k + [w2] * k
    specs = y_specs + w_specs
    if shared is not None:
        args.append(jnp.pad(shared.astype(jnp.float32), pad + ((0, 0),)))
        specs.append(pl.BlockSpec((block_rows, bd), lambda i, c: (i, c)))
    out = pl.pallas_call(
        functools.partial(_kernel, k=k, has_shared=shared is not None),
        out_shape=jax.ShapeDtypeStruct((n_pad, d), jnp.float32),
        grid=(n_pad // block_rows, nd),
        in_specs=specs,
        out_specs=pl.BlockSpec((block_rows, bd), lambda i, c: (i, c)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="weighted_reduce",
    )(*args)
    return out[:n]
