"""Routing traces: which experts each token picks at each MoE layer, and what layer L+1's router
predicts from the hidden state layer L hands on (next-layer prediction).

`trace_routing(model, ids)` runs the trunk over one sequence, layer by layer (one jitted call per block,
teacher-forced: a research tool, not a serving path) and returns per MoE layer L:

- `probs[L]` [T, E]: the router's softmax over the routed experts, as `model.moe.MoE` computes it
  (its top-k is the layer's routing);
- `early[L]` [T, E] (L >= 1): layer L's router applied early, to the hidden state ENTERING layer L
  (= layer L-1's output, before L's attention / GDN mixer), normed with L's own post-mixer RMSNorm:
  what a prefetcher can compute while layer L-1's experts still run. Row 0 of `early` is NaN.

The routing statistics on traces (load skew, reuse, prediction recall) are
`sharpi_jax.experts.routing_stats`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sharpi_jax.errors import InputError
from sharpi_jax.runtime.state import init_state


@dataclasses.dataclass(frozen=True)
class RoutingTrace:
    """Router probabilities of one sequence: probs / early [L, T, E] float32 (early[0] is NaN)."""

    probs: np.ndarray
    early: np.ndarray
    top_k: int

    @property
    def selected(self) -> np.ndarray:
        """[L, T, k] the experts each token is routed to (descending probability, ties by id)."""
        return top_k_ids(self.probs, self.top_k)


def top_k_ids(probs: np.ndarray, k: int) -> np.ndarray:
    """[..., E] -> [..., k]: the k largest entries' ids (jax.lax.top_k order: ties by lower id)."""
    return np.asarray(jax.lax.top_k(jnp.asarray(probs), k)[1])


@functools.partial(jax.jit, static_argnums=0)
def _run_block(graphdef, state, x, cache, positions, valid):
    """One block on rows x -> (x', the router probs of its MoE [T, E], its router early on x [T, E])."""
    blk = nnx.merge(graphdef, state)
    moe = blk.ffn
    early = jax.nn.softmax(moe.router(blk.post_norm(x))[:, : moe.n_expert], axis=-1)
    x, _, _ = blk(x, cache, positions, valid, "chunked")
    return x, moe.router_probs.get_value()[-1], early


def trace_routing(model, ids: Sequence[int]) -> RoutingTrace:
    """Route `ids` (one sequence from position 0) through a MoE trunk (`model.transformer.Transformer`)."""
    c = model.config
    if not c.is_moe:
        raise InputError(f"trace_routing needs a MoE model; {c.arch} has no routed experts")
    ids = jnp.asarray(np.asarray(ids, np.int32))
    T = int(ids.shape[0])
    state = init_state(c, T)
    positions = jnp.arange(T, dtype=jnp.int32)
    valid = jnp.ones(T, bool)
    x = model.embed(ids)
    L, E = c.n_layer, c.n_expert
    probs = np.full((L, T, E), np.nan, np.float32)
    early = np.full((L, T, E), np.nan, np.float32)
    for i, (blk, cache) in enumerate(zip(model.layers, state, strict=True)):
        blk.ffn.record_router = True  # the MoE sows its router probabilities (`model.moe.MoE`)
        try:
            graphdef, params = nnx.split(blk)
        finally:
            blk.ffn.record_router = False
        x, p, e = _run_block(graphdef, params, x, cache, positions, valid)
        probs[i] = np.asarray(p)
        if i > 0:
            early[i] = np.asarray(e)
    return RoutingTrace(probs, early, c.n_expert_used)
