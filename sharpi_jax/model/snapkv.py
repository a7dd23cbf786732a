"""SnapKV prefill eviction for one attention KV cache: score, pool, top-k, compact (pure functions).

After a prompt of n rows, the last W rows (the observation window) attend to the whole prompt
(causal softmax of q k^T / sqrt(hd), exactly as the attention layer); per KV head, the attention
probability each prefix position 0..n-W-1 receives is summed over the window rows and the G query
heads of that KV head, then averaged over a sliding window of width P (stride 1, zero padding,
positions i - (P-1)//2 .. i + P//2, as a "same" average pool). The top budget - W prefix positions
per KV head (ties: the lower position first) plus the W window positions are kept, in ascending
position order.

Compaction gathers the kept rows into the first `budget` slots of a cache of `capacity` slots and
records the logical position of every slot (`AttnCache.slot_pos`): slot s >= budget holds position
s + shift, shift = n - budget, so new rows (decode, verify, MTP drafts) append after the kept slots at
slot position - shift, and a rollback is still just the host-side length: slots past it hold
positions beyond every live row and are masked. GDN layers have fixed-size state and are untouched.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from sharpi_jax.errors import InputError
from sharpi_jax.model.cache import AttnCache

KV_POLICIES = (None, "snapkv")
DEFAULT_WINDOW = 32
DEFAULT_POOL = 7


def _size(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise InputError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < minimum:
        raise InputError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class SnapKV:
    """A validated SnapKV setting: keep `budget` positions per KV head (the `window` last prompt rows
    plus the top budget - window prefix positions by pooled attention, pool width `pool`)."""

    budget: int = None  # type: ignore[assignment] - required; None gives the one-line error below
    window: int = DEFAULT_WINDOW
    pool: int = DEFAULT_POOL

    def __post_init__(self) -> None:
        if self.budget is None:
            raise InputError("SnapKV needs kv_budget (KV positions kept per attention layer and head)")
        object.__setattr__(self, "window", _size("kv_window", self.window, 1))
        object.__setattr__(self, "pool", _size("kv_pool", self.pool, 1))
        object.__setattr__(self, "budget", _size("kv_budget", self.budget, 1))
        if self.budget < self.window:
            raise InputError(f"kv_budget ({self.budget}) must be at least kv_window ({self.window}): the "
                             "observation window is always kept")

    def evicts(self, n_rows: int) -> bool:
        """Whether a prompt of n_rows rows loses positions (n_rows > budget)."""
        return n_rows > self.budget


def policy(kv_policy, kv_budget, kv_window, kv_pool) -> SnapKV | None:
    """The SnapKV setting for user options (kv_policy None: no eviction), or InputError."""
    if kv_policy not in KV_POLICIES:
        raise InputError(f"kv_policy must be one of {KV_POLICIES}, got {kv_policy!r}")
    if kv_policy is None:
        return None
    if kv_budget is None:
        raise InputError('kv_policy="snapkv" needs kv_budget (KV positions kept per attention layer and head)')
    return SnapKV(kv_budget, DEFAULT_WINDOW if kv_window is None else kv_window,
                  DEFAULT_POOL if kv_pool is None else kv_pool)


def pooled_votes(q: jax.Array, k: jax.Array, n_rows: int, pool: int) -> jax.Array:
    """q [W, Hq, hd]: the window rows' post-rope queries (positions n_rows-W..n_rows-1); k [Hkv, S, hd]
    (slot s = position s, S >= n_rows). Returns the pooled votes [Hkv, n_rows - W] of the prefix."""
    W, Hq, hd = q.shape
    Hkv = k.shape[0]
    qh = q.reshape(W, Hkv, Hq // Hkv, hd)
    s = jnp.einsum("wkgd,ksd->kgws", qh, k[:, :n_rows]) * jnp.float32(1.0 / (hd ** 0.5))
    rows = n_rows - W + jnp.arange(W, dtype=jnp.int32)
    mask = jnp.arange(n_rows, dtype=jnp.int32)[None, :] <= rows[:, None]  # [W, n]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    votes = jnp.sum(p[..., : n_rows - W], axis=(1, 2))  # [Hkv, n - W]
    pad = ((0, 0), ((pool - 1) // 2, pool // 2))
    return jax.lax.reduce_window(votes, jnp.float32(0), jax.lax.add, (1, pool), (1, 1), pad) / jnp.float32(pool)


@functools.partial(jax.jit, static_argnames=("n_rows", "budget", "pool"))
def keep_positions(q: jax.Array, k: jax.Array, *, n_rows: int, budget: int, pool: int) -> jax.Array:
    """The positions kept per KV head [Hkv, budget] int32, ascending (n_rows > budget >= W = len(q)):
    the top budget - W prefix positions by `pooled_votes`, then the window."""
    W = q.shape[0]
    Hkv = k.shape[0]
    window = jnp.broadcast_to(jnp.arange(n_rows - W, n_rows, dtype=jnp.int32), (Hkv, W))
    if budget == W:
        return window
    _, top = jax.lax.top_k(pooled_votes(q, k, n_rows, pool), budget - W)
    return jnp.concatenate([jnp.sort(top.astype(jnp.int32), axis=-1), window], axis=-1)


@functools.partial(jax.jit, static_argnames=("n_rows", "capacity"))
def compact(cache: AttnCache, keep: jax.Array, *, n_rows: int, capacity: int) -> AttnCache:
    """A cache of `capacity` slots holding the rows of `keep` [Hkv, m] (positions, ascending) of an
    uncompacted cache whose first n_rows positions are filled; slots >= m hold positions s + n_rows - m
    (written later). m = n_rows with keep = every position is a plain copy, shift 0."""
    Hkv, m = keep.shape
    if cache.slot_pos is not None:
        raise ValueError("compact takes an uncompacted cache")
    if capacity < m:
        raise ValueError(f"capacity {capacity} < {m} kept rows")

    def gather(a):
        rows = jnp.take_along_axis(a, keep[:, :, None], axis=1)
        return jnp.zeros((Hkv, capacity, a.shape[2]), a.dtype).at[:, :m].set(rows)

    shift = n_rows - m
    tail = jnp.broadcast_to(jnp.arange(m, capacity, dtype=jnp.int32) + shift, (Hkv, capacity - m))
    return AttnCache(gather(cache.k), gather(cache.v), jnp.concatenate([keep.astype(jnp.int32), tail], axis=1),
                     jnp.int32(shift))


def every_position(n_kv_heads: int, n_rows: int) -> jax.Array:
    """`keep` for no eviction: every position, every head [Hkv, n_rows]."""
    return jnp.broadcast_to(jnp.arange(n_rows, dtype=jnp.int32), (n_kv_heads, n_rows))
