"""Per-layer decode caches: a block's own state, as the block reads and returns it (pytrees, float32).

- `AttnCache` (gated attention; also the MTP block): k and v [Hkv, S, hd], S = max_context,
  post-norm post-rope K and raw V. Positions past the committed length are stale and always masked.
  Slot s holds position s, unless the cache was compacted (SnapKV eviction, `sharpi_jax.model.snapkv`):
  then `slot_pos` [Hkv, S] int32 is the logical position each slot holds (per KV head) and a new row
  at position p goes to slot p - `shift` (int32 scalar); RoPE and masks use logical positions.
- `GDNCache` (Gated DeltaNet): conv [Kc-1, C], the raw pre-conv qkv rows of the last Kc-1 tokens,
  oldest first (time-major, the transpose of ggml's [C, Kc-1]); ssm [Hv, dv, dk], ggml's layout (the
  transpose of Hugging Face's per-head [dk, dv]).

A multi-row recurrent step also returns per-row snapshots of a GDN layer: a `GDNCache` whose arrays
have a leading row axis ([T, Kc-1, C], [T, Hv, dv, dk]); row t is the state right after row t.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import jax
import jax.numpy as jnp

from sharpi_jax.config import ModelConfig


class AttnCache(NamedTuple):
    """KV cache of one attention layer: k, v [Hkv, S, hd]; slot_pos [Hkv, S] and shift [] (int32) only
    for a compacted cache (None: slot s holds position s)."""

    k: jax.Array
    v: jax.Array
    slot_pos: jax.Array | None = None
    shift: jax.Array | None = None

    def end_position(self):
        """The position just past the last slot: the slot count, + shift on a compacted cache."""
        return self.k.shape[1] + (0 if self.shift is None else self.shift)


class GDNCache(NamedTuple):
    """Recurrent state of one Gated DeltaNet layer: conv [Kc-1, C], ssm [Hv, dv, dk]."""

    conv: jax.Array
    ssm: jax.Array


LayerCache = Union[AttnCache, GDNCache]


def cache_shapes(c: ModelConfig, layer: int, max_context: int) -> LayerCache:
    """Shapes (jax.ShapeDtypeStruct) of block `layer`'s cache (trunk or MTP block)."""
    f32 = jnp.float32
    if c.is_recurrent(layer):
        return GDNCache(jax.ShapeDtypeStruct((c.ssm_conv_kernel - 1, c.conv_dim), f32),
                        jax.ShapeDtypeStruct((c.ssm_dt_rank, c.ssm_d_inner // c.ssm_dt_rank, c.ssm_d_state), f32))
    kv = jax.ShapeDtypeStruct((c.n_head_kv, max_context, c.head_dim), f32)
    return AttnCache(kv, kv)


def zeros(shapes):
    """Zero arrays shaped like a pytree of ShapeDtypeStructs (a new sequence: zero KV, so masked
    products are exact zeros, and zero recurrent state, llama.cpp's rs_z rows)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
