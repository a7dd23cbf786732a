"""`QTensor`: a weight matrix in (a form of) its GGUF encoding, with its ggml type and logical shape.

A QTensor is a pytree: its arrays (`data`) are leaves; ggml type, logical shape and layout are static.
The logical shape is numpy order (GGUF `ne` reversed): `[..., rows, cols]`, the last axis being the one
a matmul contracts (a GGUF row). Layouts, all holding the file's values:

- "float":  {"w": [..., rows, cols]} in the file's float dtype (f32, f16 or bf16), exact.
- "float_t": {"w": [..., cols, rows]}: a float matrix stored transposed, for `x @ w` on XLA:CPU (about
           1.6x faster than contracting the last axes for decode-sized x). Exact.
- "blocks": {"raw": uint8[..., rows, row_bytes]}: the GGUF bytes as they are (any supported type).
- "soa":    Q8_0 / Q4_K split into one array per block field (same bytes; XLA:CPU dequantizes it ~8x
           faster than interleaved blocks): {"d", "qs"} or {"d", "dmin", "scales", "qs"}.
- "kernel": the Pallas grouped-matmul layout (`pallas_kernels.quant_blocks.pack`: one array per block
           field; bytes per 256 weights Q8_0 272, Q4_K 148, Q5_K 180, Q6_K 210 (GGUF: 272 / 144 / 176 /
           210); float types as f32 {"w"}); a [rows, cols] matrix's rows zero-padded to a multiple of
           KERNEL_ROWS (a router of n_expert + 1 rows, fused projections) so that every N tiles (expert
           stacks are not padded); `dequantize` drops the padding.
- "int8":   {"q": int8[..., rows, cols], "s": float32[..., rows, 1]}: an explicit, lossy repacking for
           XLA:CPU integer dots (the exact dequantized row re-quantized with one scale per row,
           |error| <= s/2 = max|row|/254). Memory: 1 byte per weight + 4 per row.

`dequantize()` is exact for every layout but "int8" (there it returns the repacked values).

`backend` (static) names the kernel backend that laid the tensor out and computes its products
(`sharpi_jax.quant.registry`); None: the default owner of its layout (`DEFAULT_BACKEND`).
A leading axis is allowed: routed experts are stacks [E, rows, cols] (`take(e)` is expert e's matrix).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from sharpi_jax.pallas_kernels import KERNEL_TYPES as PALLAS_KERNEL_TYPES
from sharpi_jax.pallas_kernels import quant_blocks as qb
from sharpi_jax.errors import UnsupportedQuantError
from sharpi_jax.gguf import quants as formats
from sharpi_jax.quant import hostmem

Q = GGMLQuantizationType
LAYOUTS = ("float", "float_t", "blocks", "soa", "kernel", "int8")
FLOAT_TYPES = {Q.F32: jnp.float32, Q.F16: jnp.float16, Q.BF16: jnp.bfloat16}
SOA_TYPES = {Q.Q8_0: "q8_0", Q.Q4_K: "q4_k"}  # the SoA / kernel layouts exist for these block types
KERNEL_TYPES = {Q[name.upper()]: name for name in PALLAS_KERNEL_TYPES}  # the "kernel" layout's types
KERNEL_ROWS = 16  # "kernel" layout rows are padded to a multiple of this (the kernel's smallest column tile)
# The backend that computes a QTensor built without one (`QTensor.backend` None), by layout.
DEFAULT_BACKEND = {"float": "reference", "float_t": "xla", "blocks": "reference", "soa": "xla",
                   "kernel": "pallas", "int8": "xla"}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data"],
                   meta_fields=["qtype", "shape", "layout", "backend"])
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A weight tensor in a storage layout (see module doc). `shape` is the logical numpy shape."""

    data: dict[str, Any]
    qtype: int
    shape: tuple[int, ...]
    layout: str
    backend: str | None = None

    @property
    def kernels(self) -> str:
        """The backend computing this tensor: `backend`, or its layout's default owner."""
        return self.backend or DEFAULT_BACKEND[self.layout]

    @property
    def ggml_type(self) -> GGMLQuantizationType:
        return Q(self.qtype)

    @property
    def rows(self) -> int:
        return self.shape[-2]

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes actually held (the memory this tensor costs)."""
        return int(sum(np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize
                       for a in jax.tree.leaves(self.data)))

    @property
    def gguf_nbytes(self) -> int:
        """Bytes of the same tensor in the GGUF file (what one full read of it costs on disk)."""
        return gguf_nbytes(self.qtype, self.shape)

    def dequantize(self) -> jax.Array:
        """float32 values of logical `shape` (jittable). Exact except for the lossy "int8" layout."""
        return dequantize_data(self.data, self.qtype, self.shape, self.layout)

    def take(self, index: jax.Array) -> "QTensor":
        """Sub-tensor(s) along the first axis (an embedding row gather, or one expert's matrix)."""
        if self.layout == "float_t":
            raise ValueError("take() on a transposed float tensor")
        if np.ndim(index) == 0 and not isinstance(index, (int, np.integer)):  # a traced expert id
            data = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), self.data)
        else:
            data = jax.tree.map(lambda a: a[index], self.data)
        lead = tuple(np.shape(index))
        return QTensor(data, self.qtype, lead + tuple(self.shape[1:]), self.layout, self.backend)

    def with_lead(self, n: int) -> "QTensor":
        """The same arrays with a leading (expert) axis of `n` (a shard's view of a sharded stack)."""
        return QTensor(self.data, self.qtype, (int(n),) + tuple(self.shape[1:]), self.layout, self.backend)


def gguf_nbytes(qtype: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of logical `shape` in ggml type `qtype`."""
    bs, ts = GGML_QUANT_SIZES[Q(qtype)]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // bs) * ts


def abstract(qtype: int, shape: tuple[int, ...], layout: str, backend: str | None = None) -> QTensor:
    """A QTensor of ShapeDtypeStructs: the skeleton a loader fills (no allocation)."""
    raw = jax.ShapeDtypeStruct(formats.byte_shape(qtype, shape), jnp.uint8)
    return jax.eval_shape(lambda r: pack(r, qtype, shape, layout, backend), raw)


def zeros(qtype: int, shape: tuple[int, ...], layout: str, backend: str | None = None) -> QTensor:
    """A zero-filled QTensor of that storage (a module's initial value before a loader fills it)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract(qtype, shape, layout, backend))


def check_layout(qtype: int, layout: str, name: str = "") -> None:
    """Raises UnsupportedQuantError when `layout` cannot hold ggml type `qtype`."""
    qt = Q(qtype)
    ok = {
        "float": qt in FLOAT_TYPES, "float_t": qt in FLOAT_TYPES, "blocks": qt in formats.SUPPORTED_TYPES,
        "soa": qt in SOA_TYPES, "kernel": qt in KERNEL_TYPES, "int8": qt in formats.SUPPORTED_TYPES,
    }
    if layout not in ok:
        raise ValueError(f"unknown QTensor layout {layout!r} (one of {LAYOUTS})")
    if not ok[layout]:
        where = f"{name}: " if name else ""
        raise UnsupportedQuantError(f"{where}ggml type {qt.name} has no {layout!r} layout")


def pack(raw: jax.Array, qtype: int, shape: tuple[int, ...], layout: str, backend: str | None = None) -> QTensor:
    """GGUF bytes (uint8[..., rows, row_bytes], any leading dims) -> a QTensor in `layout` (jittable)."""
    return dataclasses.replace(_pack(raw, qtype, shape, layout), backend=backend)


def _pack(raw: jax.Array, qtype: int, shape: tuple[int, ...], layout: str) -> QTensor:
    check_layout(qtype, layout)
    qt = Q(qtype)
    shape = tuple(int(s) for s in shape)
    if layout == "blocks" and isinstance(raw, np.ndarray):  # host bytes held as they are: on huge pages
        return QTensor({"raw": hostmem.device_bytes(raw.reshape(formats.byte_shape(qt, shape)))}, qtype, shape, layout)
    raw = jnp.asarray(raw).reshape(formats.byte_shape(qt, shape))
    if layout in ("float", "float_t"):
        w = jax.lax.bitcast_convert_type(raw.reshape(*shape, -1), FLOAT_TYPES[qt])
        return QTensor({"w": jnp.swapaxes(w, -1, -2) if layout == "float_t" else w}, qtype, shape, layout)
    if layout == "blocks":
        return QTensor({"raw": raw}, qtype, shape, layout)
    if layout == "soa":
        return QTensor(qb.to_soa(raw, SOA_TYPES[qt], shape[-1]), qtype, shape, layout)
    if layout == "kernel":
        pad = -shape[-2] % KERNEL_ROWS if len(shape) == 2 else 0  # zero rows: zero weights in every type
        raw = jnp.pad(raw, [(0, 0)] * (raw.ndim - 2) + [(0, pad), (0, 0)]) if pad else raw
        padded = (*shape[:-2], shape[-2] + pad, shape[-1])
        return QTensor(qb.pack(_kernel_input(raw, qt, padded), KERNEL_TYPES[qt], shape[-1]), qtype, shape, layout)
    w = _dequantize_blocks(raw, qt, shape)  # "int8"
    return QTensor(requantize_int8(w), qtype, shape, layout)


def _kernel_input(raw, qt, shape):
    if qt in FLOAT_TYPES:  # qb.pack takes float rows for float types
        return jax.lax.bitcast_convert_type(raw.reshape(*shape, -1), FLOAT_TYPES[qt])
    return raw


def requantize_int8(w: jax.Array) -> dict[str, jax.Array]:
    """float32 [..., rows, cols] -> {"q": int8, "s": float32 [..., rows, 1]}: s = max|row| / 127,
    q = round(w / s). A zero row gets s = 0 and q = 0."""
    amax = jnp.max(jnp.abs(w), axis=-1, keepdims=True)
    s = amax / jnp.float32(127.0)
    inv = jnp.where(amax > 0, jnp.float32(127.0) / jnp.where(amax > 0, amax, 1.0), 0.0)
    q = jnp.clip(jnp.round(w * inv), -127, 127).astype(jnp.int8)
    return {"q": q, "s": s}


def _dequantize_blocks(raw: jax.Array, qt: GGMLQuantizationType, shape: tuple[int, ...]) -> jax.Array:
    bs, ts = GGML_QUANT_SIZES[qt]
    lead = raw.shape[:-1]
    blocks = raw.reshape(*lead, shape[-1] // bs, ts)
    return formats.dequantize_blocks(blocks, qt).reshape(shape)


def dequantize_data(data: dict[str, Any], qtype: int, shape: tuple[int, ...], layout: str) -> jax.Array:
    """float32 values of a QTensor's arrays (see `QTensor.dequantize`)."""
    qt = Q(qtype)
    if layout == "float":
        return data["w"].astype(jnp.float32)
    if layout == "float_t":
        return jnp.swapaxes(data["w"], -1, -2).astype(jnp.float32)
    if layout == "blocks":
        return _dequantize_blocks(data["raw"], qt, shape)
    if layout == "soa":
        return qb.dequantize_soa(data, SOA_TYPES[qt])
    if layout == "kernel":
        return qb.dequantize_packed(data, KERNEL_TYPES[qt])[..., :shape[-2], :]
    if layout == "int8":
        return data["q"].astype(jnp.float32) * data["s"]
    raise ValueError(f"unknown QTensor layout {layout!r}")


CHUNK_VALUES = 1 << 22  # "int8" repacking dequantizes in row chunks of this many values (bounded memory)


@functools.partial(jax.jit, static_argnames=("qtype", "cols"))
def _int8_chunk(raw: jax.Array, qtype: int, cols: int) -> dict[str, jax.Array]:
    return requantize_int8(_dequantize_blocks(raw, Q(qtype), (raw.shape[0], cols)))


def pack_rows(raw: np.ndarray, qtype: int, cols: int, layout: str, backend: str | None = None) -> QTensor:
    """Host GGUF rows uint8 [rows, row_bytes] (e.g. a zero-copy mmap view) -> a device QTensor
    [rows, cols] in `layout`. The "int8" repacking runs in fixed-size row chunks (one compile, peak
    memory one chunk of float32) instead of dequantizing the whole matrix at once."""
    rows = raw.shape[0]
    if layout == "blocks":
        return pack(np.asarray(raw), int(qtype), (rows, cols), layout, backend)
    if layout != "int8" or rows * cols <= CHUNK_VALUES:
        return jax.jit(pack, static_argnames=("qtype", "shape", "layout", "backend"))(
            jnp.asarray(raw), qtype=int(qtype), shape=(rows, cols), layout=layout, backend=backend)
    check_layout(qtype, layout)
    step = max(1, CHUNK_VALUES // cols)
    q = np.empty((rows, cols), np.int8)
    s = np.empty((rows, 1), np.float32)
    buf = np.zeros((step, raw.shape[1]), np.uint8)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        buf[:n] = raw[r0:r0 + n]
        out = _int8_chunk(buf, qtype=int(qtype), cols=cols)
        q[r0:r0 + n] = np.asarray(out["q"])[:n]
        s[r0:r0 + n] = np.asarray(out["s"])[:n]
    return QTensor({"q": jnp.asarray(q), "s": jnp.asarray(s)}, int(qtype), (rows, cols), "int8", backend)
