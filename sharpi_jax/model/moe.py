"""MoE FFN (spec 3.4): softmax router in f32, top-k, renormalised weights, routed + sigmoid-gated shared.

Routed experts stay in their GGUF block format and are dequantized inside the jitted step by
`sharpi_jax.experts.dispatch.routed_experts` (only the experts a batch selected). Q8_0 / Q4_K experts
are stored in the dispatch module's struct-of-arrays layout (the same bytes split per field, converted
once at load; XLA:CPU dequantizes it several times faster); F32 / F16 experts as float arrays; every
other type as raw GGUF rows. The dense qwen35 FFN is `layers.SwiGLU`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pallas_kernels import quant_blocks as qb
from sharpi_jax.config import ModelConfig
from sharpi_jax.experts.dispatch import ExpertWeights, routed_experts
from sharpi_jax.gguf.quants import dequantize_blocks
from sharpi_jax.model.layers import Linear, SwiGLU

WEIGHT_SUM_CLAMP = 6.103515625e-5  # ggml's clamp of the top-k weight sum
EXPERT_MODES = ("grouped", "per_token")  # bitwise equal per row; grouped reads each expert once
# "pallas" (kernels="pallas"): the Pallas grouped-matmul + weighted-reduce kernels (in-kernel dequant of
# F32/F16/Q8_0/Q4_K); a layer whose experts have another ggml type keeps "grouped".
PALLAS_EXPERT_TYPES = ("f32", "f16", "q8_0", "q4_k")


class QuantBlocks(nnx.Variable):
    """Weights kept in (a form of) their GGUF storage: raw block rows, SoA fields or float experts."""


def blocks_shape(shape: tuple[int, ...], qtype: int) -> tuple[int, ...]:
    """uint8 shape holding a tensor of numpy `shape` in ggml type `qtype`."""
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    return (*shape[:-1], shape[-1] // bs * ts)


def dequantize_rows(raw: jax.Array, qtype: int, n_cols: int) -> jax.Array:
    """uint8 [..., row_bytes] -> float32 [..., n_cols]; exact (bitwise gguf.quants)."""
    qt = GGMLQuantizationType(qtype)
    bs, ts = GGML_QUANT_SIZES[qt]
    lead = raw.shape[:-1]
    return dequantize_blocks(raw.reshape(*lead, n_cols // bs, ts), qt).reshape(*lead, n_cols)


def qtype_name(qtype: int) -> str:
    """The dispatch module's qtype spelling ("q4_k", "f32", ...)."""
    return GGMLQuantizationType(qtype).name.lower()


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


class RoutedExperts(nnx.Module):
    """One layer's routed experts: gate/up [E, F, D] and down [E, D, F] in storage form + static qtypes."""

    def __init__(self, n_expert: int, d_model: int, d_ff: int, qtypes: tuple[int, int, int]):
        self.n_expert, self.d_model, self.d_ff = n_expert, d_model, d_ff
        self.qtypes = tuple(int(q) for q in qtypes)  # (gate, up, down), ggml type ids
        E, D, F = n_expert, d_model, d_ff
        self.gate = storage_variables(expert_storage((E, F, D), self.qtypes[0]))
        self.up = storage_variables(expert_storage((E, F, D), self.qtypes[1]))
        self.down = storage_variables(expert_storage((E, D, F), self.qtypes[2]))

    def weights(self) -> ExpertWeights:
        """The dispatch module's view of these experts (no copy)."""
        names = [qtype_name(q) for q in self.qtypes]
        layout = "soa" if any(n in qb.QUANTIZED for n in names) else "gguf"
        mats = (storage_values(self.gate), storage_values(self.up), storage_values(self.down))
        return ExpertWeights(*mats, *names, layout)


def route(router_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """softmax over all experts (f32), top-k, weights renormalised with ggml's clamp -> (sel, w)."""
    p = jax.nn.softmax(router_logits, axis=-1)
    w, sel = jax.lax.top_k(p, k)
    w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), jnp.float32(WEIGHT_SUM_CLAMP))
    return sel.astype(jnp.int32), w


class MoE(nnx.Module):
    """Routed experts + sigmoid-gated shared expert. The router and the shared-expert gate vector are
    fused into one [D, E+1] f32 matrix (one row-stable matmul instead of a matmul and a matvec)."""

    def __init__(self, c: ModelConfig, expert_qtypes: tuple[int, int, int], expert_mode: str = "grouped",
                 experts: nnx.Module | None = None):
        """experts: a replacement for the routed experts (`residency.ResidentExperts`), or None."""
        if expert_mode not in (*EXPERT_MODES, "pallas"):
            raise ValueError(f"expert_mode must be one of {EXPERT_MODES} or 'pallas', got {expert_mode!r}")
        if expert_mode == "pallas" and any(qtype_name(q) not in PALLAS_EXPERT_TYPES for q in expert_qtypes):
            expert_mode = "grouped"
        self.n_expert, self.k, self.expert_mode = c.n_expert, c.n_expert_used, expert_mode
        self.has_shared = c.shared_expert_ff > 0
        self.router = Linear(c.d_model, c.n_expert + (1 if self.has_shared else 0))
        self.experts = experts if experts is not None else RoutedExperts(c.n_expert, c.d_model, c.expert_ff,
                                                                          expert_qtypes)
        self.shared = SwiGLU(c.d_model, c.shared_expert_ff) if self.has_shared else None

    def __call__(self, u: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """u [N, D] normed rows; rows with valid False (bucket padding) are routed like row 0 with
        zero weights, so they add no expert reads. Rows are independent bit for bit."""
        r = self.router(u)
        sel, w = route(r[:, : self.n_expert], self.k)
        if valid is not None:
            sel = jnp.where(valid[:, None], sel, sel[:1])
            w = jnp.where(valid[:, None], w, 0.0)
        if getattr(self.experts, "resident", False):  # residency: slot stack + LUT, same bits
            out = self.experts(u, sel, w, valid, self.expert_mode)
        else:
            out = routed_experts(u, sel, w, self.experts.weights(), mode=self.expert_mode)
        if self.has_shared:
            out = out + jax.nn.sigmoid(r[:, self.n_expert:]) * self.shared(u)
        return out
