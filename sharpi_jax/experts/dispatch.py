"""Token -> expert dispatch for the routed experts of a MoE layer (grouped: each used expert is read
once per batch).

`routed_experts(u, sel, w, experts, mode=...)` computes, for every row i,

    routed[i] = sum_j w[i, j] * W_down[e] (silu(W_gate[e] u_i) * W_up[e] u_i),   e = sel[i, j]

summed in rank order j = 0..k-1 (the shared expert is the caller's). `experts` is (gate, up, down):
QTensor stacks [E, rows, cols] laid out once at load for one kernel backend (`sharpi_jax.quant`), which
supplies the computation (`quant.registry.Backend`). Two modes:

- "per_token": the reference loop, one (row, rank) pair at a time: N*k expert reads.
- "grouped": a backend's own grouped op where it has one (`Backend.expert_rows`; "pallas": rows
  bucketed into `block_m`-aligned tiles, the grouped-matmul kernel and the Pallas weighted reduce,
  Triton on GPU, interpret mode on CPU), else the composed loop: bucket the N*k pairs by expert
  (stable sort, group sizes, inverse permutation), visit each used expert once (a loop over the used
  experts only), load its three matrices once (`Backend.expert_weight`: "xla" / "reference"
  dequantize them) and apply them to its rows in row tiles sized to the bucket (`row_tiles`,
  `Backend.expert_matmul`): |unique(sel)| expert reads. This is the CPU fast path.

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
shapes, for decode and verify alike. (The parity facts above are the "xla" / "reference" backends'
composed loops, whose products are float32 dots of dequantized matrices.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.pallas_kernels.weighted_reduce import reference as wr_reference
from sharpi_jax import config, quant
from sharpi_jax.errors import InputError
from sharpi_jax.quant import QTensor

MODES = config.EXPERT_MODES  # ("grouped", "per_token")
ROW_KERNELS = config.ROW_KERNELS  # ("gemm", "gemv")

__all__ = [
    "Buckets",
    "DispatchConfig",
    "MODES",
    "ROW_KERNELS",
    "StackView",
    "bucket",
    "check_experts",
    "row_tiles",
    "dispatch_counts",
    "dispatch_stats",
    "expert_ffn",
    "expert_rows",
    "experts_backend",
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


def check_experts(experts: Any, d_model: int | None = None) -> tuple[QTensor, QTensor, QTensor]:
    """(gate [E, F, D], up [E, F, D], down [E, D, F]) QTensor stacks, checked (InputError otherwise;
    shapes only, so it works on tracers)."""
    if not (isinstance(experts, (tuple, list)) and len(experts) == 3 and all(isinstance(m, QTensor) for m in experts)):
        raise InputError(f"experts must be (gate, up, down) QTensor stacks, got {type(experts).__name__}")
    gate, up, down = experts
    if len(gate.shape) != 3 or len(down.shape) != 3:
        raise InputError(f"expert stacks must be [E, rows, cols], got gate {gate.shape}, down {down.shape}")
    e, f, d = gate.shape
    for name, m, want in (("up", up, (e, f, d)), ("down", down, (e, d, f))):
        if tuple(m.shape) != want:
            raise InputError(f"expert {name}: shape {m.shape}, want {want} (gate is {gate.shape})")
    if d_model is not None and d_model != d:
        raise InputError(f"u has width {d_model}, experts have d_model {d}")
    return gate, up, down


def experts_backend(experts: tuple[QTensor, QTensor, QTensor]) -> quant.Backend:
    """The kernel backend of a layer's expert stacks (one for all three: `MatrixFormat.experts_backend`)."""
    names = {m.kernels for m in experts}
    if len(names) != 1:
        raise InputError(f"the expert stacks of one layer need one kernel backend, got {sorted(names)}")
    return quant.get(names.pop())


class StackView:
    """What the composed loops read from expert stacks: `n_expert`, `load(e)` (expert e's three matrices
    as its backend's `expert_weight` gives them, read once per batch), `ffn(x, loaded)` (the unweighted
    SwiGLU expert by the backend's `expert_ffn`) and `bytes_per_read` (None: not known)."""

    def __init__(self, experts: tuple[QTensor, QTensor, QTensor]):
        self.experts = experts
        self.backend = experts_backend(experts)
        self.n_expert = experts[0].shape[0]
        self.bytes_per_read = _expert_bytes(experts)

    def load(self, e: jax.Array):
        return tuple(self.backend.expert_weight(m, e) for m in self.experts)

    def ffn(self, x: jax.Array, loaded) -> jax.Array:
        return self.backend.expert_ffn(x, loaded, self.experts)


def _rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [R, in] @ w[out, in].T -> [R, out], contracting the last dims (no transpose copy)."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))


def expert_ffn(x: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array) -> jax.Array:
    """Unweighted SwiGLU expert on rows x [R, D] with float matrices: W_down (silu(W_gate x) * W_up x)."""
    h = jax.nn.silu(_rows_matmul(x, wg)) * _rows_matmul(x, wu)
    return _rows_matmul(h, wd)


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


def _per_token(u, sel, view, row_kernel: str):
    """Reference: one (row, rank) pair at a time, in (i, j) order; returns (Y [N, k, D], counters)."""
    n, k = sel.shape
    d = u.shape[1]
    flat = sel.reshape(n * k).astype(jnp.int32)
    rows = 1 if row_kernel == "gemv" else 2
    per_read = view.bytes_per_read

    def step(carry, t):
        loads, read = carry
        x = jax.lax.dynamic_index_in_dim(u, t // k, keepdims=True)  # [1, D]
        if rows == 2:
            x = jnp.concatenate([x, jnp.zeros_like(x)])  # pad: every product has M >= 2
        y = view.ffn(x, view.load(flat[t]))
        return (loads + 1, _add_bytes(read, per_read)), y[0]

    (loads, read), ys = jax.lax.scan(step, (jnp.int32(0), _no_bytes(per_read)), jnp.arange(n * k, dtype=jnp.int32))
    return ys.reshape(n, k, d), _counters(loads, read)


def _grouped(u, sel, view, tiles: tuple[int, ...]):
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
    b = bucket(sel, view.n_expert)
    # Sorted activations, padded by one tile so a tile never reads or writes past the end (a
    # dynamic_slice would clamp its start and shift the rows).
    xs = jnp.concatenate([u[b.token], jnp.zeros((r_max, d), u.dtype)])
    ys = jnp.zeros((t + r_max, d), jnp.float32)
    per_read = view.bytes_per_read

    def per_expert(ui, carry):
        ys, loads, read = carry
        e = b.used[ui]
        mats = view.load(e)  # read (and, for a dequantizing backend, dequantized) once per batch

        def tile_fn(r):
            def apply(ys, off):
                y = view.ffn(jax.lax.dynamic_slice_in_dim(xs, off, r), mats)
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
                row_tile: int | None = None, options: quant.ExpertOptions | None = None,
                valid: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The unreduced expert outputs Y [N, k, D] (Y[i, j] = expert_{sel[i, j]}(u[i])) and the read
    counters (`with_stats`), as `routed_experts` computes them.

    `experts`: (gate, up, down) QTensor stacks, or a view with `StackView`'s interface (e.g. two stacks
    read as one, for expert residency). "grouped" on stacks whose backend has its own grouped op
    (`Backend.expert_rows`) runs that op; otherwise the composed loops run on the backend's hooks.
    valid (bool [N]): rows with valid False are bucket padding; a backend's grouped op may skip them."""
    if mode not in MODES:
        raise InputError(f"mode must be one of {MODES}, got {mode!r}")
    options = options or quant.ExpertOptions(row_kernel=row_kernel, row_tile=row_tile)
    if isinstance(experts, (tuple, list)):
        experts = check_experts(experts)
        backend = experts_backend(experts)
        if mode == "grouped" and backend.expert_rows is not None:
            y, loads = backend.expert_rows(u, sel, experts, options, valid=valid)
            per_read = _expert_bytes(experts)
            read = jax.lax.fori_loop(0, loads, lambda _, c: _add_bytes(c, per_read), _no_bytes(per_read))
            return y, _counters(loads, read)
        experts = StackView(experts)
    if mode == "per_token":
        return _per_token(u, sel, experts, row_kernel)
    tiles = (1,) if row_kernel == "gemv" else row_tiles(sel.shape[0], row_tile)
    if row_kernel == "gemm" and min(tiles) < 2:
        raise InputError("row_kernel='gemm' needs row_tile >= 2 (M = 1 is a different kernel)")
    return _grouped(u, sel, experts, tiles)


# ----------------------------------------------------------------------------- public entry


@functools.partial(
    jax.jit,
    static_argnames=("mode", "row_kernel", "row_tile", "block_m", "block_n", "interpret", "with_stats"),
)
def routed_experts(
    u: jax.Array,
    sel: jax.Array,
    w: jax.Array,
    experts: tuple[QTensor, QTensor, QTensor],
    mode: str = "grouped",
    *,
    row_kernel: str = "gemm",
    row_tile: int | None = None,
    block_m: int = 16,
    block_n: int = 64,
    interpret: bool | None = None,
    with_stats: bool = False,
    valid: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
    """Routed-expert output: sum_j w[i, j] * expert_{sel[i, j]}(u[i]), rank order, no shared expert.

    u: float32[N, D] post-attention-normed activations; sel: int32[N, k] top-k ids in rank order;
    w: float32[N, k] renormalised routing weights; experts: (gate [E, F, D], up [E, F, D], down
    [E, D, F]) QTensor stacks of one kernel backend (`quant.MatrixFormat.pack`, laid out once at load).
    Returns float32[N, D] (and, with `with_stats`, {"expert_loads": int32[], "expert_bytes": int32[2]}:
    the expert weight reads actually executed, and the bytes they read, each read adding the bytes its
    backend holds per expert (the GGUF storage bytes; the Pallas kernel layout: 148 B per 256 Q4_K
    weights), as (MiB, bytes below a MiB): `read_bytes(stats)` gives the Python int).

    mode "per_token" | "grouped"; row_kernel "gemm" | "gemv" (the composed loops; see module doc);
    row_tile: one fixed grouped-gemm tile (>= 2; default: a ladder sized to each bucket, see
    `row_tiles`); block_m/block_n: the Pallas kernel's row and column tiles; interpret: run the
    Pallas kernels in interpret mode (default: when the backend is CPU). valid (bool [N]): rows with
    valid False are bucket padding (already carrying zero weights); a backend's grouped op may skip
    them (ggml does).
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
    experts = check_experts(experts, u.shape[1])
    backend = experts_backend(experts)
    options = quant.ExpertOptions(row_kernel, row_tile, block_m, block_n, interpret)
    y, stats = expert_rows(u.astype(jnp.float32), sel, experts, mode, row_kernel, row_tile, options, valid)
    out = backend.weighted_reduce(y, w.astype(jnp.float32), options)
    return (out, stats) if with_stats else out


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """How a model routes its experts: hashable, so it can sit in a frozen model config.

    Use one config for decode, verify and prefill: the bit parity between them holds within a row
    kernel family ("gemm" | "gemv" for the composed loops, or a backend's own grouped op), not across.
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
