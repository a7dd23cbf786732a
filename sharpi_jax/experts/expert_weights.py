"""Routed-expert weights of one MoE layer: float or raw GGUF blocks, and their dequantization.

Layouts (numpy / PyTorch `[out, in]` per expert; GGUF `ffn_gate_exps {D, F, E}` viewed as numpy):

    gate, up: [E, F, D]        down: [E, D, F]

Float weights are float32 (or float16) arrays of exactly these shapes. Quantized weights keep the GGUF
bytes: `uint8[E, F, D / block * type_size]` for gate/up and `uint8[E, D, F / block * type_size]` for
down, with one qtype per matrix (a Q4_K_M file mixes Q4_K gate/up with a Q6_K/Q5_K down).

GGUF-layout blocks of every type dequantize through the one block dequantizer,
`sharpi_jax.gguf.quants` (bitwise equal to gguf-py); the SoA layout's own Q8_0 / Q4_K dequantization
(`pallas_kernels.quant_blocks`) is tested bitwise against it.

Layout "gguf" keeps the file's interleaved blocks; layout "soa" (`ExpertWeights.to_soa()`, once at
load time) splits Q8_0/Q4_K blocks into one array per field: the same bytes, but XLA:CPU vectorizes
the dequantization (~8x faster measured here). Both give bit-identical results.

Storage form (`expert_storage`): how a model holds an [E, rows, cols] expert matrix of a ggml type:
Q8_0 / Q4_K in the SoA layout, F32 / F16 as float arrays, every other type as raw GGUF rows (all
converted once at load by `to_expert_storage`); `ExpertWeights.from_storage` views such matrices.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import quant_blocks as qb
from sharpi_jax.errors import InputError
from sharpi_jax.model.layers import QuantBlocks, blocks_shape
from sharpi_jax.model.layers import dequantize_rows as dequantize_gguf_rows

FLOAT_QTYPES = ("f32", "f16")


def _gguf_type(qtype: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[qtype.upper()]


def block_geometry(qtype: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of a qtype name ("f32", "q8_0", "q4_k", "q6_k", ...)."""
    return tuple(gguf.GGML_QUANT_SIZES[_gguf_type(qtype)])


def row_bytes(qtype: str, n_cols: int) -> int:
    """Storage bytes of one row of `n_cols` weights."""
    block, size = block_geometry(qtype)
    if n_cols % block:
        raise InputError(f"{qtype}: row length {n_cols} is not a multiple of the block size {block}")
    return n_cols // block * size


def dequantize_rows(raw: jax.Array, qtype: str, n_cols: int) -> jax.Array:
    """Rows in storage format -> float32 `[..., n_cols]` (jittable, exact): float rows as they are,
    quantized GGUF rows through the one block dequantizer, `sharpi_jax.gguf.quants`."""
    if qtype in FLOAT_QTYPES:
        return raw.astype(jnp.float32)
    return dequantize_gguf_rows(raw, int(_gguf_type(qtype)), n_cols)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["gate", "up", "down"],
    meta_fields=["gate_qtype", "up_qtype", "down_qtype", "layout"],
)
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """The routed experts of one layer (a pytree: arrays are leaves, qtypes and layout are static).

    layout "gguf": gate, up: float32 `[E, F, D]` or GGUF bytes `uint8[E, F, row_bytes(D)]`;
    down: float32 `[E, D, F]` or GGUF bytes `uint8[E, D, row_bytes(F)]`.
    layout "soa": quantized matrices are dicts of per-field arrays with leading dims [E, rows]
    (`pallas_kernels.quant_blocks.to_soa`); float matrices stay arrays.
    """

    gate: Any
    up: Any
    down: Any
    gate_qtype: str = "f32"
    up_qtype: str = "f32"
    down_qtype: str = "f32"
    layout: str = "gguf"

    def _lead(self, m) -> tuple[int, ...]:
        return tuple((m["d"] if isinstance(m, dict) else m).shape[:2])

    @property
    def n_expert(self) -> int:
        return self._lead(self.gate)[0]

    @property
    def d_ff(self) -> int:
        return self._lead(self.gate)[1]

    @property
    def d_model(self) -> int:
        return self._lead(self.down)[1]

    @property
    def qtype(self) -> str:
        """The common qtype, or "gate/up/down" when the matrices differ."""
        qs = {self.gate_qtype, self.up_qtype, self.down_qtype}
        return self.gate_qtype if len(qs) == 1 else f"{self.gate_qtype}/{self.up_qtype}/{self.down_qtype}"

    @property
    def bytes_per_expert(self) -> int:
        """Storage bytes of one expert's three matrices (what one expert read costs)."""
        f, d = self.d_ff, self.d_model
        return (
            f * row_bytes(self.gate_qtype, d)
            + f * row_bytes(self.up_qtype, d)
            + d * row_bytes(self.down_qtype, f)
        )

    def validate(self) -> None:
        """Raises InputError when shapes and qtypes disagree (works on tracers: shapes only)."""
        if self.layout not in ("gguf", "soa"):
            raise InputError(f"layout must be 'gguf' or 'soa', got {self.layout!r}")
        e, f, d = self.n_expert, self.d_ff, self.d_model
        want = {
            "gate": (self.gate, self.gate_qtype, (e, f), d),
            "up": (self.up, self.up_qtype, (e, f), d),
            "down": (self.down, self.down_qtype, (e, d), f),
        }
        for name, (arr, qtype, lead, n_cols) in want.items():
            if self.layout == "soa" and qtype in qb.QUANTIZED:
                ref = jax.eval_shape(functools.partial(qb.to_soa, qtype=qtype, n_cols=n_cols),
                                     jax.ShapeDtypeStruct(lead + (row_bytes(qtype, n_cols),), jnp.uint8))
                got = {k: (v.shape, v.dtype) for k, v in arr.items()} if isinstance(arr, dict) else None
                if got != {k: (v.shape, v.dtype) for k, v in ref.items()}:
                    raise InputError(f"expert {name} ({qtype}, soa): got {got}, want {ref}")
                continue
            if qtype in FLOAT_QTYPES:
                shape, ok_dtype = lead + (n_cols,), jnp.issubdtype(arr.dtype, jnp.floating)
            else:
                shape, ok_dtype = lead + (row_bytes(qtype, n_cols),), arr.dtype == jnp.uint8
            if isinstance(arr, dict) or tuple(arr.shape) != shape or not ok_dtype:
                got = {k: v.shape for k, v in arr.items()} if isinstance(arr, dict) else f"{arr.dtype}{list(arr.shape)}"
                raise InputError(
                    f"expert {name} ({qtype}, {self.layout}): got {got}, want "
                    f"{'uint8' if qtype not in FLOAT_QTYPES else 'float'}{list(shape)}"
                )

    def _rows(self, m, qtype: str, n_cols: int, k_order: str = "natural") -> jax.Array:
        if isinstance(m, dict):
            return qb.dequantize_soa(m, qtype, k_order)
        if k_order == "storage" and qtype in qb.QUANTIZED:  # same values and order as the SoA path
            return qb.dequantize_soa(qb.to_soa(m, qtype, n_cols), qtype, k_order)
        return dequantize_rows(m, qtype, n_cols)

    @property
    def input_orders(self) -> tuple[str | None, str | None, str | None]:
        """Per matrix (gate, up, down): the qtype whose storage K order `dequant_expert(e,
        k_order="storage")` returns its columns in (pass inputs through
        `quant_blocks.storage_k_order`), or None when that order is the natural one."""
        return tuple(q if q == "q4_k" else None for q in (self.gate_qtype, self.up_qtype, self.down_qtype))

    def dequant_expert(self, e: jax.Array, k_order: str = "natural") -> tuple[jax.Array, jax.Array, jax.Array]:
        """float32 (gate [F, D], up [F, D], down [D, F]) of expert `e` (a traced int is fine).

        k_order "storage" (SoA layout): columns of Q4_K matrices come in storage order (see
        `input_orders`); it is the fast one for XLA:CPU.
        """
        f, d = self.d_ff, self.d_model
        take = lambda m: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, e, keepdims=False), m)  # noqa: E731
        return (self._rows(take(self.gate), self.gate_qtype, d, k_order),
                self._rows(take(self.up), self.up_qtype, d, k_order),
                self._rows(take(self.down), self.down_qtype, f, k_order))

    def to_soa(self) -> "ExpertWeights":
        """The same bytes in the SoA layout (do it once, at load: it reads every expert)."""
        if self.layout == "soa":
            return self
        f, d = self.d_ff, self.d_model
        conv = lambda m, q, n: qb.to_soa(m, q, n) if q in qb.QUANTIZED else m  # noqa: E731
        return ExpertWeights(conv(self.gate, self.gate_qtype, d), conv(self.up, self.up_qtype, d),
                             conv(self.down, self.down_qtype, f), self.gate_qtype, self.up_qtype,
                             self.down_qtype, "soa")

    def to_gguf(self) -> "ExpertWeights":
        """Back to the GGUF block layout."""
        if self.layout == "gguf":
            return self
        conv = lambda m, q: qb.soa_to_raw(m, q) if q in qb.QUANTIZED else m  # noqa: E731
        return ExpertWeights(conv(self.gate, self.gate_qtype), conv(self.up, self.up_qtype),
                             conv(self.down, self.down_qtype), self.gate_qtype, self.up_qtype,
                             self.down_qtype, "gguf")

    def dequantize(self) -> "ExpertWeights":
        """All experts as float32 (tests and oracles; costs E x the float size)."""
        f, d = self.d_ff, self.d_model
        return ExpertWeights(
            self._rows(self.gate, self.gate_qtype, d),
            self._rows(self.up, self.up_qtype, d),
            self._rows(self.down, self.down_qtype, f),
        )

    @classmethod
    def from_storage(cls, gate, up, down, qtypes: tuple[int, int, int]) -> "ExpertWeights":
        """A view of matrices in their storage form (`expert_storage`) with ggml type ids `qtypes`."""
        names = [qtype_name(q) for q in qtypes]
        layout = "soa" if any(n in qb.QUANTIZED for n in names) else "gguf"
        return cls(gate, up, down, *names, layout)

    @classmethod
    def from_float(cls, gate, up, down, qtype: str = "f32") -> "ExpertWeights":
        """Quantizes float weights on the host (Q8_0: gguf.quants; Q4_K: a simple quantizer)."""
        return cls(_quantize_np(gate, qtype), _quantize_np(up, qtype), _quantize_np(down, qtype),
                   qtype, qtype, qtype)

    @classmethod
    def random(cls, rng: np.random.Generator, n_expert: int, d_ff: int, d_model: int,
               qtype: str = "f32", scale: float | None = None) -> "ExpertWeights":
        """Synthetic experts: N(0, scale^2) floats (default 1/sqrt(fan_in)), quantized to `qtype`."""
        e, f, d = n_expert, d_ff, d_model

        def mat(shape, fan_in):
            s = scale if scale is not None else fan_in**-0.5
            return (rng.standard_normal(shape, dtype=np.float32) * s).astype(np.float32)

        if qtype in FLOAT_QTYPES:
            return cls.from_float(mat((e, f, d), d), mat((e, f, d), d), mat((e, d, f), f), qtype)
        # Quantize one expert at a time so the float copy never holds all E experts.
        parts = {"gate": [], "up": [], "down": []}
        for _ in range(e):
            parts["gate"].append(_quantize_np(mat((f, d), d), qtype))
            parts["up"].append(_quantize_np(mat((f, d), d), qtype))
            parts["down"].append(_quantize_np(mat((d, f), f), qtype))
        return cls(*(jnp.asarray(np.stack(parts[k])) for k in ("gate", "up", "down")), qtype, qtype, qtype)

    @classmethod
    def synthetic(cls, rng: np.random.Generator, n_expert: int, d_ff: int, d_model: int,
                  qtype: str = "q4_k") -> "ExpertWeights":
        """Fast synthetic experts for speed work: random valid blocks (finite scales) for quantized
        qtypes, N(0, 1/fan_in) floats otherwise. Never for correctness against real models."""
        if qtype in FLOAT_QTYPES:
            return cls.random(rng, n_expert, d_ff, d_model, qtype)
        e, f, d = n_expert, d_ff, d_model
        blocks = lambda shape: jnp.asarray(qb.random_blocks(rng, shape, qtype))  # noqa: E731
        return cls(blocks((e, f, d)), blocks((e, f, d)), blocks((e, d, f)), qtype, qtype, qtype)


def _quantize_np(x, qtype: str):
    x = np.asarray(x, np.float32)
    if qtype == "f32":
        return jnp.asarray(x)
    if qtype == "f16":
        return jnp.asarray(x.astype(np.float16))
    if qtype == "q4_k":
        return jnp.asarray(qb.quantize_q4_k_np(x))
    return jnp.asarray(gguf.quants.quantize(x, _gguf_type(qtype)))


# ----------------------------------------------------------------------------- storage form


def qtype_name(qtype: int) -> str:
    """The qtype spelling of this module ("q4_k", "f32", ...) of a ggml type id."""
    return gguf.GGMLQuantizationType(qtype).name.lower()


def expert_storage(shape: tuple[int, ...], qtype: int) -> jax.ShapeDtypeStruct | dict[str, jax.ShapeDtypeStruct]:
    """How one [E, rows, cols] expert matrix of ggml type `qtype` is held (shapes only)."""
    name = qtype_name(qtype)
    if name == "f32":
        return jax.ShapeDtypeStruct(shape, jnp.float32)
    if name == "f16":
        return jax.ShapeDtypeStruct(shape, jnp.float16)
    raw = jax.ShapeDtypeStruct(blocks_shape(shape, qtype), jnp.uint8)
    if name in qb.QUANTIZED:
        return jax.eval_shape(lambda r: qb.to_soa(r, name, shape[-1]), raw)
    return raw


def to_expert_storage(raw, shape: tuple[int, ...], qtype: int):
    """GGUF bytes of an expert matrix -> arrays laid out as `expert_storage` says."""
    name = qtype_name(qtype)
    raw = jnp.asarray(raw)
    if name in ("f32", "f16"):
        return jax.lax.bitcast_convert_type(raw.reshape(*shape, -1), jnp.dtype(name.replace("f", "float")))
    if name in qb.QUANTIZED:
        return qb.to_soa(raw, name, shape[-1])
    return raw


def storage_variables(spec, kind: type[nnx.Variable] = QuantBlocks):
    """Zero-filled `kind` variables shaped like `expert_storage` (one, or an nnx.Dict of SoA fields)."""
    if isinstance(spec, dict):
        return nnx.Dict({k: kind(jnp.zeros(s.shape, s.dtype)) for k, s in spec.items()})
    return kind(jnp.zeros(spec.shape, spec.dtype))


def storage_values(v):
    """The arrays held by `storage_variables` (a dict for SoA fields)."""
    if isinstance(v, nnx.Dict):
        return {k: x[...] for k, x in v.items()}
    return v[...]
