"""One matmul over QTensors, with backends (the tokamax shape: a reference and one file's worth per backend).

`matmul(x, w)` computes `x @ W.T` for activations x float32 [M, K] and a QTensor W of logical shape
[N, K] (a GGUF matrix: one row per output), returning float32 [M, N]. The computation follows the
tensor's layout, and the layout is chosen once at load by the kernel backend (`weight_layout`):

| kernels     | float (F32/F16/BF16)            | quantized blocks                                      |
|-------------|---------------------------------|-------------------------------------------------------|
| "reference" | f32 dot on the exact values      | dequantize exactly in the step, f32 dot               |
| "xla"       | f32 dot (BF16: bf16 x bf16 -> f32)| SoA (Q8_0/Q4_K) or blocks, dequantized in the step;  |
|             |                                  | repack="int8"/"auto": int8 rows, two-plane int8 dot   |
| "pallas"    | Triton kernel (F32/F16)          | Triton kernel, in-kernel dequant (Q8_0, Q4_K, Q5_K, Q6_K); |
|             |                                  | others: XLA dequantize + dot (`backend_used` says which) |

"auto" is "pallas" on a GPU and "xla" elsewhere. On CPU the Pallas kernel runs in interpret mode (tests).

Bit parity between a row computed alone and in a batch (what batched verify == sequential decode
rests on): the float paths need M >= 2 rows (XLA:CPU lowers M = 1 to a different kernel; callers pad a
single row to two); the int8 path is exact integer arithmetic followed by elementwise scaling, so any
M gives the same bits per row; the Pallas kernel's per-row reduction order depends only on K.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import grouped_matmul as gm
from sharpi_jax.config import KERNELS, REPACKS
from sharpi_jax.errors import InputError
from sharpi_jax.quant.backend_used import backend_used
from sharpi_jax.quant.backend_used import pallas_fits as pallas_fits  # noqa: F401 (re-exported)
from sharpi_jax.quant.qtensor import FLOAT_TYPES, KERNEL_TYPES, SOA_TYPES, QTensor, Q

BACKENDS = ("xla", "pallas", "reference")
PALLAS_BLOCK_M = 16
PALLAS_BLOCK_N = 64


def resolve_kernels(kernels: str, platform: str | None = None) -> str:
    """"auto" -> "pallas" on a GPU, "xla" elsewhere; other names are checked and returned."""
    if kernels not in KERNELS:
        raise InputError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels != "auto":
        return kernels
    platform = platform or jax.default_backend()
    return "pallas" if platform in ("gpu", "cuda", "rocm") else "xla"


def _block_n(n: int) -> int | None:
    for b in (PALLAS_BLOCK_N, 32, 16):
        if n % b == 0:
            return b
    return None


# repack="auto": int8 for quantized matrices of at least this many weights (an LM head, a 35B-A3B
# layer's attention / GDN projections) on XLA:CPU, where dequantizing them in every step would dominate
# decode; smaller matrices (and every matrix of a small model) keep their exact GGUF encoding.
INT8_AUTO_MIN_WEIGHTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class MatrixFormat:
    """How a loader holds model matrices: the resolved kernel backend and an explicit repacking."""

    backend: str = "xla"
    repack: str | None = "auto"

    def __post_init__(self):
        weight_layout(self.backend, 0, (1, 1), self.repack)  # validates the combination

    def layout(self, qtype: int, shape: tuple[int, ...]) -> str:
        return weight_layout(self.backend, qtype, shape, self.repack)


def weight_layout(backend: str, qtype: int, shape: tuple[int, ...], repack: str | None = None) -> str:
    """The layout a [N, K] matrix of ggml type `qtype` is held in for `backend` (resolved, not "auto").

    Without `repack` every matrix keeps its GGUF encoding ("soa" is the same bytes split per field).
    repack="int8" (backend "xla" only) re-quantizes quantized matrices to int8 with one scale per row:
    lossy (|error| <= max|row| / 254 per weight), 1 byte per weight, for XLA:CPU's integer dot.
    repack="auto": "int8" for quantized matrices of >= INT8_AUTO_MIN_WEIGHTS weights on "xla", no
    repacking otherwise (and on the other backends).
    """
    qt = Q(qtype)
    if backend not in BACKENDS:
        raise InputError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if repack not in REPACKS:
        raise InputError(f"repack must be one of {REPACKS}, got {repack!r}")
    if repack == "int8" and backend != "xla":
        raise InputError(f"repack={repack!r} is an XLA:CPU layout; it does not combine with kernels={backend!r}")
    if backend_used(backend, qtype, shape) == "pallas":
        return "kernel"
    if qt in FLOAT_TYPES:
        return "float_t"
    n_weights = shape[-2] * shape[-1]
    if backend == "xla" and (repack == "int8" or (repack == "auto" and n_weights >= INT8_AUTO_MIN_WEIGHTS)):
        return "int8"
    if backend == "xla" and qt in SOA_TYPES:
        return "soa"
    return "blocks"


def quantize_rows_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row symmetric int8 quantization: x [M, K] -> (q int8 [M, K], s float32 [M, 1]), x ~= q * s
    with |x - q * s| <= s / 2. Row-local, so row-stable."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    inv = jnp.where(amax > 0, jnp.float32(127.0) / jnp.where(amax > 0, amax, 1.0), 0.0)
    q = jnp.clip(jnp.round(x * inv), -127, 127).astype(jnp.int8)
    return q, amax / jnp.float32(127.0)


def _contract_last(x: jax.Array, w: jax.Array, out=None) -> jax.Array:
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=out)


def _matmul_int8(x: jax.Array, data) -> jax.Array:
    """Activations in two int8 planes (x ~= q1 * s1 + q2 * s2, q2 quantizing the residual: error <=
    max|row| / 64516), stacked as 2M rows of ONE integer dot so the weights are read once; exact int32
    accumulation (|acc| <= 127 * 127 * K < 2^31 for K < 133k), then elementwise float32 scaling. A
    single plane would round activations to 1/254 of their row maximum, which outlier channels of real
    hidden states make coarse; the second plane costs no extra weight traffic."""
    m = x.shape[0]
    q1, s1 = quantize_rows_int8(x)
    q2, s2 = quantize_rows_int8(x - q1.astype(jnp.float32) * s1)
    acc = _contract_last(jnp.concatenate([q1, q2]), data["q"], jnp.int32).astype(jnp.float32)
    sw = data["s"][:, 0][None, :]
    return acc[:m] * (s1 * sw) + acc[m:] * (s2 * sw)


def _matmul_kernel(x: jax.Array, w: QTensor, interpret: bool | None) -> jax.Array:
    m = x.shape[0]
    bm = PALLAS_BLOCK_M
    n_tiles = -(-m // bm)
    xp = jnp.zeros((n_tiles * bm, x.shape[1]), jnp.float32).at[:m].set(x)
    weights = jax.tree.map(lambda a: a[None], w.data)  # one group
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    n_held = next(iter(w.data.values())).shape[-2]  # rows padded to a multiple of 16 (qtensor.KERNEL_ROWS)
    y = gm.grouped_matmul(xp, weights, jnp.zeros((n_tiles,), jnp.int32), qtype=KERNEL_TYPES[Q(w.qtype)],
                          block_m=bm, block_n=_block_n(n_held), interpret=interpret)
    return y[:m, :w.rows]


def matmul(x: jax.Array, w: QTensor, *, interpret: bool | None = None) -> jax.Array:
    """x float32 [M, K] @ W.T for W a QTensor [N, K] -> float32 [M, N] (jittable; see module doc)."""
    if x.ndim != 2 or len(w.shape) != 2 or x.shape[1] != w.cols:
        raise InputError(f"matmul: x {tuple(x.shape)} and weight {w.shape} do not contract")
    x = x.astype(jnp.float32)
    layout = w.layout
    if layout == "float_t":
        wt = w.data["w"]
        if wt.dtype == jnp.float32:
            return x @ wt
        if wt.dtype == jnp.bfloat16:  # llama.cpp rounds activations to bf16 for BF16 weights too
            return jnp.dot(x.astype(jnp.bfloat16), wt, preferred_element_type=jnp.float32)
        return x @ wt.astype(jnp.float32)
    if layout == "int8":
        return _matmul_int8(x, w.data)
    if layout == "kernel":
        return _matmul_kernel(x, w, interpret)
    if layout in ("float", "blocks", "soa"):
        return _dequantize_matmul(x, w)
    raise ValueError(f"unknown QTensor layout {layout!r}")


DEQUANT_CHUNK_VALUES = 1 << 23  # dequantize at most this many weights at a time inside a step


def _n_chunks(n: int, k: int) -> int:
    """The fewest row chunks, dividing n evenly, of at most DEQUANT_CHUNK_VALUES weights each."""
    for c in range(max(1, -(-n * k // DEQUANT_CHUNK_VALUES)), n + 1):
        if n % c == 0:
            return c
    return n


def _dequantize_matmul(x: jax.Array, w: QTensor) -> jax.Array:
    """x @ dequantize(W).T. A large matrix (an LM head) is dequantized chunk by chunk of output rows
    inside a loop, so the step never holds its whole float32 copy (2 GB for a 248k x 2048 head)."""
    n, k = w.shape
    c = _n_chunks(n, k)
    if c == 1:
        return _contract_last(x, w.dequantize())
    chunks = jax.tree.map(lambda a: a.reshape(c, n // c, *a.shape[1:]), w.data)
    part = lambda d: _contract_last(x, QTensor(d, w.qtype, (n // c, k), w.layout).dequantize())  # noqa: E731
    y = jax.lax.map(part, chunks)  # [c, M, n // c]
    return jnp.moveaxis(y, 0, 1).reshape(x.shape[0], n)


def reference_matmul(x: jax.Array, w: QTensor) -> jax.Array:
    """The reference every backend is tested against: exact dequantization, float32 dot."""
    return _contract_last(x.astype(jnp.float32), w.dequantize())
