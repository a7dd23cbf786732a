"""Lookahead: residency that fetches experts before a layer asks for them (`expert_lookahead`).

Modes (`options.LOOKAHEAD_MODES`), combinable with every policy:

- "next_layer": after block L, block L+1's router is applied early to the rows block L outputs (normed
  with L+1's post-mixer norm, as `runtime.routing` defines the prediction); the top-k experts of
  every valid row that are not resident are fetched into layer L+1's ring slots in ONE batch (one host
  callback, `Streamer.fetch`; at most min(staging, ring) experts, most predicted rows first) before
  block L+1 runs. The predicted experts already resident are kept (stamped for the coming call).
- "pass": a call with more than one valid row (a verify pass of MTP chain or tree rows; prefill chunks
  too) streams its cold union into staging and the ring in one batch whatever `expert_cold`'s row
  threshold (a decode row keeps the threshold), and the slots the pass uses or had fetched for it are
  protected: no insertion of the same pass evicts them (`protected`).
- "both": the two.

Policies with no ring (static, frequency) get one under a lookahead (`plan.LOOKAHEAD_RING_SHARE` of
each layer's slots, `expert_ring` overrides): what is fetched ahead lands there, the rest stays pinned.
Where experts sit never changes what a call computes: tokens are the all-resident tokens bit for bit.

Counters (`slots.CTR`): ahead_streamed (experts fetched ahead), ahead_useful / ahead_useless (fetched
experts the next call used / did not use), beside the demand counters (streamed, host_experts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sharpi_jax.experts.residency.plan import PASS_MODES


def plan_prefetch(v: dict, pred: jax.Array, vmask: jax.Array, spec, n_pre: int) -> tuple[jax.Array, jax.Array]:
    """The experts to fetch for a layer's next call and the slots to keep.

    pred [N, k] predicted expert ids, vmask [N, k] valid pairs; v the layer's small state (lut, stamp,
    clock). Returns (ids int32 [n_pre]: the non-resident predicted experts, most predicted rows first,
    ties by id, no more than there are ring slots to take, -1 padded; keep bool [S]: slots holding
    predicted experts, never victims of this fetch, with "pass" the slots protected for the coming call
    too). Every fetched expert gets a slot."""
    E, S = spec.n_expert, spec.n_slots
    slot = v["lut"][pred]
    want = vmask & (slot < 0)
    cnt = jnp.bincount(jnp.where(want, pred, E).reshape(-1), length=E + 1)[:E]
    order = jnp.argsort(-cnt, stable=True)[:n_pre].astype(jnp.int32)
    ids = jnp.where(cnt[order] > 0, order, -1)
    keep = jnp.zeros((S + 1,), bool).at[jnp.where(vmask & (slot >= 0), slot, S).reshape(-1)].set(True)[:S]
    if spec.lookahead in PASS_MODES:
        keep = protected(dict(v, clock=v["clock"] + 1), keep, spec)
    free = ((jnp.arange(S) >= spec.n_pin) & ~keep).sum()
    ids = jnp.where(jnp.arange(n_pre) < free, ids, -1)
    return ids, keep


def protected(v: dict, used: jax.Array, spec) -> jax.Array:
    """"pass" protection: slots no insertion may take now: `used` and the ring slots stamped with the
    current pass's clock (used by it or fetched for it)."""
    ring = jnp.arange(spec.n_slots) >= spec.n_pin
    return used | (ring & (v["stamp"] == v["clock"]))


def score_prefetch(ctr: jax.Array, fresh: jax.Array, used: jax.Array, index: dict) -> tuple[jax.Array, jax.Array]:
    """At a layer's call: fetched-ahead slots (fresh) it used count as useful, the others useless;
    returns (ctr, fresh cleared)."""
    f = fresh > 0
    ctr = ctr.at[index["ahead_useful"]].add((f & used).sum().astype(jnp.int32))
    ctr = ctr.at[index["ahead_useless"]].add((f & ~used).sum().astype(jnp.int32))
    return ctr, jnp.zeros_like(fresh)
