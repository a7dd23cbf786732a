"""Explicit decoding state pytrees, per layer (all float32: on XLA CPU a bf16 dynamic_update_slice
upcasts the whole buffer, so CPU caches stay f32).

`DecodeState`: a tuple with one cache per trunk layer, in trunk order: `AttnCache(k, v)` for an
attention layer, `GDNCache(conv, ssm)` for a Gated DeltaNet layer (layouts in `sharpi_jax.model.cache`).
The committed length (number of positions filled) lives on the host; positions >= length in the KV
caches are stale and always masked. Rollback = choose a GDN snapshot and set the length. A cache
compacted by SnapKV eviction (`sharpi_jax.runtime.kv_eviction`) works the same way with slot =
position - shift: rows past the length sit in slots whose logical positions are masked.

`Snapshots` (from a multi-row recurrent step): per trunk layer, a `GDNCache` of per-row states
(conv [T, Kc-1, C], ssm [T, Hv, dv, dk]; index t is the state right after row t) for a GDN layer,
None for an attention layer.

`MTPCache`: the MTP block's own KV cache, an `AttnCache`; its committed length is host-side too
(speculative decoding truncates it together with the trunk's).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from sharpi_jax.config import ModelConfig
from sharpi_jax.model.cache import AttnCache, GDNCache, LayerCache, cache_shapes, zeros

DecodeState = tuple[LayerCache, ...]
Snapshots = tuple[GDNCache | None, ...]
MTPCache = AttnCache


def init_mtp_cache(c: ModelConfig, max_context: int) -> MTPCache:
    """A zeroed MTP KV cache."""
    return zeros(cache_shapes(c, c.mtp_layer, max_context))


def state_shapes(c: ModelConfig, max_context: int) -> DecodeState:
    """Shapes (jax.ShapeDtypeStruct) of a fresh state."""
    return tuple(cache_shapes(c, i, max_context) for i in range(c.n_layer))


def init_state(c: ModelConfig, max_context: int) -> DecodeState:
    """A zeroed state (a new sequence: llama.cpp's rs_z rows; zero KV so masked products are exact 0)."""
    return zeros(state_shapes(c, max_context))


def state_bytes(c: ModelConfig, max_context: int) -> int:
    """Memory of one sequence's state."""
    return sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(state_shapes(c, max_context)))


def gdn_caches(state: DecodeState | Snapshots) -> list[GDNCache]:
    """The GDN layers' entries of a state (or of snapshots), in trunk order."""
    return [c for c in state if isinstance(c, GDNCache)]


def attention_caches(state: DecodeState) -> list[AttnCache]:
    """The attention layers' KV caches of a state, in trunk order."""
    return [c for c in state if isinstance(c, AttnCache)]


def _with_kind(state: DecodeState, kind: type, new: Sequence, what: str) -> DecodeState:
    """`state` with its caches of type `kind` replaced by `new` (in trunk order)."""
    it = iter(new)
    out = tuple(next(it) if isinstance(c, kind) else c for c in state)
    if next(it, None) is not None:
        raise ValueError(f"more {what} caches than {what} layers")
    return out


def with_gdn(state: DecodeState, gdn: Sequence[GDNCache]) -> DecodeState:
    """`state` with its GDN layers' caches replaced by `gdn` (in trunk order)."""
    return _with_kind(state, GDNCache, gdn, "GDN")


def with_attention(state: DecodeState, attn: Sequence[AttnCache]) -> DecodeState:
    """`state` with its attention layers' caches replaced by `attn` (in trunk order)."""
    return _with_kind(state, AttnCache, attn, "attention")


def select_snapshot(state: DecodeState, snapshots: Snapshots, index) -> DecodeState:
    """`state` with every GDN layer set to its snapshot `index` (the state after row `index`)."""
    return tuple(c if s is None else GDNCache(s.conv[index], s.ssm[index]) for c, s in zip(state, snapshots))


def repeat_as_snapshots(state: DecodeState, n_rows: int) -> Snapshots:
    """Snapshots whose every row is the state itself ("after row 0" of a pass that did not happen)."""
    rep = lambda a: jnp.broadcast_to(a[None], (n_rows,) + a.shape)  # noqa: E731
    return tuple(GDNCache(rep(c.conv), rep(c.ssm)) if isinstance(c, GDNCache) else None for c in state)


def first_snapshots(state: DecodeState, n_rows: int, buffers: Snapshots | None = None) -> Snapshots:
    """The snapshots a loop's first pass commits from (rollback index 0: the state itself). With
    `buffers` (n_rows-row snapshot buffers of an earlier loop, donated): those with row 0 set to the
    state, all the first pass reads, instead of new buffers (a fresh 2 MB a row and GDN layer on the 35B
    shapes faults its pages in: ~180 ms a generation on the research twin); else
    `repeat_as_snapshots(state, n_rows)`."""
    if buffers is None:
        return repeat_as_snapshots(state, n_rows)
    return tuple(b if b is None else GDNCache(b.conv.at[0].set(c.conv), b.ssm.at[0].set(c.ssm))
                 for b, c in zip(buffers, state, strict=True))


def snapshot_rows(snaps: Snapshots) -> int | None:
    """The rows T of snapshots (None without a GDN layer)."""
    return next((s.conv.shape[0] for s in snaps if s is not None), None)


def move_kv_rows(state: DecodeState, src: jax.Array, dst0: jax.Array, n: jax.Array) -> DecodeState:
    """Every attention layer's KV rows src[i] -> dst0 + i for i < n (all read before any write): a
    draft tree's accepted path moved into place. src [W] int32, positions: a compacted (SnapKV) layer
    moves its slots position - shift."""
    i = jnp.arange(src.shape[0], dtype=jnp.int32)

    def move(c: AttnCache) -> AttnCache:
        S = c.k.shape[1]
        off = 0 if c.shift is None else c.shift
        dst = jnp.where(i < n, dst0 - off + i, S)
        s = jnp.clip(src - off, 0, S - 1)
        return c._replace(k=c.k.at[:, dst, :].set(c.k[:, s, :], mode="drop"),
                          v=c.v.at[:, dst, :].set(c.v[:, s, :], mode="drop"))

    return tuple(move(c) if isinstance(c, AttnCache) else c for c in state)
