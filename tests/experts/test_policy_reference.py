"""Each residency policy's ring bookkeeping (`residency.policies`: touch, victims, admit, SLRU promotion)
against a hand-written reference policy on scripted access traces, step by step: the slots' experts,
the evictions, the protected segment, and the hit counts they imply; and the initial slot order
(`plan._order`) against a plain sort. A wrong choice changes only the hit rate, never the tokens, so
only a test like this holds it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sharpi_jax.experts.residency.plan import _order
from sharpi_jax.experts.residency.policies import SLRU_PROTECTED_FRAC, slot_policy


class Reference:
    """The ring as the policies document it, in plain Python. Per batch: the clock advances; ring slots
    the batch uses get the clock; SLRU: they join the protected segment, and beyond its cap the least
    recently used protected slots the batch did not use drop back (lowest slot first on equal stamps);
    then each streamed expert, in order, takes the next victim: a ring slot unused by the batch,
    probation before protected, least recently used, lowest slot first (a used victim is skipped)."""

    def __init__(self, policy: str, experts: list[int], n_pin: int):
        self.policy, self.slots, self.n_pin = policy, list(experts), n_pin
        S = len(experts)
        self.stamp, self.prot, self.clock = [0] * S, [False] * S, 0
        self.cap = int(SLRU_PROTECTED_FRAC * (S - n_pin))

    def step(self, need: set[int]) -> tuple[int, list[int]]:
        """-> (hits, evicted experts)."""
        S = len(self.slots)
        self.clock += 1
        used = [self.slots[i] in need for i in range(S)]
        ring = range(self.n_pin, S)
        for i in ring:
            if used[i]:
                self.stamp[i] = self.clock
        if self.policy == "slru":
            for i in ring:
                if used[i]:
                    self.prot[i] = True
            over = sum(self.prot) - self.cap
            if over > 0:
                old = sorted((i for i in range(S) if self.prot[i] and not used[i]), key=lambda i: (self.stamp[i], i))
                for i in old[:over]:
                    self.prot[i] = False
        hits = sum(used)
        misses = sorted(need - set(self.slots))
        n_ring = S - self.n_pin
        order = sorted(ring, key=lambda i: (used[i], self.prot[i], self.stamp[i], i))[:min(len(misses), n_ring)]
        evicted = []
        for e, i in zip(misses, order):
            if used[i]:
                continue
            evicted.append(self.slots[i])
            self.slots[i], self.stamp[i], self.prot[i] = e, self.clock, False
        return hits, evicted


class Driven:
    """The policy's jitted bookkeeping driven in the engine's order (`slots.ResidentExperts`: clock, touch
    on the ring slots used, then victims and admit for the streamed experts)."""

    def __init__(self, policy: str, experts: list[int], n_pin: int, width: int):
        self.p, self.n_pin, self.width = slot_policy(policy), n_pin, width
        S = len(experts)
        self.slot_expert = np.asarray(experts, np.int32)
        self.v = dict(stamp=jnp.zeros(S, jnp.int32), protected=jnp.zeros(S, jnp.int32), clock=jnp.int32(0))

    def step(self, need: set[int]) -> tuple[int, list[int]]:
        S = len(self.slot_expert)
        used = jnp.asarray(np.isin(self.slot_expert, sorted(need)))
        v = dict(self.v)
        v["clock"] = v["clock"] + 1
        n_ring = S - self.n_pin
        if n_ring:
            v = self.p.touch(v, used & (jnp.arange(S) >= self.n_pin), n_ring)
        misses = sorted(need - set(self.slot_expert.tolist()))
        sid = np.full(self.width, -1, np.int32)
        sid[:len(misses)] = misses
        nv = min(self.width, n_ring)
        evicted = []
        if nv:
            victims = np.asarray(self.p.victims(v, used, self.n_pin, nv))
            ok = (sid[:nv] >= 0) & ~np.asarray(used)[victims]
            tgt = np.where(ok, victims, S)
            evicted = [int(self.slot_expert[i]) for i in victims[ok]]
            self.slot_expert[victims[ok]] = sid[:nv][ok]
            v = self.p.admit(v, jnp.asarray(tgt, jnp.int32))
        self.v = v
        return int(np.asarray(used).sum()), evicted


def _trace(seed: int, steps: int, E: int, hot: int = 4):
    """Batches of 1-4 experts: a hot set most of the time, scans through the rest now and then."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        if rng.random() < 0.25:
            out.append({int(e) for e in rng.choice(np.arange(hot, E), int(rng.integers(2, 5)), replace=False)})
        else:
            out.append({int(e) for e in rng.choice(hot + 2, int(rng.integers(1, 4)), replace=False)})
    return out


@pytest.mark.parametrize("policy, n_pin", [("lru", 0), ("slru", 0), ("static", 2), ("frequency", 3), ("static", 6)])
@pytest.mark.parametrize("seed", [0])
def test_policy_equals_reference_step_by_step(policy, n_pin, seed):
    S, E, width = 6, 12, 3
    experts = [7, 2, 9, 0, 4, 11]
    ref, ours = Reference(policy, experts, n_pin), Driven(policy, experts, n_pin, width)
    hits = [0, 0]
    for t, need in enumerate(_trace(seed, 30, E)):
        a, b = ref.step(need), ours.step(need)
        assert b == a, (t, need)
        assert ours.slot_expert.tolist() == ref.slots, t
        assert np.asarray(ours.v["stamp"]).tolist() == ref.stamp, t
        assert (np.asarray(ours.v["protected"]) > 0).tolist() == ref.prot, t
        hits[0] += a[0]
        hits[1] += b[0]
    assert hits[0] == hits[1]
    if n_pin == S:  # all pinned: nothing ever moves
        assert ref.slots == experts


def test_scripted_trace_hit_counts_by_hand():
    """Four ring slots, expert 1 hot, a scan of 5..8 in between. LRU loses the hot expert to the scan;
    SLRU keeps it protected (cap 3) and evicts the probation slots instead."""
    start = [1, 2, 3, 4]
    trace = [{1}, {1}, {5, 6}, {7, 8}, {1}, {1}]
    # lru: the scan takes 2, 3 (stamp 0), then 4 (stamp 0) and the hot 1 (stamp 2); 1 comes back over 5
    # slru: 1 is protected after its hits; the scan takes probation slots only: 2, 3, then 4, 5
    for policy, want_hits, want_evicted in (("lru", 2 + 1, [2, 3, 4, 1, 5]),
                                            ("slru", 2 + 2, [2, 3, 4, 5])):
        ours = Driven(policy, start, 0, 2)
        hits, evicted = 0, []
        for need in trace:
            h, ev = ours.step(need)
            hits, evicted = hits + h, evicted + ev
        assert (hits, evicted) == (want_hits, want_evicted), policy


def test_initial_order_by_counts():
    counts = [5, 0, 9, 9, 1, 5, 0, 3]
    ref = sorted(range(len(counts)), key=lambda e: (-counts[e], e))  # most routed first, lower id on ties
    assert _order(len(counts), counts) == ref
    assert _order(len(counts), None) == list(range(len(counts)))
