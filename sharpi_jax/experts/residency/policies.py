"""Slot policies: which experts a layer's device slots start with, and how its ring is refilled.

A layer's slots are split into pinned slots (never replaced) and a ring (the last `n_ring` slots),
refilled from streamed experts. One interface (`SlotPolicy`) covers both the plan (initial order,
ring share, default cold mode) and the jitted bookkeeping of the ring (recency stamps on hits, victims
for streamed experts, the state of an admitted expert):

- "static": the first n experts of every layer, pinned.
- "frequency": calibrated routing counts per byte, greedy across layers (see `plan`); pinned. Without
  counts it falls back to the static order (with a warning).
- "lru": every slot is in the ring; a streamed expert replaces the least recently used ring slot that
  the batch does not use. Initial fill: by counts when present, else the first n.
- "slru": segmented LRU: new experts enter a probation segment; a hit promotes to a protected segment
  (at most 80% of the ring); victims come from probation first.

`expert_ring` (a fraction) overrides the ring share, e.g. frequency-pinned + a small LRU ring: any
policy's ring is refilled least recently used first.

Ring state per layer (int32 arrays in the dict `v`, see `slots.ResidentExperts`): `stamp` [S] (the
clock of the last batch that used the slot), `protected` [S] (SLRU segment), `clock` [].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SLRU_PROTECTED_FRAC = 0.8


class SlotPolicy:
    """The "static" policy, and the ring behaviour every policy shares (least recently used first)."""

    name = "static"
    ordered_by_counts = False  # initial slots by calibrated counts (when there are counts)
    greedy_by_counts = False  # spend the budget across layers by count per byte
    ring_share = 0.0  # default share of a layer's slots that form the ring
    default_cold = "auto"  # cold mode when not given (a ring fills only from streamed experts)

    def touch(self, v: dict, hit_ring: jax.Array, n_ring: int) -> dict:
        """After a batch: ring slots it used (hit_ring [S] bool) get the current clock."""
        v["stamp"] = jnp.where(hit_ring, v["clock"], v["stamp"])
        return v

    def victims(self, v: dict, used: jax.Array, n_pin: int, n: int) -> jax.Array:
        """The n ring slots to refill, best first: unused by this batch, probation before protected,
        then least recently used."""
        S = used.shape[0]
        ring = jnp.arange(n_pin, S, dtype=jnp.int32)
        used_r, prot_r, stamp_r = used[n_pin:], v["protected"][n_pin:], v["stamp"][n_pin:]
        return ring[jnp.lexsort((stamp_r, prot_r, used_r))[:n]]  # the last key is the primary one

    def admit(self, v: dict, slots: jax.Array) -> dict:
        """Newly filled ring slots (S: none): used now, on probation."""
        v["stamp"] = v["stamp"].at[slots].set(v["clock"], mode="drop")
        v["protected"] = v["protected"].at[slots].set(0, mode="drop")
        return v


class Frequency(SlotPolicy):
    name = "frequency"
    ordered_by_counts = True
    greedy_by_counts = True


class LRU(SlotPolicy):
    name = "lru"
    ordered_by_counts = True
    ring_share = 1.0
    default_cold = "stream"


class SLRU(LRU):
    name = "slru"

    def touch(self, v: dict, hit_ring: jax.Array, n_ring: int) -> dict:
        v = super().touch(v, hit_ring, n_ring)
        v["protected"] = promote(v["protected"], v["stamp"], hit_ring, int(SLRU_PROTECTED_FRAC * n_ring))
        return v


_POLICIES = {p.name: p for p in (SlotPolicy(), Frequency(), LRU(), SLRU())}
POLICIES = tuple(_POLICIES)  # ("static", "frequency", "lru", "slru")


def slot_policy(name: str) -> SlotPolicy:
    """The policy called `name` (one of POLICIES)."""
    return _POLICIES[name]


def promote(protected: jax.Array, stamp: jax.Array, hit_ring: jax.Array, cap: int) -> jax.Array:
    """SLRU: hits join the protected segment; beyond `cap`, the oldest unhit protected slots drop back."""
    prot = (protected > 0) | hit_ring
    over = prot.sum() - cap
    cand = prot & ~hit_ring
    order = jnp.lexsort((stamp, ~cand))
    rank = jnp.zeros(prot.shape, jnp.int32).at[order].set(jnp.arange(prot.shape[0], dtype=jnp.int32))
    return (prot & ~(cand & (rank < over))).astype(jnp.int32)
