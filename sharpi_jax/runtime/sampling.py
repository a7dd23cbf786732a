"""Token selection: greedy, and seeded temperature / top-k / top-p / min-p sampling.

Order (as Hugging Face's generate): logits / temperature, then top-k, top-p and min-p filters on the
tempered distribution, then a categorical draw. The key of generated token i is
`fold_in(key(seed), i)`, a function of the seed and the token's index only, so a speculative loop that
samples the same index from the same logits draws the same token as plain decoding.
All parameters are traced scalars: one compile serves every setting.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.errors import InputError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off; min_p 0 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self):
        def bad(msg):
            raise InputError(f"invalid sampling option: {msg}")

        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or not np.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
        for name in ("top_k", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                bad(f"{name} must be an integer, got {v!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.seed < 2 ** 32:
            bad(f"seed must be in [0, 2^32), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: jax.Array, temperature, top_k, top_p, min_p) -> jax.Array:
    """Tempered logits [V] with the tokens outside top-k / top-p / min-p set to -inf (ties kept)."""
    V = logits.shape[-1]
    x = logits / temperature
    desc = jnp.sort(x)[::-1]
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    x = jnp.where(x >= desc[k - 1], x, -jnp.inf)
    # top-p: keep the shortest prefix of the sorted (top-k) distribution whose mass reaches top_p.
    p = jax.nn.softmax(jnp.where(jnp.arange(V) < k, desc, -jnp.inf))
    before = jnp.cumsum(p) - p
    n_keep = jnp.maximum(jnp.sum((before < top_p) | (top_p >= 1.0)), 1)
    x = jnp.where(x >= desc[jnp.minimum(n_keep, k) - 1], x, -jnp.inf)
    # min-p: p >= min_p * p_max  <=>  x >= x_max + log(min_p).
    x = jnp.where((min_p <= 0.0) | (x >= desc[0] + jnp.log(jnp.maximum(min_p, 1e-30))), x, -jnp.inf)
    return x


def draw(logits, seed, index, temperature, top_k, top_p, min_p):
    """The sampled token (int32) of generated index `index` from logits [V]: traceable, the one rule
    both the host loop (`sample`) and the device loop (`device_loop`) run."""
    key = jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), index)
    x = filter_logits(logits.astype(jnp.float32), temperature, top_k, top_p, min_p)
    return jax.random.categorical(key, x).astype(jnp.int32)


# From this many logits a row, greedy tokens on the CPU come from the extension's one-pass argmax.
NATIVE_ARGMAX_FROM = 4096


def argmax(logits):
    """The greedy token(s): argmax over the last axis (lowest index on ties, the first NaN if any), int32;
    traceable. jnp.argmax's result. On the CPU, rows of `NATIVE_ARGMAX_FROM` float32 logits or more take the
    native extension's one pass (csrc/argmax.h): XLA:CPU spends ~4.5 ms on the two reductions below for a
    verify pass of 8 248k-token rows, most of what a pass adds beyond its products. Elsewhere, a max and then
    the lowest index holding it: two plain reductions that XLA vectorizes, where its (value, index) pair
    reduction takes ~1.2 ms for one 248k-token row here (0.3 ms this way)."""
    if _native_argmax(logits):
        return jax.ffi.ffi_call("sharpi_argmax", jax.ShapeDtypeStruct(logits.shape[:-1], jnp.int32),
                                vmap_method="broadcast_all")(logits)
    top = jnp.max(logits, axis=-1, keepdims=True)
    at = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = (logits == top) | jnp.isnan(logits)  # a NaN anywhere makes `top` NaN: its first index, as argmax
    return jnp.min(jnp.where(hit, at, logits.shape[-1]), axis=-1).astype(jnp.int32)


def _native_argmax(logits) -> bool:
    """Whether `argmax` takes the extension's kernel: float32 rows of NATIVE_ARGMAX_FROM or more, at least
    one row, JAX on the CPU, the extension loaded."""
    from sharpi_jax.quant import ggml

    return (logits.dtype == jnp.float32 and logits.ndim >= 1 and logits.shape[-1] >= NATIVE_ARGMAX_FROM
            and logits.size > 0 and jax.default_backend() == "cpu" and ggml.available())


_sample = jax.jit(draw)
_greedy = jax.jit(argmax)


def traced_params(params: SamplingParams) -> tuple:
    """(seed, temperature, top_k, top_p, min_p) as the typed scalars `draw` takes."""
    return (np.uint32(params.seed), np.float32(params.temperature), np.int32(params.top_k),
            np.float32(params.top_p), np.float32(params.min_p))


def sample(logits: jax.Array, params: SamplingParams, index: int) -> jax.Array:
    """The token (int32 scalar array) for generated index `index` from logits [V]."""
    if params.greedy:
        return _greedy(logits)
    seed, temperature, top_k, top_p, min_p = traced_params(params)
    return _sample(logits, seed, np.int32(index), temperature, top_k, top_p, min_p)


def sample_rows(logits: jax.Array, params: SamplingParams, first_index: int) -> jax.Array:
    """Tokens for rows [R, V] with generated indices first_index + r (for verify rows)."""
    return jnp.stack([sample(logits[r], params, first_index + r) for r in range(logits.shape[0])])
