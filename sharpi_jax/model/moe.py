"""MoE FFN: softmax router in f32, top-k, renormalised weights, routed + sigmoid-gated shared expert.

The routed experts are a provider module that this layer calls (`ExpertProvider`): the model fixes
what it computes, `sharpi_jax.experts` implements how (whole expert stacks in GGUF block form with
grouped or per-token dispatch, device slots with streaming under an expert budget), and training
plugs in float experts. The dense qwen35 FFN is `layers.SwiGLU`.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from sharpi_jax.config import ModelConfig
from sharpi_jax.model.layers import Linear, SwiGLU

WEIGHT_SUM_CLAMP = 6.103515625e-5  # ggml's clamp of the top-k weight sum


class ExpertProvider(Protocol):
    """The routed experts of one MoE layer, as the layer calls them.

    `provider(u, sel, w, valid)`: u float32 [N, D] post-attention-normed rows, sel int32 [N, k] the
    top-k expert ids in rank order, w float32 [N, k] their renormalised weights, valid bool [N] or
    None (rows with valid False are bucket padding: routed like row 0 with zero weights). Returns
    float32 [N, D] = sum_j w[i, j] * expert_{sel[i, j]}(u[i]), summed in rank order j = 0..k-1, each
    row independent of the others bit for bit. An nnx.Module; its variables are its weights.

    Optionally (expert residency's lookahead): `predicts` True and `prefetch(sel, valid)`, called by
    the trunk before this layer's block runs with the experts this layer's router picks for the rows
    the block before outputs (`MoE.prefetch`); it may move experts, never change what a call returns.
    """

    def __call__(self, u: jax.Array, sel: jax.Array, w: jax.Array, valid: jax.Array | None) -> jax.Array: ...


def route(router_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """softmax over all experts (f32), top-k, weights renormalised with ggml's clamp -> (sel, w)."""
    return top_k_weights(jax.nn.softmax(router_logits, axis=-1), k)


@jax.custom_batching.custom_vmap
def padding_route(sel: jax.Array, valid: jax.Array) -> jax.Array:
    """sel [N, k] with the padding rows (valid False) routed like the first valid row (row 0: valid rows
    come first), so padding reads no expert that a valid row does not. Under jax.vmap (a batch of sequences,
    `runtime.batch`) like the first valid row of the whole batch, so a finished sequence's rows read
    none either."""
    # The first valid row at a computed index (row 0, as valid rows come first; 0 too when none is): a constant slice
    # sel[:1] would merge into top_k's own slices, and XLA:CPU would then run top_k as a full stable sort of
    # every row's experts (3-4 ms per layer in a 128-token prefill) instead of its TopK call (a partial
    # sort, ties to the lower index, the same selection for these finite, non-negative probabilities).
    first = jax.lax.dynamic_slice_in_dim(sel, jnp.argmax(valid), 1, axis=0)
    return jnp.where(valid[:, None], sel, first)


@padding_route.def_vmap
def _padding_route_batched(axis_size, in_batched, sel, valid):
    sel = sel if in_batched[0] else jnp.broadcast_to(sel[None], (axis_size,) + sel.shape)
    valid = valid if in_batched[1] else jnp.broadcast_to(valid[None], (axis_size,) + valid.shape)
    flat = valid.reshape(-1)
    first = sel.reshape(-1, sel.shape[-1])[jnp.argmax(flat)]  # row 0 of the batch when none is valid
    return jnp.where(valid[..., None], sel, first), True


def top_k_weights(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k most probable experts of each row and their weights renormalised with ggml's clamp."""
    w, sel = jax.lax.top_k(probs, k)
    w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), jnp.float32(WEIGHT_SUM_CLAMP))
    return sel.astype(jnp.int32), w


class MoE(nnx.Module):
    """Routed experts + sigmoid-gated shared expert. The router and the shared-expert gate vector are
    fused into one [D, E+1] f32 matrix (one row-stable matmul instead of a matmul and a matvec)."""

    def __init__(self, c: ModelConfig, experts: nnx.Module):
        """experts: the layer's `ExpertProvider`. Set `record_router` (e.g. `nnx.Module.set_attributes`)
        to sow the router probabilities [N, E] of every call (`nnx.Intermediate` "router_probs"; training's
        load-balance loss)."""
        self.n_expert, self.k = c.n_expert, c.n_expert_used
        self.record_router = False
        self.has_shared = c.shared_expert_ff > 0
        self.router = Linear(c.d_model, c.n_expert + (1 if self.has_shared else 0))
        self.experts = experts
        self.shared = SwiGLU(c.d_model, c.shared_expert_ff) if self.has_shared else None

    @property
    def predicts(self) -> bool:
        """Whether the routed experts take predictions ahead of the call (`ExpertProvider.prefetch`)."""
        return bool(getattr(self.experts, "predicts", False))

    def prefetch(self, u: jax.Array, valid: jax.Array | None = None) -> None:
        """This router applied early to rows u [N, D] (normed as this layer's input would be): hands its
        top-k experts to the provider's `prefetch` (next-layer prediction, as `runtime.routing`)."""
        if self.predicts:
            sel, _ = top_k_weights(jax.nn.softmax(self.router(u)[:, : self.n_expert], axis=-1), self.k)
            self.experts.prefetch(sel, valid)

    def __call__(self, u: jax.Array, valid: jax.Array | None = None, rows: jax.Array | None = None) -> jax.Array:
        """u [N, D] normed rows; rows with valid False (bucket padding) are routed like row 0 with zero
        weights, so they add no expert reads. Rows are independent bit for bit. rows: when the padding
        rows are all after row `rows`, the matmuls may skip them (`Linear`)."""
        r = self.router(u, rows)
        probs = jax.nn.softmax(r[:, : self.n_expert], axis=-1)  # what `route` computes
        if self.record_router:
            self.sow(nnx.Intermediate, "router_probs", probs)
        sel, w = top_k_weights(probs, self.k)
        if valid is not None:
            sel = padding_route(sel, valid)
            w = jnp.where(valid[:, None], w, 0.0)
        out = self.experts(u, sel, w, valid)
        if self.has_shared:
            out = out + jax.nn.sigmoid(r[:, self.n_expert:]) * self.shared(u, rows)
        return out
