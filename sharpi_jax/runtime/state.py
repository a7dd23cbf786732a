"""Explicit decoding state pytrees (all float32; CPU caches stay f32, see DESIGN.md).

`DecodeState` fields are tuples with one array per layer of that kind, in trunk order:
- k, v: per attention layer [Hkv, S, hd], S = max_context (post-norm post-rope K, raw V).
- conv: per GDN layer [Kc-1, C], raw pre-conv qkv of the last Kc-1 tokens, oldest first.
- ssm: per GDN layer [Hv, dv, dk] (ggml's layout: the transpose of HF's [dk, dv] per head).
The committed length (number of positions filled) lives on the host; positions >= length in the KV
cache are stale and always masked. Rollback = choose a GDN snapshot and set the length.

`Snapshots` (from a multi-row recurrent step): conv [T, Kc-1, C] and ssm [T, Hv, dv, dk] per GDN
layer; index t is the state right after row t.

`MTPCache`: the MTP head's own KV cache, k and v [Hkv, S, hd]; its committed length is host-side too
(speculative decoding truncates it together with the trunk's).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sharpi_jax.config import ModelConfig


class DecodeState(NamedTuple):
    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]
    ssm: tuple[jax.Array, ...]


class Snapshots(NamedTuple):
    conv: tuple[jax.Array, ...]
    ssm: tuple[jax.Array, ...]


class MTPCache(NamedTuple):
    k: jax.Array
    v: jax.Array


def init_mtp_cache(c: ModelConfig, max_context: int) -> MTPCache:
    """A zeroed MTP KV cache."""
    shape = (c.n_head_kv, max_context, c.head_dim)
    return MTPCache(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))


def state_shapes(c: ModelConfig, max_context: int) -> DecodeState:
    """Shapes (jax.ShapeDtypeStruct) of a fresh state."""
    f32 = jnp.float32
    kv = jax.ShapeDtypeStruct((c.n_head_kv, max_context, c.head_dim), f32)
    conv = jax.ShapeDtypeStruct((c.ssm_conv_kernel - 1, c.conv_dim), f32)
    ssm = jax.ShapeDtypeStruct((c.ssm_dt_rank, c.ssm_d_inner // c.ssm_dt_rank, c.ssm_d_state), f32)
    n_attn, n_gdn = len(c.attention_layers), len(c.gdn_layers)
    return DecodeState(k=(kv,) * n_attn, v=(kv,) * n_attn, conv=(conv,) * n_gdn, ssm=(ssm,) * n_gdn)


def init_state(c: ModelConfig, max_context: int) -> DecodeState:
    """A zeroed state (a new sequence: llama.cpp's rs_z rows; zero KV so masked products are exact 0)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state_shapes(c, max_context))


def state_bytes(c: ModelConfig, max_context: int) -> int:
    """Memory of one sequence's state."""
    return sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(state_shapes(c, max_context)))
