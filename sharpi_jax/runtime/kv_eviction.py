"""SnapKV eviction in the generation loops: prefill with the observation window's queries, then compact
every attention cache (trunk, and the MTP head's own) into a cache of `kv_capacity` slots.

Memory: the decode-phase KV cache of each attention layer holds kv_budget + max_new_tokens slots
(at most max_context), not the prompt length: the kept prompt rows, then one slot per generated
token; speculative verify rows and MTP drafts append after them and are truncated by the host-side
length. The prefill itself still fills the runtime's max_context-slot state (SnapKV scores the window
against the whole prompt); it is dropped once compacted. A prompt of at most kv_budget tokens is not
compacted at all: that path is the one without eviction, bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from sharpi_jax.model.cache import AttnCache
from sharpi_jax.model.snapkv import SnapKV, compact, every_position, keep_positions
from sharpi_jax.runtime.state import attention_caches, with_attention
from sharpi_jax.runtime.steps import Runtime

MTP_KV_MODES = ("snapkv", "keep")


@dataclasses.dataclass(frozen=True)
class Evicted:
    """Host record of a compacted trunk: `capacity` slots per cache, a row at position p in slot
    p - shift, `evicted` prompt positions dropped per attention layer and KV head."""

    capacity: int
    shift: int
    evicted: int

    def slot(self, position: int) -> int:
        return position - self.shift

    @property
    def last_position(self) -> int:
        """The last position the compacted caches' slots hold."""
        return self.capacity - 1 + self.shift


def kv_capacity(kv: SnapKV | None, max_new_tokens: int, max_context: int) -> int | None:
    """Slots of a compacted cache: kv_budget + max_new_tokens, at most max_context (None: no policy)."""
    return None if kv is None else min(kv.budget + int(max_new_tokens), int(max_context))


def window_queries(queries: Sequence[tuple[tuple[jax.Array, ...], int]], window: int) -> tuple[jax.Array, ...]:
    """Per attention layer, the last `window` valid rows [W, Hq, hd] of per-bucket (queries, n_valid)."""
    tail, rows = [], 0
    for qs, m in reversed(queries):
        tail.insert(0, tuple(q[:m] for q in qs))
        rows += m
        if rows >= window:
            break
    return tuple(jnp.concatenate(per_layer)[-window:] for per_layer in zip(*tail))


def compact_all(caches: Sequence[AttnCache], qs: Sequence[jax.Array] | None, n_rows: int, kv: SnapKV,
                capacity: int) -> list[AttnCache]:
    """Each cache (n_rows filled) compacted to `capacity` slots: SnapKV's kept positions when n_rows >
    budget (qs: each layer's window queries), else every position."""
    out = []
    for i, c in enumerate(caches):
        if kv.evicts(n_rows):
            keep = keep_positions(qs[i], c.k, n_rows=n_rows, budget=kv.budget, pool=kv.pool)
        else:
            keep = every_position(c.k.shape[0], n_rows)
        out.append(compact(c, keep, n_rows=n_rows, capacity=capacity))
    return out


def prefill(runtime: Runtime, ids: Sequence[int], kv: SnapKV | None, capacity: int | None, resume=None):
    """`runtime.prefill` of a new sequence, then SnapKV compaction when the prompt is longer than the
    budget. Returns (chunks, last_logits, state, Evicted or None when nothing was compacted). resume: a
    session's `session.Resume` (no eviction): the prefill continued from its saved state."""
    if resume is not None:
        assert kv is None  # refused where sessions enter (`Engine.generate`)
        return (*resume.prefill(runtime, ids), None)
    n = len(ids)
    if kv is None or not kv.evicts(n):
        chunks, logits, state = runtime.prefill(runtime.new_state(), ids)
        return chunks, logits, state, None
    queries: list = []
    chunks, logits, state = runtime.prefill(runtime.new_state(), ids, queries=queries)
    attn = compact_all(attention_caches(state), window_queries(queries, kv.window), n, kv, capacity)
    return chunks, logits, with_attention(state, attn), Evicted(capacity, n - kv.budget, n - kv.budget)


def mtp_prefill(mtp, ids: Sequence[int], chunks, zero_h_first: bool, kv: SnapKV, capacity: int):
    """The MTP head's prefill (`MTPRuntime.prefill`) with its KV compacted by the same SnapKV rule over
    its own rows. Returns (cache, h of the last id)."""
    n_rows = len(ids) - (0 if zero_h_first else 1)
    queries: list = []
    cache, h_last, _ = mtp.prefill(mtp.new_cache(), ids, chunks, zero_h_first, queries)
    qs = window_queries(queries, kv.window) if kv.evicts(n_rows) else None
    (cache,) = compact_all([cache], qs, n_rows, kv, capacity)
    return cache, h_last


def kv_stats(evicted: Evicted | None, length: int, max_context: int) -> dict[str, Any]:
    """kv_slots (trunk KV slots in use at the end), kv_evicted (prompt positions dropped per attention
    layer and KV head), kv_capacity (slots allocated per attention cache)."""
    if evicted is None:
        return {"kv_slots": length, "kv_evicted": 0, "kv_capacity": max_context}
    return {"kv_slots": evicted.slot(length), "kv_evicted": evicted.evicted, "kv_capacity": evicted.capacity}
