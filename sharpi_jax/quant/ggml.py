"""The "ggml" CPU backend: GGUF blocks multiplied by ggml's own kernels, inside jit through the XLA FFI.

The native extension `sharpi_jax.quant._ggml` (csrc/ggml_ops.cc, built by `pip install -e .`) quantizes
each activation row once with ggml's `from_float` for the weight type's `vec_dot_type` (Q8_K for
K-quants, Q8_0 for Q4_0 / Q8_0 / ..., f16 for F16, f32 for F32) and computes every output element with
the bits of ggml's `vec_dot` of that row with one weight row as stored in the file: the same arithmetic
as ggml's mul_mat wherever ggml computes a product by vec_dot. For Q4_K / Q5_K / Q6_K products of any
number of rows, Q8_0 products of two or more with AVX-512 and F32 products of two or more (rows of a
multiple of 32 values; `multirow_min_rows`), multi-row kernels (csrc/multirow*.cc) unpack (or load) each
weight chunk once for a group of up to 4 rows (AVX2; F32 3) or 8 rows (AVX-512 with VNNI, picked at run
time where the CPU has it) and repeat vec_dot's float operations in its order, so they give the same bits.
Output row m depends only on x[m] (row-stable: a row has the same bits for any batch size).

- `available()` / `unavailable_reason()`: whether the extension loaded (the reason names cause and fix).
- `serves(qtype)`: the ggml types this backend computes.
- `matmul(x, raw, qtype)`: x[M, K] @ W[N, K].T, W as GGUF bytes uint8[N, row_bytes]; one FFI call.
- `expert_rows(x, ids, gate, up, down, qtypes, mode)`: unreduced routed-expert outputs [N, k, D].
- `multirow(qtype)` / `set_multirow(on)`: whether that type's products run a multi-row kernel
  now; turning them off (same bits) is for timing the vec_dot path beside them.
- `multirow_isa()` / `set_multirow_isa(name)`: the kernels' instruction set (avx512 or avx2), and picking
  one (same bits) to time them side by side.
- `spin_us()` / `set_spin_us(us)`: how long the products' helper threads stay awake between products
  (0: XLA's pool runs the helpers' share instead; same bits).
- `gdn_supported(dk)`: whether the extension's native GDN step runs here (`sharpi_jax.model.gdn_native`).
- `host_matmul` / `host_expert_rows`: the same computations on numpy arrays (no JAX, e.g. straight from
  the read-only mmap of a GGUF), same bits as the FFI ops.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from sharpi_jax.errors import InputError, SharpiError, UnsupportedQuantError

Q = GGMLQuantizationType
MODES = ("grouped", "per_token")

# Every type the project reads that ggml's CPU backend multiplies by vec_dot.
SERVED_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S,
    Q.TQ1_0, Q.TQ2_0,
})


class GgmlUnavailableError(SharpiError, RuntimeError):
    """The ggml backend was asked for but its native extension did not load."""


def _preload_libggml() -> None:
    """Load libggml's libraries process-wide, so the extension resolves them wherever it was built."""
    import libggml

    lib = os.path.join(os.path.dirname(libggml.__file__), "lib64")
    for name in ("libggml-base.so", "libggml-cpu.so"):
        ctypes.CDLL(os.path.join(lib, name), mode=ctypes.RTLD_GLOBAL)


def _import_extension():
    """The installed extension, or the build named by $SHARPI_GGML_EXTENSION (a path to a _ggml*.so: how
    the mutation check runs a mutated build of csrc/ beside the installed one)."""
    path = os.environ.get("SHARPI_GGML_EXTENSION")
    if not path:
        from sharpi_jax.quant import _ggml

        return _ggml
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("sharpi_jax.quant._ggml", path)
    if spec is None or not os.path.isfile(path):
        raise ImportError(f"SHARPI_GGML_EXTENSION={path} is not an extension module file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["sharpi_jax.quant._ggml"] = module
    return module


@functools.cache
def _load():
    """(extension module, None) or (None, one-line reason)."""
    try:
        _preload_libggml()
    except (ImportError, OSError) as e:
        return None, f"libggml-python missing or broken ({e}); fix: pip install libggml-python"
    try:
        _ggml = _import_extension()
    except ImportError as e:
        return None, f"native extension sharpi_jax.quant._ggml not built ({e}); fix: pip install -e ."
    for name, capsule in _ggml.ffi_targets().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    return _ggml, None


def available() -> bool:
    """Whether the native extension loaded (then every type in `SERVED_TYPES` is served)."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """None when available, else one line naming the cause and the fix."""
    return _load()[1]


def serves(qtype: int) -> bool:
    """Whether this backend computes weights of ggml type `qtype` (False when it is unavailable)."""
    return available() and int(qtype) in SERVED_TYPES


def multirow(qtype: int) -> bool:
    """Whether products of `qtype` with `multirow_min_rows(qtype, k)` or more rows run a multi-row kernel now
    (AVX2 CPU, enabled)."""
    return available() and bool(_ext().multirow(int(qtype)))


def gdn_supported(dk: int) -> bool:
    """Whether the extension's native GDN step (csrc/gdn.h, `sharpi_jax.model.gdn_native`) runs on this CPU
    for heads of dk values (AVX2 / FMA, dk a multiple of 8); False when the extension is unavailable."""
    return available() and bool(_ext().gdn_supported(int(dk)))


def spin_us() -> int:
    """How long the products' idle helper threads spin (microseconds) before they sleep (csrc/spin_pool.h):
    a product's helper then starts within a microsecond instead of the tens of microseconds XLA's pool
    takes. 0: products hand their work to XLA's pool. Default 200, or SHARPI_GGML_SPIN_US."""
    return int(_ext().spin_us())


def set_spin_us(us: int) -> None:
    """Sets `spin_us` (0 turns the helpers off); never changes a bit (row-stable kernels)."""
    _ext().set_spin_us(int(us))


def spin_tasks_run() -> int:
    """Parallel-loop tasks the helper threads have run in this process (whether products reach them)."""
    return int(_ext().spin_tasks_run())


def multirow_min_rows(qtype: int, k: int) -> int:
    """Rows from which products of `qtype` rows of k values use its kernel (fewer: ggml's vec_dot per
    element): 1 for the K-quants (their one-row form prefetches the weight stream, 1.25-2.1x vec_dot on an
    Intel Xeon's streamed matrices, even on Zen 4), 2 for Q8_0 (AVX-512 only; at one row the prefetched
    vec_dot is faster) and for F32 rows of a multiple of 32 values (other F32 rows: never). Same bits either
    way."""
    return int(_ext().multirow_min_rows(int(qtype), int(k)))


def multirow_unavailable_reason() -> str | None:
    """None when the multi-row kernels run, else one line saying why not (products stay exact, slower)."""
    if not available():
        return unavailable_reason()
    if _ext().multirow(int(Q.Q4_K)):
        return None
    if os.environ.get("SHARPI_GGML_MULTIROW") == "0":
        return "multi-row kernels off (SHARPI_GGML_MULTIROW=0): products of several rows run one vec_dot per element"
    return ("multi-row kernels need an x86 CPU with AVX2, FMA and F16C: products of several rows run one ggml "
            "vec_dot per element (same bits, slower verify and prefill)")


def multirow_isa() -> str:
    """The instruction set of the multi-row kernels now: "avx512" (AVX-512 F / BW / VL with VNNI), "avx2",
    or "" (none on this CPU). Both give the same bits (ggml's vec_dot's)."""
    return str(_ext().multirow_isa()) if available() else ""


def set_multirow_isa(name: str) -> bool:
    """Picks the multi-row kernels' instruction set: "avx512", "avx2" or "best" (the default: the best this
    CPU runs; the environment variable SHARPI_GGML_ISA=avx2 starts a process on AVX2). False, and nothing
    changed, when this CPU cannot run the set named. For measuring the sets side by side: same bits."""
    if name not in ("avx512", "avx2", "best"):
        raise InputError(f"multi-row instruction set is avx512, avx2 or best, got {name!r}")
    return available() and bool(_ext().set_multirow_isa(name))


def set_multirow(on: bool) -> None:
    """Multi-row kernels on (the default) or off: every element by ggml's vec_dot, the same bits.

    For measuring the two paths side by side; the environment variable SHARPI_GGML_MULTIROW=0 starts a
    process with them off."""
    _ext().set_multirow(bool(on))


def _ext():
    ext, reason = _load()
    if ext is None:
        raise GgmlUnavailableError(f"kernels='ggml' unavailable: {reason}")
    return ext


def _check_rows(qtype: int, k: int, row_bytes: int, what: str) -> None:
    if int(qtype) not in SERVED_TYPES:
        raise UnsupportedQuantError(f"{what}: ggml backend does not serve type {Q(int(qtype)).name}")
    err = _ext().check_rows(int(qtype), int(k), int(row_bytes))
    if err:
        raise InputError(f"{what}: {err}")


def matmul(x: jax.Array, raw: jax.Array, qtype: int, rows: jax.Array | int | None = None) -> jax.Array:
    """f32[..., N] = x[..., K] @ W.T, W the GGUF blocks uint8[N, row_bytes] of type `qtype` (jittable).

    rows (int32 scalar, may be traced; x 2-D): multiply only x rows [0, rows), the output rows after them
    are +0.0 (bucket padding costs nothing). Computed rows have the same bits for any `rows`."""
    if raw.ndim != 2 or raw.dtype != jnp.uint8:
        raise InputError(f"ggml matmul: weights must be uint8[N, row_bytes], got {raw.dtype}{list(raw.shape)}")
    k = x.shape[-1]
    _check_rows(qtype, k, raw.shape[1], "ggml matmul")
    lead = x.shape[:-1]
    x2 = jnp.asarray(x, jnp.float32).reshape(-1, k)
    if rows is not None and len(lead) != 1:
        raise InputError(f"ggml matmul: rows= needs x [M, K], got {list(x.shape)}")
    rows = jnp.asarray(x2.shape[0] if rows is None else rows, jnp.int32)
    return _matmul_op(int(qtype))(x2, raw, rows).reshape(*lead, raw.shape[0])


def _matmul_call(x2, raw, rows, qtype: int):
    return jax.ffi.ffi_call("sharpi_ggml_matmul", jax.ShapeDtypeStruct((x2.shape[0], raw.shape[0]), jnp.float32),
                            vmap_method="sequential")(x2, raw, rows, qtype=np.int32(qtype))


def _matmul_rows_call(x2, raw, idx, n, qtype: int):
    return jax.ffi.ffi_call("sharpi_ggml_matmul_rows",
                            jax.ShapeDtypeStruct((x2.shape[0], raw.shape[0]), jnp.float32),
                            vmap_method="sequential")(x2, raw, idx, n, qtype=np.int32(qtype))


def _bcast(a, batched: bool, n: int):
    return a if batched else jnp.broadcast_to(a[None], (n,) + a.shape)


@functools.cache
def _matmul_op(qtype: int):
    """The FFI product x2 [M, K] @ W.T (rows [0, rows) computed), batched as ONE call: under jax.vmap (a
    batch of sequences, `runtime.batch`) every sequence's valid rows join one product, so the weights
    are read once for the batch; rows are independent bit for bit, so each sequence's output equals its
    own call's. The call takes the valid rows' indices and multiplies them where they sit (no gather of
    x, no zeroed output scattered into: on the LM head those were ~10 ms of a 4-sequence step)."""
    op = jax.custom_batching.custom_vmap(functools.partial(_matmul_call, qtype=qtype))

    @op.def_vmap
    def rule(axis_size, in_batched, x2, raw, rows):
        x_b, raw_b, rows_b = in_batched
        if raw_b:  # per-sequence weights (not a shared model): one call each
            rows = _bcast(rows, rows_b, axis_size)
            x2 = _bcast(x2, x_b, axis_size)
            return jax.lax.map(lambda a: op(*a), (x2, raw, rows)), True
        x2, rows = _bcast(x2, x_b, axis_size), _bcast(rows, rows_b, axis_size)
        B, M, K = x2.shape
        valid = (jnp.arange(M, dtype=jnp.int32)[None, :] < rows[:, None]).reshape(B * M)
        # The valid rows' indices first, in order: the call computes just them; the rest come back +0.0.
        order = jnp.argsort(~valid, stable=True).astype(jnp.int32)
        y = _matmul_rows_call(x2.reshape(B * M, K), raw, order, jnp.sum(valid, dtype=jnp.int32), qtype)
        return y.reshape(B, M, raw.shape[0]), True

    return op


def _expert_args(x_shape, ids_shape, gate_shape, up_shape, down_shape, qtypes: Sequence[int], mode: str):
    if mode not in MODES:
        raise InputError(f"ggml expert_rows: mode must be one of {MODES}, got {mode!r}")
    if len(qtypes) != 3:
        raise InputError(f"ggml expert_rows: qtypes must be (gate, up, down), got {qtypes!r}")
    (n, d), (n2, _) = x_shape, ids_shape
    e, f = gate_shape[:2]
    if n2 != n or tuple(up_shape[:2]) != (e, f) or tuple(down_shape[:2]) != (e, d):
        raise InputError(f"ggml expert_rows: x {list(x_shape)}, ids {list(ids_shape)}, gate {list(gate_shape)}, "
                         f"up {list(up_shape)}, down {list(down_shape)} disagree (want x [N, D], ids [N, k], "
                         "gate / up [E, F, bytes], down [E, D, bytes])")
    for what, qt, k, rb in (("gate", qtypes[0], d, gate_shape[2]), ("up", qtypes[1], d, up_shape[2]),
                            ("down", qtypes[2], f, down_shape[2])):
        _check_rows(qt, k, rb, f"ggml expert_rows ({what})")
    return dict(gate_type=np.int32(int(qtypes[0])), up_type=np.int32(int(qtypes[1])),
                down_type=np.int32(int(qtypes[2])), mode=np.int32(MODES.index(mode)))


def expert_rows(x: jax.Array, ids: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                qtypes: Sequence[int], mode: str = "grouped") -> jax.Array:
    """Unreduced routed-expert outputs f32[N, k, D] (jittable, one FFI call).

    Y[i, j] = down_e(silu(gate_e(x_i)) * up_e(x_i)) with e = ids[i, j]; gate / up uint8[E, F, row_bytes],
    down uint8[E, D, row_bytes] as GGUF blocks of types `qtypes` = (gate, up, down). "grouped" reads each
    used expert once for all its rows, "per_token" computes the (i, j) pairs one by one; both give the
    same bits (same row kernels, same SiLU). An expert id outside [0, E) fails the call.
    """
    attrs = _expert_args(x.shape, ids.shape, gate.shape, up.shape, down.shape, qtypes, mode)
    return _expert_op(tuple(sorted(attrs.items())))(jnp.asarray(x, jnp.float32), jnp.asarray(ids, jnp.int32),
                                                    gate, up, down)


def _expert_call(x, ids, gate, up, down, attrs):
    n, k = ids.shape
    return jax.ffi.ffi_call("sharpi_ggml_expert_rows", jax.ShapeDtypeStruct((n, k, x.shape[1]), jnp.float32),
                            vmap_method="sequential")(x, ids, gate, up, down, **dict(attrs))


@functools.cache
def _expert_op(attrs: tuple):
    """`expert_rows` as one FFI call, batched as ONE call too: under jax.vmap every sequence's rows join
    one grouped product (each used expert read once for the whole batch); rows are independent bit for
    bit, so each sequence's output equals its own call's."""
    op = jax.custom_batching.custom_vmap(functools.partial(_expert_call, attrs=attrs))

    @op.def_vmap
    def rule(axis_size, in_batched, x, ids, gate, up, down):
        x, ids = _bcast(x, in_batched[0], axis_size), _bcast(ids, in_batched[1], axis_size)
        if any(in_batched[2:]):  # per-sequence weights: one call each
            w = [_bcast(a, b, axis_size) for a, b in zip((gate, up, down), in_batched[2:])]
            return jax.lax.map(lambda a: op(*a), (x, ids, *w)), True
        B, N, D = x.shape
        y = op(x.reshape(B * N, D), ids.reshape(B * N, ids.shape[-1]), gate, up, down)
        return y.reshape(B, N, ids.shape[-1], D), True

    return op


def expert_reads(ids: jax.Array, n_experts: int, mode: str = "grouped") -> jax.Array:
    """Expert reads `expert_rows` executes for `ids` (grouped: distinct experts; per_token: N * k)."""
    if mode == "per_token":
        return jnp.asarray(ids.size, jnp.int32)
    used = jnp.zeros((n_experts,), jnp.bool_).at[ids.reshape(-1)].set(True)
    return used.sum(dtype=jnp.int32)


def expert_bytes(gate: jax.Array, up: jax.Array, down: jax.Array) -> int:
    """Bytes one expert read costs (its gate, up and down blocks)."""
    return int(np.prod(gate.shape[1:]) + np.prod(up.shape[1:]) + np.prod(down.shape[1:]))


def host_matmul(x: np.ndarray, raw: np.ndarray, qtype: int, threads: int = 1) -> np.ndarray:
    """`matmul` on host arrays (no JAX); `raw` may be a read-only mmap view. Same bits as `matmul`."""
    ext = _ext()
    x = np.ascontiguousarray(x, np.float32)
    raw = np.ascontiguousarray(raw)
    _check_rows(qtype, x.shape[-1], raw.shape[1], "ggml host_matmul")
    x2 = x.reshape(-1, x.shape[-1])
    y = np.empty((x2.shape[0], raw.shape[0]), np.float32)
    ext.matmul(x2, raw, int(qtype), y, threads)
    return y.reshape(*x.shape[:-1], raw.shape[0])


def host_expert_rows(x: np.ndarray, ids: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                     qtypes: Sequence[int], mode: str = "grouped", threads: int = 1) -> np.ndarray:
    """`expert_rows` on host arrays (no JAX, no float copy of the weights). Same bits as `expert_rows`."""
    ext = _ext()
    x = np.ascontiguousarray(x, np.float32)
    ids = np.ascontiguousarray(ids, np.int32)
    gate, up, down = (np.ascontiguousarray(a) for a in (gate, up, down))
    attrs = _expert_args(x.shape, ids.shape, gate.shape, up.shape, down.shape, qtypes, mode)
    y = np.empty((ids.shape[0], ids.shape[1], x.shape[1]), np.float32)
    try:
        ext.expert_rows(x, ids, gate, up, down, *(int(v) for v in attrs.values()), y, threads)
    except ValueError as e:  # an expert id out of range
        raise InputError(str(e)) from None
    return y


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u with the expert op's own SiLU (host)."""
    g, u = np.ascontiguousarray(g, np.float32), np.ascontiguousarray(u, np.float32)
    h = np.empty_like(g)
    _ext().silu_mul(g, u, h)
    return h
