"""The grouped-matmul kernel in interpret mode beside its masked-dense reference, for the kernel tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.pallas_kernels import grouped_matmul as gm
from sharpi_jax.pallas_kernels import quant_blocks as qb


def run_kernel(rng, qtype: str, raw: np.ndarray, k: int, ids, block_m: int = 16, block_n: int = 32,
               block_k: int | None = None):
    """GGUF blocks `raw` [n_groups, n_out, row_bytes] of `qtype` (rows of k values) multiplied with random
    rows, row i in group ids[i]: (kernel output, its bitwise reference, group layout, x, dense weights).
    Quantized types step K by 32 columns in the kernel (so does the reference); float types by block_k
    (None: the kernel's default, 32)."""
    n_groups = raw.shape[0]
    packed = qb.pack(jnp.asarray(raw), qtype, k)
    w = gm.dense_weights(packed, qtype)
    ids = jnp.asarray(ids, jnp.int32)
    lay = gm.group_layout(ids, n_groups, block_m)
    x = jnp.asarray(rng.standard_normal((ids.shape[0], k), dtype=np.float32))
    xp = gm.scatter_rows(x, lay)
    y = gm.grouped_matmul(xp, packed, lay.tile_group, qtype=qtype, block_m=block_m, block_n=block_n,
                          block_k=block_k, interpret=True)
    bk = block_k if block_k and qtype in ("f32", "f16") else 32
    ref = jax.jit(gm.grouped_matmul_reference, static_argnames=("block_m", "block_k", "block_n"))(
        xp, w, lay.tile_group, block_m=block_m, block_k=bk, block_n=block_n)
    return np.asarray(y), np.asarray(ref), lay, x, w
