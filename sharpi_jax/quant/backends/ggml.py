"""The "ggml" backend (the CPU default): every matrix in the file's bytes, multiplied by ggml's own CPU
kernels from inside jit (`sharpi_jax.quant.ggml`: one FFI call per product, activations quantized by
ggml's `from_float`, dot products by ggml's `vec_dot`), as llama.cpp computes them.

Layout: "blocks" (uint8 [..., rows, row_bytes], the GGUF bytes as they are; no repacking) for every
type ggml's CPU backend multiplies whose rows are whole blocks; anything else falls back to "xla".
Row-stable at any M (an output row depends only on its own activation row), so a single decode row
needs no 2-row bucket, and batched verify == sequential decode holds bit for bit.

Routed experts: one FFI call per MoE layer (`expert_rows`, each used expert read once, SwiGLU in the
op); the composed loops (per-token mode, expert residency's slot + staging views) run the same op on
one expert at a time (`expert_ffn`), so every path gives the same bits per (row, expert).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from gguf import GGML_QUANT_SIZES

from sharpi_jax.gguf import quants as formats
from sharpi_jax.quant import ggml
from sharpi_jax.quant.qtensor import Q, QTensor
from sharpi_jax.quant.registry import Backend, ExpertOptions


def _raw(w: QTensor) -> jax.Array:
    return w.data["raw"]


def _qtypes(mats) -> tuple[int, int, int]:
    return tuple(int(m.qtype) for m in mats)


class GgmlBackend(Backend):
    """ggml's CPU kernels on the file's blocks (see module doc)."""

    name = "ggml"
    platforms = ("cpu",)
    fallback = "xla"

    auto = 30  # above "xla" on CPU, where the extension loaded

    def unavailable(self) -> str | None:
        return ggml.unavailable_reason()

    def serves(self, qtype: int, shape: tuple[int, ...]) -> bool:
        return self.why_not(qtype, shape) is None

    def why_not(self, qtype: int, shape: tuple[int, ...]) -> str | None:
        qt = Q(qtype)
        if not ggml.serves(qt) or qt not in formats.SUPPORTED_TYPES:
            return f"ggml has no CPU kernel for ggml type {qt.name}"
        block = GGML_QUANT_SIZES[qt][0]
        if shape[-1] % block:
            return f"row length {shape[-1]} is not a multiple of the {qt.name} block ({block})"
        return None

    def layout(self, qtype: int, shape: tuple[int, ...], repack: str | None) -> str:
        return "blocks"

    def matmul(self, x: jax.Array, w: QTensor, **options) -> jax.Array:
        return ggml.matmul(x, _raw(w), w.qtype, rows=options.get("rows"))

    def expert_rows(self, u: jax.Array, sel: jax.Array, experts: tuple[QTensor, QTensor, QTensor],
                    opts: ExpertOptions, valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        gate, up, down = experts
        n_expert = gate.shape[0]
        # Ids outside [0, E) (another device's experts under expert parallelism) and bucket padding rows
        # (valid False) are not computed: the op returns +0.0 rows for them.
        keep = (sel >= 0) & (sel < n_expert)
        if valid is not None:
            keep &= valid[:, None]
        ids = jnp.where(keep, sel, -1).astype(jnp.int32)
        y = ggml.expert_rows(u, ids, _raw(gate), _raw(up), _raw(down), _qtypes(experts), "grouped")
        used = jnp.zeros((n_expert + 1,), jnp.bool_).at[jnp.where(ids < 0, n_expert, ids).reshape(-1)].set(True)
        return y, used[:n_expert].sum(dtype=jnp.int32)

    def expert_ffn(self, x: jax.Array, loaded, stacks) -> jax.Array:
        g, u, d = loaded
        ids = jnp.zeros((x.shape[0], 1), jnp.int32)
        y = ggml.expert_rows(x, ids, _raw(g)[None], _raw(u)[None], _raw(d)[None], _qtypes(stacks), "grouped")
        return y[:, 0]
