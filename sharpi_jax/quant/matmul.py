"""One matmul over QTensors, dispatched through the kernel-backend registry; `MatrixFormat`, how a
loader holds every matrix (and every routed-expert stack) for a backend.

`matmul(x, w)` computes `x @ W.T` for activations x float32 [M, K] and a QTensor W of logical shape
[N, K] (a GGUF matrix: one row per output), returning float32 [M, N], by the backend that laid W out
(`QTensor.kernels`). Backends (`sharpi_jax.quant.backends`, one module each):

| kernels     | float (F32/F16/BF16)             | quantized blocks                                      |
|-------------|----------------------------------|-------------------------------------------------------|
| "ggml"      | ggml vec_dot on the file's bytes | ggml from_float + vec_dot on the file's blocks, one   |
|             | (BF16/F16: activations rounded)  | FFI call per product (any M row-stable); others: xla  |
| "reference" | f32 dot on the exact values      | dequantize exactly in the step, f32 dot               |
| "xla"       | f32 dot (BF16: bf16 x bf16 -> f32)| SoA (Q8_0/Q4_K) or blocks, dequantized in the step;  |
|             |                                  | repack="int8"/"auto": int8 rows, two-plane int8 dot   |
| "pallas"    | Triton kernel (F32/F16)          | Triton kernel, in-kernel dequant (Q8_0, Q4_K, Q5_K, Q6_K); |
|             |                                  | others: the reference (`MatrixFormat.why_not` says why) |

"auto" is the highest-ranked available backend for the platform: "pallas" on a GPU, "ggml" on CPU where
its native extension loaded, else "xla".
On CPU the Pallas kernel runs in interpret mode (tests).

Bit parity between a row computed alone and in a batch (what batched verify == sequential decode
rests on): the float paths need M >= 2 rows (XLA:CPU lowers M = 1 to a different kernel; callers pad a
single row to two); the int8 path is exact integer arithmetic followed by elementwise scaling, so any
M gives the same bits per row; the Pallas kernel's per-row reduction order depends only on K.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from sharpi_jax.errors import InputError
from sharpi_jax.quant import registry
from sharpi_jax.quant.backends.reference import reference_matmul
from sharpi_jax.quant.qtensor import QTensor, abstract, pack, pack_rows

__all__ = ["MatrixFormat", "matmul", "reference_matmul", "weight_layout"]


@dataclasses.dataclass(frozen=True)
class MatrixFormat:
    """How a loader holds model matrices: the resolved kernel backend and an explicit repacking.

    A matrix or expert stack whose type the backend does not serve is held by its fallback backend
    (`registry.serving`); the three matrices of one layer's routed experts share one backend."""

    backend: str = "xla"
    repack: str | None = "auto"

    def __post_init__(self):
        registry.check_repack(self.backend, self.repack)

    @classmethod
    def for_run(cls, run: Any) -> "MatrixFormat":
        """A run's format (a `RunConfig`): its kernels resolved for the platform ("auto": the best-ranked
        backend there, `registry.resolve_kernels`) and its repacking. The one place a run's format is made."""
        return cls(registry.resolve_kernels(run.kernels), run.repack)

    def backend_for(self, qtype: int, shape: tuple[int, ...]) -> str:
        """The backend that holds and computes a tensor of this type and shape."""
        return registry.serving(self.backend, qtype, shape).name

    def why_not(self, qtype: int, shape: tuple[int, ...]) -> str | None:
        """None when the selected backend holds this tensor itself; else why it falls back, in words."""
        return registry.get(self.backend).why_not(qtype, shape)

    def layout(self, qtype: int, shape: tuple[int, ...]) -> str:
        """The layout of a [rows, cols] matrix (or an [E, rows, cols] expert stack)."""
        b = registry.serving(self.backend, qtype, shape)
        return b.layout(qtype, shape, self.repack if self.repack in b.repacks else None)

    def _layout(self, backend: str | None, qtype: int, shape: tuple[int, ...]) -> tuple[str, str]:
        b = registry.get(backend or self.backend_for(qtype, shape))
        return b.name, b.layout(qtype, shape, self.repack if self.repack in b.repacks else None)

    def pack(self, raw, qtype: int, shape: tuple[int, ...], backend: str | None = None) -> QTensor:
        """GGUF bytes uint8 [..., rows, row_bytes] -> a QTensor laid out for `backend` (default: the
        one `backend_for` names), jittable."""
        name, layout = self._layout(backend, qtype, shape)
        return pack(raw, qtype, shape, layout, name)

    def abstract(self, qtype: int, shape: tuple[int, ...], backend: str | None = None) -> QTensor:
        """`pack`'s result as ShapeDtypeStructs (nothing read or allocated)."""
        name, layout = self._layout(backend, qtype, shape)
        return abstract(qtype, shape, layout, name)

    def pack_rows(self, raw, qtype: int, cols: int) -> QTensor:
        """Host GGUF rows uint8 [rows, row_bytes] -> a device QTensor [rows, cols] (`qtensor.pack_rows`)."""
        shape = (raw.shape[0], cols)
        b = self.backend_for(qtype, shape)
        return pack_rows(raw, qtype, cols, self.layout(qtype, shape), b)

    def experts_backend(self, qtypes: tuple[int, ...], shapes: tuple[tuple[int, ...], ...]) -> str:
        """The backend of one layer's routed-expert stacks (gate, up, down): the first in this format's
        fallback chain that serves all three (one grouped op computes them together)."""
        b = registry.get(self.backend)
        seen = [b.name]
        while not all(b.serves(q, s) for q, s in zip(qtypes, shapes)):
            if b.fallback is None or b.fallback in seen:
                raise InputError(f"no kernel backend in {seen} serves expert types {tuple(qtypes)}")
            b = registry.get(b.fallback)
            seen.append(b.name)
        return b.name


def weight_layout(backend: str, qtype: int, shape: tuple[int, ...], repack: str | None = None) -> str:
    """The layout a [N, K] matrix of ggml type `qtype` is held in for `backend` (resolved, not "auto")."""
    return MatrixFormat(registry.get(backend).name, repack).layout(qtype, shape)


def matmul(x: jax.Array, w: QTensor, *, rows: jax.Array | int | None = None, interpret: bool | None = None
           ) -> jax.Array:
    """x float32 [M, K] @ W.T for W a QTensor [N, K] -> float32 [M, N] (jittable), by W's backend.
    rows (int32 scalar, may be traced): only x rows [0, rows) are needed (bucket padding after them); a
    backend may skip the rest (ggml returns +0.0 there), the needed rows' bits do not depend on it.
    interpret: run a Pallas kernel in interpret mode (default: on CPU)."""
    if x.ndim != 2 or len(w.shape) != 2 or x.shape[1] != w.cols:
        raise InputError(f"matmul: x {tuple(x.shape)} and weight {w.shape} do not contract")
    options = {} if interpret is None else {"interpret": interpret}
    if rows is not None:
        options["rows"] = rows
    return registry.get(w.kernels).matmul(x.astype(jnp.float32), w, **options)
