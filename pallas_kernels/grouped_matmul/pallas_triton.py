"""Grouped (ragged) matmul over expert groups: a Pallas kernel lowered through Triton.

Layout (see `layout.py`): rows are bucketed by group and each bucket is padded to whole `block_m`-row
tiles, so each row tile has one group, given by `tile_group` (an int32 input array, -1 = unused tile).

Grid: (row tiles, output-column tiles). Program (t, j) reads its group g = tile_group[t], then
accumulates over K in `block_k` chunks, in ascending order:

    acc += x[t-tile, k-chunk] @ dequant(w[g, j-tile, k-chunk]).T

so a row's result depends only on that row, its group's weights and K: never on the other rows of
the tile, the batch size or the routing. Programs of unused tiles store zeros.

Weights are read in the kernel layout of `pallas_kernels.quant_blocks` (`pack`; fields per type in
`quant_blocks.KERNEL_FIELDS`): float32 (`{"w": [G, N, K]}`), Q8_0, Q4_K, Q5_K or Q6_K; quantized
blocks are dequantized inside the kernel, one 32-column sub-block per step, in gguf's operation order
(exact), so `block_k` is 32 for them.

On a GPU the call lowers through Triton (`plt.CompilerParams` passed explicitly: Pallas would
otherwise pick Mosaic GPU); on CPU run it with `interpret=True` (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .. import quant_blocks as qb

WEIGHT_FIELDS = qb.KERNEL_FIELDS


def _load_w_tile(w_refs, qtype: str, g, n0, k0, block_n: int, block_k: int):
    """float32[block_n, block_k] tile of group g's weights at rows n0, columns k0."""
    rows = pl.ds(n0, block_n)
    if qtype in ("f32", "f16"):
        (w_ref,) = w_refs
        return w_ref[g, rows, pl.ds(k0, block_k)].astype(jnp.float32)
    if qtype == "q8_0":
        qs_ref, d_ref = w_refs
        sub = k0 >> 5  # k0 // 32
        return qb.dequant_tile_q8_0(qs_ref[g, rows, pl.ds(k0, qb.QK8_0)], d_ref[g, rows, pl.ds(sub, 1)])
    # K-quants. Bit arithmetic, not // and %: jnp's floor division lowers to sign fix-ups Triton rejects.
    sub = k0 >> 5  # global 32-column sub-block
    sup = sub >> 3  # super-block of 256 columns
    j = sub & 7  # sub-block within the super-block
    if qtype in ("q4_k", "q5_k"):
        qs_ref, *qh_ref, d_ref, dmin_ref, sc_ref, mn_ref = w_refs
        byte0 = sup * 128 + (j >> 1) * 32  # its 32 bytes: low nibbles for even j, high for odd
        scales = (d_ref[g, rows, pl.ds(sup, 1)], dmin_ref[g, rows, pl.ds(sup, 1)],
                  sc_ref[g, rows, pl.ds(sub, 1)], mn_ref[g, rows, pl.ds(sub, 1)])
        q = qs_ref[g, rows, pl.ds(byte0, 32)]
        if qtype == "q4_k":
            return qb.dequant_tile_q4_k(q, (j & 1) * 4, *scales)
        qh = qh_ref[0][g, rows, pl.ds(sup * 32, 32)]  # the super-block's 32 high-bit bytes, bit j
        return qb.dequant_tile_q5_k(q, (j & 1) * 4, qh, j, *scales)
    if qtype == "q6_k":
        ql_ref, qh_ref, sc_ref, d_ref = w_refs
        ql_off, shift_l, qh_off, shift_h = qb.q6_k_tile_index(j)
        return qb.dequant_tile_q6_k(
            ql_ref[g, rows, pl.ds(sup * 128 + ql_off, 32)],
            shift_l,
            qh_ref[g, rows, pl.ds(sup * 64 + qh_off, 32)],
            shift_h,
            d_ref[g, rows, pl.ds(sup, 1)],
            sc_ref[g, rows, pl.ds(sub * 2, 1)],
            sc_ref[g, rows, pl.ds(sub * 2 + 1, 1)],
        )
    raise ValueError(f"unsupported qtype {qtype!r}")


def _kernel(tg_ref, x_ref, *refs, qtype, k, block_m, block_n, block_k):
    *w_refs, o_ref = refs
    t = pl.program_id(0)
    n0 = pl.program_id(1) * block_n
    g = tg_ref[t]

    @pl.when(g >= 0)
    def _():
        def step(kb, acc):
            k0 = kb * block_k
            xt = x_ref[:, pl.ds(k0, block_k)]
            wt = _load_w_tile(w_refs, qtype, g, n0, k0, block_n, block_k)
            return acc + plt.dot(xt, wt, trans_b=True, allow_tf32=False)

        acc = jax.lax.fori_loop(0, k // block_k, step, jnp.zeros((block_m, block_n), jnp.float32))
        o_ref[...] = acc

    @pl.when(g < 0)
    def _():
        o_ref[...] = jnp.zeros((block_m, block_n), jnp.float32)


@functools.partial(
    jax.jit,
    static_argnames=("qtype", "block_m", "block_n", "block_k", "interpret", "num_warps", "num_stages"),
)
def grouped_matmul(
    x: jax.Array,
    w: dict[str, jax.Array],
    tile_group: jax.Array,
    *,
    qtype: str = "f32",
    block_m: int = 16,
    block_n: int = 64,
    block_k: int | None = None,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """y[r] = x[r] @ dequant(w[group(r)]).T over the tile-aligned group layout.

    x: float32[n_tiles * block_m, K]; w: packed weights with leading dims [G, N]; tile_group:
    int32[n_tiles] (-1 = unused). Returns float32[n_tiles * block_m, N]. Block sizes must be powers of
    two (Triton); N % block_n == 0 and K % block_k == 0.
    """
    if qtype not in WEIGHT_FIELDS:
        raise ValueError(f"the grouped-matmul kernel reads {tuple(WEIGHT_FIELDS)}, not {qtype!r}")
    if tuple(sorted(w)) != tuple(sorted(WEIGHT_FIELDS[qtype])):
        raise ValueError(f"{qtype} weights need fields {WEIGHT_FIELDS[qtype]}, got {tuple(w)}")
    m, k = x.shape
    n_tiles = tile_group.shape[0]
    fields = WEIGHT_FIELDS[qtype]
    n = w[fields[0]].shape[1]
    if qtype not in ("f32", "f16"):
        block_k = 32
    block_k = block_k or min(k, 64)
    block_n = min(block_n, n)
    if m != n_tiles * block_m:
        raise ValueError(f"x has {m} rows, tile_group says {n_tiles} tiles of {block_m}")
    if n % block_n or k % block_k or k != qb.kernel_k(w, qtype):
        raise ValueError(f"shapes: N={n} block_n={block_n} K={k} block_k={block_k} w K={qb.kernel_k(w, qtype)}")
    kernel = functools.partial(_kernel, qtype=qtype, k=k, block_m=block_m, block_n=block_n, block_k=block_k)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(n_tiles, n // block_n),
        in_specs=[pl.no_block_spec, pl.BlockSpec((block_m, k), lambda t, j: (t, 0))]
        + [pl.no_block_spec] * len(fields),
        out_specs=pl.BlockSpec((block_m, block_n), lambda t, j: (t, j)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"grouped_matmul_{qtype}",
    )(tile_group, x.astype(jnp.float32), *(w[f] for f in fields))
