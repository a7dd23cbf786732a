"""Token -> expert dispatch for the routed experts of a MoE layer (grouped: each used expert is read
once per batch).

`routed_experts(u, sel, w, experts, mode=...)` computes, for every row i,

    routed[i] = sum_j w[i, j] * W_down[e] (silu(W_gate[e] u_i) * W_up[e] u_i),   e = sel[i, j]

summed in rank order j = 0..k-1 (the shared expert is the caller's). Three modes:

- "per_token": the reference loop, one (row, rank) pair at a time: N*k expert reads.
- "grouped": bucket the N*k pairs by expert (stable sort, group sizes, inverse permutation), then
  visit each used expert once (a loop over the used experts only), dequantize its three matrices
  once, and apply them to its rows in row tiles sized to the bucket (`row_tiles`): |unique(sel)|
  expert reads. This is the CPU fast path.
- "pallas": the same bucketing into `block_m`-aligned tiles, then the Pallas grouped-matmul kernel
  (`pallas_kernels.grouped_matmul`) and the Pallas weighted reduce; Triton on GPU, interpret mode on
  CPU (slow: tests only).

Bit parity. "per_token" and "grouped" agree bit for bit on every row, whatever N, the routing or the
batch contents, because both apply each expert through the same row-stable product:

- row_kernel="gemm" (default): every product has >= 2 rows. XLA:CPU lowers an M = 1 matmul to a
  different kernel (an LLVM IR GEMV) than M >= 2 (YNNPACK), and the two differ in the last bits, while
  the rows of any M >= 2 product do not depend on M or on the other rows. So the per-token path pads
  its single row with a zero row, and the grouped path uses tiles of 2 to 16 rows.
- row_kernel="gemv": every product has exactly one row (the fused-dequant GEMV that M = 1 lowers
  to); the grouped path loops over an expert's rows one at a time on the expert's weights,
  dequantized once. Faster for one token (decode) on CPU, slower for large groups.

The two kernels do not agree with each other: a model must use one row kernel for decode, verify and
prefill alike (that is what makes batched verify equal sequential decode). Dequantization is exact and
elementwise, gathers and scatters are exact, and the top-k reduce is one shared jnp expression (so XLA
contracts it to FMAs the same way in both paths). These facts are measured on XLA:CPU (the tests prove
them here); on a GPU use the "pallas" family, whose per-row arithmetic depends only on K and the tile
shapes, for decode and verify alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import grouped_matmul as gm
from pallas_kernels import quant_blocks as qb
from pallas_kernels.weighted_reduce import kernel as wr_kernel
from pallas_kernels.weighted_reduce import reference as wr_reference
from sharpi_jax import config
from sharpi_jax.errors import InputError, UnsupportedQuantError
from sharpi_jax.experts.expert_weights import ExpertWeights

MODES = ("per_token", "grouped", "pallas")
ROW_KERNELS = config.ROW_KERNELS  # ("gemm", "gemv")

__all__ = [
    "ExpertWeights",
    "Buckets",
    "DispatchConfig",
    "MODES",
    "ROW_KERNELS",
    "PackedExpertWeights",
    "bucket",
    "row_tiles",
    "dispatch_counts",
    "dispatch_stats",
    "expert_ffn",
    "expert_rows",
    "pack_expert_weights",
    "read_bytes",
    "routed_experts",
    "weighted_reduce",
]


# ----------------------------------------------------------------------------- bucketing


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["order", "token", "counts", "starts", "used", "n_used", "inv_order"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Buckets:
    """CSR bucketing of the N*k (row, rank) pairs by expert, all static shapes (T = N*k).

    order: int32[T]       pair index (i*k + j) of each sorted slot; stable, so a bucket is in
                          ascending (i, j) order, as the spec's cursor walk produces it
    token: int32[T]       row i of each sorted slot (order // k)
    counts: int32[E]      rows per expert (group sizes)
    starts: int32[E]      first sorted slot of each expert's bucket (exclusive prefix sum)
    used: int32[min(E,T)] the used experts, ascending, padded with 0 past n_used
    n_used: int32[]       number of distinct experts in `sel`
    inv_order: int32[T]   sorted slot of each pair (the inverse permutation)
    """

    order: jax.Array
    token: jax.Array
    counts: jax.Array
    starts: jax.Array
    used: jax.Array
    n_used: jax.Array
    inv_order: jax.Array


def bucket(sel: jax.Array, n_expert: int) -> Buckets:
    """Buckets top-k ids `sel` (int32[N, k]) by expert with a stable sort (jittable)."""
    n, k = sel.shape
    t = n * k
    flat = sel.reshape(t).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.bincount(flat, length=n_expert).astype(jnp.int32)
    starts = (jnp.cumsum(counts) - counts).astype(jnp.int32)
    used_mask = counts > 0
    used = jnp.nonzero(used_mask, size=min(n_expert, t), fill_value=0)[0].astype(jnp.int32)
    inv_order = jnp.zeros((t,), jnp.int32).at[order].set(jnp.arange(t, dtype=jnp.int32))
    return Buckets(
        order=order,
        token=order // k,
        counts=counts,
        starts=starts,
        used=used,
        n_used=used_mask.sum().astype(jnp.int32),
        inv_order=inv_order,
    )


# ----------------------------------------------------------------------------- expert math


def _rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [R, in] @ w[out, in].T -> [R, out], contracting the last dims (no transpose copy)."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))


def expert_ffn(
    x: jax.Array,
    wg: jax.Array,
    wu: jax.Array,
    wd: jax.Array,
    input_orders: tuple[str | None, str | None, str | None] = (None, None, None),
) -> jax.Array:
    """Unweighted SwiGLU expert on rows x [R, D]: W_down (silu(W_gate x) * W_up x) -> [R, D].

    input_orders: per matrix, the qtype whose storage K order its columns are in (None: natural);
    the matrix's input is permuted to match (`ExpertWeights.input_orders`).
    """
    perm = qb.storage_k_order
    g = _rows_matmul(perm(x, input_orders[0]) if input_orders[0] else x, wg)
    up = _rows_matmul(perm(x, input_orders[1]) if input_orders[1] else x, wu)
    h = jax.nn.silu(g) * up
    return _rows_matmul(perm(h, input_orders[2]) if input_orders[2] else h, wd)


def _load_expert(experts: ExpertWeights, e: jax.Array):
    """Expert e's float32 matrices in their fastest column order, and that order."""
    return experts.dequant_expert(e, k_order="storage"), experts.input_orders


def weighted_reduce(y: jax.Array, w: jax.Array, shared: jax.Array | None = None) -> jax.Array:
    """sum_j w[:, j] * y[:, j] in rank order j = 0..k-1 (multiply, then add), + shared if given.

    y: float32[N, k, D]; w: float32[N, k]; shared: float32[N, D] or None. One expression for every
    path (see `pallas_kernels.weighted_reduce.reference`).
    """
    return wr_reference.weighted_reduce_reference(y, w, shared)


ROW_TILE_LADDER = (2, 4, 8, 16)


def row_tiles(n_rows: int, row_tile: int | None = None) -> tuple[int, ...]:
    """The grouped-gemm tile sizes for a batch of `n_rows` tokens.

    An int gives one fixed tile. None gives a ladder (2, 4, 8, 16), capped at the largest bucket
    possible (a row's top-k ids are distinct, so a bucket holds at most N rows): each bucket chunk
    takes the smallest tile that holds it. On XLA:CPU a small product costs about the same for 2 or
    16 rows (packing the weights dominates), so one right-sized tile beats several small ones; and all
    tiles have >= 2 rows, so every size gives the same bits.
    """
    if row_tile is not None:
        return (int(row_tile),)
    cap = max(2, 1 << max(0, (n_rows - 1).bit_length()))
    return tuple(sorted({min(t, cap) for t in ROW_TILE_LADDER}))


_MIB = 1 << 20


def _expert_bytes(weights: Any) -> int | None:
    """Bytes one expert read takes from `weights` (a pytree of arrays with the expert on axis 0): one
    index along axis 0 of every leaf, in the leaves' own storage (GGUF blocks, SoA fields, the kernel
    layout). Static: shapes and dtypes only. None for a duck-typed expert source that is no pytree of
    arrays (residency's two-stack view): its reads are counted, not its bytes."""
    leaves = jax.tree.leaves(weights)
    if not leaves or not all(hasattr(a, "shape") and hasattr(a, "dtype") for a in leaves):
        return None
    return sum(math.prod(a.shape[1:]) * jnp.dtype(a.dtype).itemsize for a in leaves)


def _no_bytes(per_read: int | None) -> jax.Array | None:
    return None if per_read is None else jnp.zeros(2, jnp.int32)


def _add_bytes(counter: jax.Array | None, n_bytes: int | None) -> jax.Array | None:
    """counter int32[2] = (MiB, bytes below a MiB) plus a static n_bytes: exact up to 2**51 bytes with
    32-bit integers (one int32 of bytes wraps at 2 GiB: 256 expert reads of a 35B-A3B Q4_K layer)."""
    if counter is None or n_bytes is None:
        return counter
    mib = counter[0] + n_bytes // _MIB
    rest = counter[1] + n_bytes % _MIB
    return jnp.stack([mib + rest // _MIB, rest % _MIB])


def _counters(loads: jax.Array, read: jax.Array | None) -> dict[str, jax.Array]:
    """The `with_stats` dict: expert reads executed and, where known, the bytes they read."""
    return {"expert_loads": loads} if read is None else {"expert_loads": loads, "expert_bytes": read}


def read_bytes(stats: dict[str, Any]) -> int:
    """The expert weight bytes a `routed_experts(..., with_stats=True)` call read, as a Python int."""
    mib, rest = (int(v) for v in np.asarray(stats["expert_bytes"]))
    return mib * _MIB + rest


def _per_token(u, sel, experts: ExpertWeights, row_kernel: str):
    """Reference: one (row, rank) pair at a time, in (i, j) order; returns (Y [N, k, D], counters)."""
    n, k = sel.shape
    d = u.shape[1]
    flat = sel.reshape(n * k).astype(jnp.int32)
    rows = 1 if row_kernel == "gemv" else 2
    per_read = _expert_bytes(experts)

    def step(carry, t):
        loads, read = carry
        x = jax.lax.dynamic_index_in_dim(u, t // k, keepdims=True)  # [1, D]
        if rows == 2:
            x = jnp.concatenate([x, jnp.zeros_like(x)])  # pad: every product has M >= 2
        mats, orders = _load_expert(experts, flat[t])
        y = expert_ffn(x, *mats, orders)
        return (loads + 1, _add_bytes(read, per_read)), y[0]

    (loads, read), ys = jax.lax.scan(step, (jnp.int32(0), _no_bytes(per_read)), jnp.arange(n * k, dtype=jnp.int32))
    return ys.reshape(n, k, d), _counters(loads, read)


def _grouped(u, sel, experts: ExpertWeights, tiles: tuple[int, ...]):
    """Visit each used expert once; apply it to its bucket in tiles; returns (Y [N, k, D], counters).

    A bucket of c rows is cut into chunks; each chunk takes the smallest tile in `tiles` that holds
    the rest of the bucket (or the largest tile) and writes a full tile back. The rows a tile writes
    past its bucket belong to the next used expert's bucket, which is visited later (ascending
    order) and overwrites them, or to the padding past the end: so no mask is needed.
    """
    n, k = sel.shape
    d = u.shape[1]
    t = n * k
    r_max = max(tiles)
    tile_sizes = jnp.asarray(tiles, jnp.int32)
    b = bucket(sel, experts.n_expert)
    # Sorted activations, padded by one tile so a tile never reads or writes past the end (a
    # dynamic_slice would clamp its start and shift the rows).
    xs = jnp.concatenate([u[b.token], jnp.zeros((r_max, d), u.dtype)])
    ys = jnp.zeros((t + r_max, d), jnp.float32)
    per_read = _expert_bytes(experts)

    def per_expert(ui, carry):
        ys, loads, read = carry
        e = b.used[ui]
        mats, orders = _load_expert(experts, e)  # read + dequantized once per batch

        def tile_fn(r):
            def apply(ys, off):
                y = expert_ffn(jax.lax.dynamic_slice_in_dim(xs, off, r), *mats, orders)
                return jax.lax.dynamic_update_slice_in_dim(ys, y, off, axis=0)
            return apply

        branches = [tile_fn(r) for r in tiles]

        def chunk(c):
            ys, off, rest = c
            which = jnp.minimum(jnp.sum(tile_sizes < rest), len(tiles) - 1)
            ys = jax.lax.switch(which, branches, ys, off) if len(tiles) > 1 else branches[0](ys, off)
            step = tile_sizes[which]
            return ys, off + step, rest - step

        ys, _, _ = jax.lax.while_loop(lambda c: c[2] > 0, chunk, (ys, b.starts[e], b.counts[e]))
        return ys, loads + 1, _add_bytes(read, per_read)

    ys, loads, read = jax.lax.fori_loop(0, b.n_used, per_expert, (ys, jnp.int32(0), _no_bytes(per_read)))
    return ys[b.inv_order].reshape(n, k, d), _counters(loads, read)


def expert_rows(u: jax.Array, sel: jax.Array, experts, mode: str = "grouped", row_kernel: str = "gemm",
                row_tile: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The unreduced expert outputs Y [N, k, D] (Y[i, j] = expert_{sel[i, j]}(u[i])) and the read
    counters (`with_stats`), as `routed_experts` computes them in the XLA modes ("per_token" | "grouped").

    `experts` is an `ExpertWeights` or anything with its `n_expert`, `input_orders` and
    `dequant_expert` (e.g. two stacks read as one, for expert residency)."""
    if mode == "per_token":
        return _per_token(u, sel, experts, row_kernel)
    tiles = (1,) if row_kernel == "gemv" else row_tiles(sel.shape[0], row_tile)
    if row_kernel == "gemm" and min(tiles) < 2:
        raise InputError("row_kernel='gemm' needs row_tile >= 2 (M = 1 is a different kernel)")
    return _grouped(u, sel, experts, tiles)


# ----------------------------------------------------------------------------- pallas path


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["gate", "up", "down"],
    meta_fields=["gate_qtype", "up_qtype", "down_qtype", "bytes_per_expert"],
)
@dataclasses.dataclass(frozen=True)
class PackedExpertWeights:
    """Expert weights in the kernels' struct-of-arrays layout (`pallas_kernels.quant_blocks`).

    Pack once at load time (`pack_expert_weights`): packing reads every expert. `bytes_per_expert`
    is the GGUF storage size (the kernel layout holds Q4_K's 6-bit scales unpacked: 148 B per 256
    weights instead of 144).
    """

    gate: dict[str, jax.Array]
    up: dict[str, jax.Array]
    down: dict[str, jax.Array]
    gate_qtype: str
    up_qtype: str
    down_qtype: str
    bytes_per_expert: int

    @property
    def n_expert(self) -> int:
        return next(iter(self.gate.values())).shape[0]


def pack_expert_weights(experts: ExpertWeights) -> PackedExpertWeights:
    """ExpertWeights (`pallas_kernels.KERNEL_TYPES`; either layout) -> the kernel layout (`quant_blocks.pack`)."""
    f, d = experts.d_ff, experts.d_model
    for q in (experts.gate_qtype, experts.up_qtype, experts.down_qtype):
        if q not in gm.WEIGHT_FIELDS:
            raise UnsupportedQuantError(
                f"the grouped-matmul kernel reads {'/'.join(gm.WEIGHT_FIELDS)} experts, not {q}")

    def pack(m, qtype, n_cols):
        if isinstance(m, dict):  # SoA layout
            return qb.soa_to_kernel(m, qtype)
        return qb.pack(m, qtype, n_cols)

    return PackedExpertWeights(
        pack(experts.gate, experts.gate_qtype, d),
        pack(experts.up, experts.up_qtype, d),
        pack(experts.down, experts.down_qtype, f),
        experts.gate_qtype,
        experts.up_qtype,
        experts.down_qtype,
        experts.bytes_per_expert,
    )


def _pallas(u, sel, packed: PackedExpertWeights, block_m: int, block_n: int, interpret: bool):
    n, k = sel.shape
    d = u.shape[1]
    flat = sel.reshape(n * k).astype(jnp.int32)
    layout = gm.group_layout(flat, packed.n_expert, block_m)
    x = gm.scatter_rows(u[jnp.arange(n * k) // k], layout)
    mm = functools.partial(gm.grouped_matmul, block_m=block_m, block_n=block_n, interpret=interpret)
    g = mm(x, packed.gate, layout.tile_group, qtype=packed.gate_qtype)
    up = mm(x, packed.up, layout.tile_group, qtype=packed.up_qtype)
    y = mm(jax.nn.silu(g) * up, packed.down, layout.tile_group, qtype=packed.down_qtype)
    # Each used row tile reads its expert's three matrices once (its programs cover every output
    # column; unused tiles read nothing): one load per unique expert as long as no bucket exceeds
    # block_m rows (verify batches), more for heavily shared experts in a prefill.
    loads = (layout.tile_group >= 0).sum().astype(jnp.int32)
    per_read = _expert_bytes((packed.gate, packed.up, packed.down))
    read = jax.lax.fori_loop(0, loads, lambda _, c: _add_bytes(c, per_read), _no_bytes(per_read))
    return gm.gather_rows(y, layout).reshape(n, k, d), _counters(loads, read)


# ----------------------------------------------------------------------------- public entry


@functools.partial(
    jax.jit,
    static_argnames=("mode", "row_kernel", "row_tile", "block_m", "block_n", "interpret", "with_stats"),
)
def routed_experts(
    u: jax.Array,
    sel: jax.Array,
    w: jax.Array,
    experts: ExpertWeights | PackedExpertWeights,
    mode: str = "grouped",
    *,
    row_kernel: str = "gemm",
    row_tile: int | None = None,
    block_m: int = 16,
    block_n: int = 64,
    interpret: bool | None = None,
    with_stats: bool = False,
) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
    """Routed-expert output: sum_j w[i, j] * expert_{sel[i, j]}(u[i]), rank order, no shared expert.

    u: float32[N, D] post-attention-normed activations; sel: int32[N, k] top-k ids in rank order;
    w: float32[N, k] renormalised routing weights. Returns float32[N, D] (and, with `with_stats`,
    {"expert_loads": int32[], "expert_bytes": int32[2]}: the expert weight reads actually executed,
    and the bytes they read, each read adding the storage bytes of the expert slices it takes, as
    (MiB, bytes below a MiB): `read_bytes(stats)` gives the Python int).

    mode "per_token" | "grouped" | "pallas"; row_kernel "gemm" | "gemv" (XLA modes; see module doc);
    row_tile: one fixed grouped-gemm tile (>= 2; default: a ladder sized to each bucket, see
    `row_tiles`); block_m/block_n: the Pallas kernel's row and column tiles; interpret: run the
    Pallas kernels in interpret mode (default: when the backend is CPU).
    """
    if mode not in MODES:
        raise InputError(f"mode must be one of {MODES}, got {mode!r}")
    if row_kernel not in ROW_KERNELS:
        raise InputError(f"row_kernel must be one of {ROW_KERNELS}, got {row_kernel!r}")
    if sel.ndim != 2:
        raise InputError(f"shapes: sel must be [N, k], got {sel.shape}")
    n, k = sel.shape
    if u.ndim != 2 or u.shape[0] != n or w.shape != (n, k):
        raise InputError(f"shapes: u {u.shape}, sel {sel.shape}, w {w.shape}")
    u = u.astype(jnp.float32)
    if mode == "pallas":
        if isinstance(experts, ExpertWeights):
            experts.validate()
            if u.shape[1] != experts.d_model:
                raise InputError(f"u has width {u.shape[1]}, experts have d_model {experts.d_model}")
            packed = pack_expert_weights(experts)
        elif isinstance(experts, PackedExpertWeights):
            packed = experts
        else:
            raise InputError(f"mode 'pallas' takes ExpertWeights or PackedExpertWeights, got {type(experts).__name__}")
        interpret = jax.default_backend() == "cpu" if interpret is None else interpret
        y, stats = _pallas(u, sel, packed, block_m, block_n, interpret)
        out = wr_kernel.weighted_reduce(y, w.astype(jnp.float32), interpret=interpret)
        return (out, stats) if with_stats else out
    else:
        if not isinstance(experts, ExpertWeights):
            raise InputError(f"mode {mode!r} takes ExpertWeights, got {type(experts).__name__}")
        experts.validate()
        if u.shape[1] != experts.d_model:
            raise InputError(f"u has width {u.shape[1]}, experts have d_model {experts.d_model}")
        y, stats = expert_rows(u, sel, experts, mode, row_kernel, row_tile)
    out = weighted_reduce(y, w.astype(jnp.float32))
    return (out, stats) if with_stats else out


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """How a model routes its experts: hashable, so it can sit in a frozen model config.

    Use one config for decode, verify and prefill: the bit parity between them holds within a row
    kernel family ("gemm" | "gemv" for the XLA modes, or "pallas"), not across families.
    """

    mode: str = "grouped"
    row_kernel: str = "gemm"
    row_tile: int | None = None
    block_m: int = 16
    block_n: int = 64
    interpret: bool | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise InputError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.row_kernel not in ROW_KERNELS:
            raise InputError(f"row_kernel must be one of {ROW_KERNELS}, got {self.row_kernel!r}")

    def __call__(self, u, sel, w, experts, *, with_stats: bool = False):
        """routed_experts(u, sel, w, experts) with this configuration."""
        return routed_experts(u, sel, w, experts, self.mode, row_kernel=self.row_kernel,
                              row_tile=self.row_tile, block_m=self.block_m, block_n=self.block_n,
                              interpret=self.interpret, with_stats=with_stats)


# ----------------------------------------------------------------------------- counters


def dispatch_counts(sel: jax.Array, n_expert: int) -> tuple[jax.Array, jax.Array]:
    """(unique experts int32[], rows per expert int32[E]) of a routing `sel` [N, k] (jittable)."""
    counts = jnp.bincount(sel.reshape(-1).astype(jnp.int32), length=n_expert).astype(jnp.int32)
    return (counts > 0).sum().astype(jnp.int32), counts


def dispatch_stats(sel: Any, n_expert: int, bytes_per_expert: int) -> dict[str, Any]:
    """Host-side counters of one batch's routing (exact Python ints; `sel` is fetched to the host).

    Returns tokens, top_k, pairs (N*k), unique_experts, rows_per_expert (np.int64[E]),
    max_rows_per_expert, bytes_per_token (per-token path: N*k expert reads), bytes_grouped (grouped
    path: one read per unique expert, the floor) and read_ratio (per-token / grouped).
    """
    sel = np.asarray(sel)
    n, k = sel.shape
    counts = np.bincount(sel.reshape(-1).astype(np.int64), minlength=n_expert)
    unique = int((counts > 0).sum())
    per_token = n * k * int(bytes_per_expert)
    grouped = unique * int(bytes_per_expert)
    return {
        "tokens": n,
        "top_k": k,
        "pairs": n * k,
        "unique_experts": unique,
        "rows_per_expert": counts,
        "max_rows_per_expert": int(counts.max(initial=0)),
        "bytes_per_token": per_token,
        "bytes_grouped": grouped,
        "read_ratio": per_token / grouped if grouped else float("nan"),
    }
