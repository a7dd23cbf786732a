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

Lookahead buffer (`expert_lookahead_buffer` = P experts, with "next_layer" / "both"): the predicted
experts are fetched into ONE buffer of P experts shared by the layers of a block-type mix (charged
to the budget once, `plan`), not into the layer's ring: a layer's predictions are fetched after the
layer before has run and used by its own call right after, so one buffer serves every layer in turn.
Each fetch relabels every entry (`buffer_labels`: the experts it holds and the layer they are for);
a call uses an entry only when the label is its own layer (`buffer_slots`). At most P experts, most
predicted rows first; a verify pass's predicted union is in the buffer for the whole call.

Policies with no ring (static, frequency) get one under a lookahead (`plan.LOOKAHEAD_RING_SHARE` of
each layer's slots, `expert_ring` overrides): what is fetched ahead lands there, the rest stays pinned.
Where experts sit never changes what a call computes: tokens are the all-resident tokens bit for bit.

Counters (`slots.CTR`): ahead_streamed (experts fetched ahead), ahead_useful / ahead_useless (fetched
experts the next call used / did not use; buffer entries are scored by the call of the layer they were
fetched for), beside the demand counters (streamed, host_experts).
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
    if not spec.buffer:  # into the ring: no more than its slots free of kept experts
        free = ((jnp.arange(S) >= spec.n_pin) & ~keep).sum()
        ids = jnp.where(jnp.arange(n_pre) < free, ids, -1)
    return ids, keep


def buffer_labels(ids: jax.Array, size: int, layer: int) -> dict:
    """The lookahead buffer's labels after a fetch of `ids` (int32 [n <= size], -1 pads) for `layer`:
    entry j holds ids[j] (-1 beyond), every entry for that layer, not yet scored."""
    expert = jnp.full((size,), -1, jnp.int32).at[: ids.shape[0]].set(ids.astype(jnp.int32))
    return {"expert": expert, "layer": jnp.asarray(layer, jnp.int32), "fresh": jnp.ones((), jnp.int32)}


def buffer_slots(labels: dict, layer: int, sel: jax.Array, n_expert: int) -> jax.Array:
    """The lookahead buffer entry holding each pair's expert (sel [N, k]) for `layer`, or -1: entries
    fetched for another layer hold that layer's experts, never this one's."""
    mine = (labels["layer"] == layer) & (labels["expert"] >= 0)
    P = labels["expert"].shape[0]
    pos = jnp.full((n_expert + 1,), -1, jnp.int32)
    pos = pos.at[jnp.where(mine, labels["expert"], n_expert)].set(jnp.arange(P, dtype=jnp.int32))
    return pos[:n_expert][sel]


def score_buffer(labels: dict, ctr: jax.Array, bslot: jax.Array, layer: int, index: dict) -> tuple[dict, jax.Array]:
    """At `layer`'s call: the buffer entries fetched for it and not yet scored count as useful when a pair
    reads them (bslot [N, k]: entry or -1), useless otherwise; returns (labels marked scored, ctr)."""
    P = labels["expert"].shape[0]
    read = jnp.zeros((P + 1,), bool).at[jnp.where(bslot >= 0, bslot, P).reshape(-1)].set(True)[:P]
    due = (labels["layer"] == layer) & (labels["fresh"] > 0) & (labels["expert"] >= 0)
    ctr = ctr.at[index["ahead_useful"]].add((due & read).sum().astype(jnp.int32))
    ctr = ctr.at[index["ahead_useless"]].add((due & ~read).sum().astype(jnp.int32))
    fresh = jnp.where(labels["layer"] == layer, 0, labels["fresh"]).astype(jnp.int32)
    return dict(labels, fresh=fresh), ctr


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
