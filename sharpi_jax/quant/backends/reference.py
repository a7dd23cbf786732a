"""The "reference" backend, and the dequantize-then-dot computations other backends share.

Every matrix keeps its GGUF encoding ("blocks"; float types as "float_t", expert stacks as "float"),
is dequantized exactly inside the step and multiplied in float32: the reference every backend is
tested against. A large matrix (an LM head) is dequantized chunk by chunk of output rows, so a step
never holds its whole float32 copy. Routed experts: each used expert is dequantized once per batch
(Q8_0 / Q4_K in the SoA field order, whose K order XLA:CPU vectorizes best; the activations are
permuted to match) and applied to its rows by float32 dots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sharpi_jax.pallas_kernels import quant_blocks as qb
from sharpi_jax.gguf import quants as formats
from sharpi_jax.quant.qtensor import FLOAT_TYPES, SOA_TYPES, Q, QTensor
from sharpi_jax.quant.registry import Backend

DEQUANT_CHUNK_VALUES = 1 << 23  # dequantize at most this many weights at a time inside a step


def contract_last(x: jax.Array, w: jax.Array, out=None) -> jax.Array:
    """x [M, K] . w [N, K] over K -> [M, N] (no transpose copy)."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=out)


def float_t_matmul(x: jax.Array, w: QTensor) -> jax.Array:
    """x @ W.T for a "float_t" tensor (BF16: bf16 x bf16 -> f32, as llama.cpp rounds activations too)."""
    wt = w.data["w"]
    if wt.dtype == jnp.float32:
        return x @ wt
    if wt.dtype == jnp.bfloat16:
        return jnp.dot(x.astype(jnp.bfloat16), wt, preferred_element_type=jnp.float32)
    return x @ wt.astype(jnp.float32)


def _n_chunks(n: int, k: int) -> int:
    """The fewest row chunks, dividing n evenly, of at most DEQUANT_CHUNK_VALUES weights each."""
    for c in range(max(1, -(-n * k // DEQUANT_CHUNK_VALUES)), n + 1):
        if n % c == 0:
            return c
    return n


def dequantize_matmul(x: jax.Array, w: QTensor) -> jax.Array:
    """x @ dequantize(W).T, a large W chunk by chunk of output rows inside a loop."""
    n, k = w.shape
    c = _n_chunks(n, k)
    if c == 1:
        return contract_last(x, w.dequantize())
    chunks = jax.tree.map(lambda a: a.reshape(c, n // c, *a.shape[1:]), w.data)
    part = lambda d: contract_last(x, QTensor(d, w.qtype, (n // c, k), w.layout).dequantize())  # noqa: E731
    y = jax.lax.map(part, chunks)  # [c, M, n // c]
    return jnp.moveaxis(y, 0, 1).reshape(x.shape[0], n)


def reference_matmul(x: jax.Array, w: QTensor) -> jax.Array:
    """The reference every backend is tested against: exact dequantization, float32 dot."""
    return contract_last(x.astype(jnp.float32), w.dequantize())


def expert_input_order(w: QTensor) -> str | None:
    """The qtype name whose storage K order `dequantize_expert` returns w's columns in (None: natural)."""
    return "q4_k" if Q(w.qtype) == Q.Q4_K and w.layout in ("soa", "blocks") else None


def dequantize_expert(w: QTensor, e: jax.Array) -> jax.Array:
    """float32 [rows, cols] of expert e of a stack, columns in `expert_input_order` (exact values)."""
    we = w.take(e)
    qt = Q(w.qtype)
    if w.layout == "soa":
        return qb.dequantize_soa(we.data, SOA_TYPES[qt], "storage")
    if w.layout == "blocks" and qt in SOA_TYPES:  # same values and K order as the SoA layout
        return qb.dequantize_soa(qb.to_soa(we.data["raw"], SOA_TYPES[qt], w.cols), SOA_TYPES[qt], "storage")
    return we.dequantize()


def dequantized_expert_matmul(x: jax.Array, we: jax.Array, w: QTensor) -> jax.Array:
    """Rows x [R, cols] times a `dequantize_expert` matrix -> [R, rows]."""
    order = expert_input_order(w)
    return contract_last(qb.storage_k_order(x, order) if order else x, we)


class DequantizingBackend(Backend):
    """Experts of a dequantizing backend: each used expert dequantized once per batch, float32 dots."""

    def expert_weight(self, w: QTensor, e: jax.Array) -> jax.Array:
        return dequantize_expert(w, e)

    def expert_matmul(self, x: jax.Array, we: jax.Array, w: QTensor) -> jax.Array:
        return dequantized_expert_matmul(x, we, w)


class ReferenceBackend(DequantizingBackend):
    """Exact dequantization in the step, float32 dot; every type the project reads, any platform."""

    name = "reference"
    platforms = ("cpu", "gpu", "cuda", "rocm", "tpu")

    def serves(self, qtype: int, shape: tuple[int, ...]) -> bool:
        return Q(qtype) in formats.SUPPORTED_TYPES

    def layout(self, qtype: int, shape: tuple[int, ...], repack: str | None) -> str:
        if Q(qtype) in FLOAT_TYPES:
            return "float" if len(shape) == 3 else "float_t"
        return "blocks"

    def matmul(self, x: jax.Array, w: QTensor, **options) -> jax.Array:
        if w.layout == "float_t":
            return float_t_matmul(x, w)
        return dequantize_matmul(x, w)
