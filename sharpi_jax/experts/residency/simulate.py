"""Replay routing traces through a residency policy, with and without next-layer prefetch (a model of
the bytes moved, not the engine: what a policy would stream on a given routing, in experts).

`simulate(sel, early, n_slots, policy, ...)` walks a trace in passes of `rows` consecutive tokens
advancing by `advance` tokens (rows = advance = 1: plain decode; rows = k + 1 with MTP: a verify pass
whose drafts are the next tokens, `advance` the generated tokens per pass). Per pass and MoE layer:

- the layer needs the union U of its rows' experts; those neither in its slots nor prefetched for this
  pass are *demand* streams (on the critical path: the layer waits for them), in one batch;
- policy "static" / "frequency": the slots hold a fixed set (the first n_slots of `order`); "lru":
  the slots are refilled from every expert streamed (demand or prefetch), least recently used out,
  the current pass's used or prefetched experts last (the pass's union is protected while the
  slots can hold it);
- prefetch "next_layer": while layer L computes, the top-`predict` experts of layer L+1's early router
  (`early[L+1]`, see `sharpi_jax.runtime.routing`) on the pass's rows are fetched if not resident:
  *prefetch* streams, off the critical path (they overlap layer L's compute), which the demand misses
  of layer L+1 then need not wait for.

Returns expert counts per generated token: demand, prefetch, total (= demand + prefetch), and the hit
rate (share of needed experts found resident or prefetched). Layer 0 has no earlier layer to predict
from. Staging and the prefetch buffer sit outside `n_slots`, as the engine's staging sits on top of
`budget_for_fraction`'s slots. Not modelled: rejected drafts (their rows are the next tokens here),
the staging limit beyond which the engine computes on the host, and timing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

SIM_POLICIES = ("static", "frequency", "lru")
SIM_PREFETCH = ("none", "next_layer")


def simulate(sel: np.ndarray, early: np.ndarray | None, n_slots: int, policy: str,
             order: Sequence[Sequence[int]], prefetch: str = "none", rows: int = 1, advance: int = 1,
             predict: int | None = None) -> dict[str, float]:
    """sel [L, T, k] routed experts; early [L, T, E] early-router scores (needed for next_layer);
    order[L]: the experts in initial-slot order (by calibrated count for "frequency", by id for
    "static"; lru starts from it too). See the module doc."""
    if policy not in SIM_POLICIES or prefetch not in SIM_PREFETCH:
        raise ValueError(f"policy {policy!r} / prefetch {prefetch!r}: expected {SIM_POLICIES} / {SIM_PREFETCH}")
    L, T, k = sel.shape
    predict = k if predict is None else predict
    slots = [OrderedDict.fromkeys(int(e) for e in order[i][:n_slots]) for i in range(L)]
    demand = pre = needed = found = 0
    starts = range(0, T - rows + 1, advance)
    for t in starts:
        ahead: set[int] = set()  # prefetched for the current layer in this pass
        for i in range(L):
            need = {int(e) for e in sel[i, t: t + rows].ravel()}
            have = set(slots[i]) | ahead
            miss = need - have
            demand += len(miss)
            needed += len(need)
            found += len(need) - len(miss)
            if policy == "lru":
                _touch(slots[i], need, n_slots, keep=need | ahead)
            ahead = set()
            if prefetch == "next_layer" and i + 1 < L:
                top = np.argsort(-early[i + 1, t: t + rows], axis=1, kind="stable")[:, :predict]
                guess = {int(e) for e in top.ravel()}
                ahead = guess - set(slots[i + 1])
                pre += len(ahead)
                if policy == "lru":  # the predicted experts already resident are kept too
                    _touch(slots[i + 1], guess, n_slots, keep=guess)
    tokens = len(starts) * advance
    return {"demand_per_token": demand / tokens, "prefetch_per_token": pre / tokens,
            "total_per_token": (demand + pre) / tokens, "hit_rate": found / needed}


def _touch(ring: OrderedDict, used: set[int], capacity: int, keep: set[int]) -> None:
    """Mark `used` most recent (inserting the absent ones), then evict down to `capacity`: least recent
    first, those not in `keep` before those in it (a union larger than the slots cannot all stay)."""
    for e in sorted(used):
        ring.pop(e, None)
        ring[e] = None
    over = len(ring) - capacity
    if over > 0:
        victims = [e for e in ring if e not in keep] + [e for e in ring if e in keep]
        for e in victims[:over]:
            del ring[e]
