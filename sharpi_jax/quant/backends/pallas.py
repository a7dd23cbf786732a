"""The "pallas" backend (the GPU default): Triton kernels that dequantize GGUF blocks in-kernel
(`pallas_kernels.grouped_matmul`; interpret mode on CPU, for tests).

Serves `pallas_kernels.KERNEL_TYPES` (F32 / F16 / Q8_0 / Q4_K / Q5_K / Q6_K) in the "kernel" layout
(one array per block field, K-quant scales unpacked), where the kernel tiles the shape (`why_not`):
K % 32 == 0; a dense matrix's rows are zero-padded at load to a multiple of 16 (`qtensor.KERNEL_ROWS`),
so any N tiles (a router of n_expert + 1 rows, fused projections); one expert's N (not padded) must be
a multiple of the expert column tile (64) or a power of two below it. Anything else falls back to
"reference" (dequantize + dot), and `sj.load` names it. Routed experts:
expert stacks in the kernel layout, laid out once at load, computed by one grouped op (rows bucketed
into `block_m`-row tiles per expert, the grouped-matmul kernel for gate, up and down, the Pallas
weighted reduce). The per-row reduction order depends only on K, so rows are batch-independent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sharpi_jax.pallas_kernels import grouped_matmul as gm
from sharpi_jax.pallas_kernels.weighted_reduce import kernel as wr_kernel
from sharpi_jax.quant.qtensor import KERNEL_TYPES, Q, QTensor
from sharpi_jax.quant.registry import Backend, ExpertOptions

PALLAS_BLOCK_M = 16
PALLAS_BLOCK_N = 64


def _block_n(n: int) -> int | None:
    for b in (PALLAS_BLOCK_N, 32, 16):
        if n % b == 0:
            return b
    return None


PALLAS_K_STEP = 32  # columns per kernel step


def why_not(qtype: int, shape: tuple[int, ...]) -> str | None:
    """None when the kernels take a [N, K] matrix (dense, rows padded to 16 at load) or an expert stack
    [E, N, K] (one expert's N not padded: a multiple of PALLAS_BLOCK_N or a power of two below it);
    else why not, in words."""
    if Q(qtype) not in KERNEL_TYPES:
        return f"ggml type {Q(qtype).name} has no Pallas kernel"
    n, k = shape[-2], shape[-1]
    stack = len(shape) == 3
    rows_ok = not stack or n % PALLAS_BLOCK_N == 0 or (n < PALLAS_BLOCK_N and n & (n - 1) == 0)
    if k % PALLAS_K_STEP or not rows_ok:
        rule = f"K % {PALLAS_K_STEP} == 0" + (f", expert N % {PALLAS_BLOCK_N} == 0" if stack else "")
        return f"shape {n}x{k} does not tile ({rule})"
    return None


def pallas_fits(shape: tuple[int, ...]) -> bool:
    """Whether the Triton kernel tiles a [N, K] matrix (rows padded to 16) or an [E, N, K] stack."""
    return why_not(int(Q.F32), shape) is None


def _interpret(interpret: bool | None) -> bool:
    return jax.default_backend() == "cpu" if interpret is None else interpret


def kernel_matmul(x: jax.Array, w: QTensor, interpret: bool | None = None) -> jax.Array:
    """x [M, K] @ W.T for W in the kernel layout: one group of the grouped kernel."""
    m = x.shape[0]
    bm = PALLAS_BLOCK_M
    n_tiles = -(-m // bm)
    xp = jnp.zeros((n_tiles * bm, x.shape[1]), jnp.float32).at[:m].set(x)
    weights = jax.tree.map(lambda a: a[None], w.data)  # one group
    n_held = next(iter(w.data.values())).shape[-2]  # rows padded to a multiple of 16 (qtensor.KERNEL_ROWS)
    y = gm.grouped_matmul(xp, weights, jnp.zeros((n_tiles,), jnp.int32), qtype=KERNEL_TYPES[Q(w.qtype)],
                          block_m=bm, block_n=_block_n(n_held), interpret=_interpret(interpret))
    return y[:m, :w.rows]


def grouped_expert_rows(u: jax.Array, sel: jax.Array, experts: tuple[QTensor, QTensor, QTensor],
                        opts: ExpertOptions, valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Y [N, k, D] unreduced and the expert reads executed: each used row tile reads its expert's three
    matrices once (one read per unique expert while no bucket exceeds block_m rows). valid: not used
    (padding rows carry row 0's experts, so they add no reads)."""
    gate, up, down = experts
    n, k = sel.shape
    d = u.shape[1]
    flat = sel.reshape(n * k).astype(jnp.int32)
    layout = gm.group_layout(flat, gate.shape[0], opts.block_m)
    x = gm.scatter_rows(u[jnp.arange(n * k) // k], layout)
    mm = functools.partial(gm.grouped_matmul, block_m=opts.block_m, block_n=opts.block_n,
                           interpret=_interpret(opts.interpret))
    kt = lambda w: KERNEL_TYPES[Q(w.qtype)]  # noqa: E731
    g = mm(x, gate.data, layout.tile_group, qtype=kt(gate))
    h = mm(x, up.data, layout.tile_group, qtype=kt(up))
    y = mm(jax.nn.silu(g) * h, down.data, layout.tile_group, qtype=kt(down))
    loads = (layout.tile_group >= 0).sum().astype(jnp.int32)
    return gm.gather_rows(y, layout).reshape(n, k, d), loads


class PallasBackend(Backend):
    """Triton kernels with in-kernel dequantization (see module doc)."""

    name = "pallas"
    platforms = ("gpu", "cuda", "rocm")  # kernels="pallas" also runs on CPU, in interpret mode
    auto = 20
    fallback = "reference"

    def serves(self, qtype: int, shape: tuple[int, ...]) -> bool:
        return why_not(qtype, shape) is None

    def why_not(self, qtype: int, shape: tuple[int, ...]) -> str | None:
        return why_not(qtype, shape)

    def layout(self, qtype: int, shape: tuple[int, ...], repack: str | None) -> str:
        return "kernel"

    def matmul(self, x: jax.Array, w: QTensor, *, interpret: bool | None = None, **options) -> jax.Array:
        return kernel_matmul(x, w, interpret)

    expert_rows = staticmethod(grouped_expert_rows)

    def weighted_reduce(self, y: jax.Array, w: jax.Array, opts: ExpertOptions) -> jax.Array:
        return wr_kernel.weighted_reduce(y, w, interpret=_interpret(opts.interpret))
