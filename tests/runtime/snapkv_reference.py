"""Independent references for SnapKV tests (test helpers, no engine runtime code).

- `masked_decode`: greedy-free, teacher-forced decode of a model on the FULL, uncompacted prefill cache
  with the evicted positions masked out by an additive mask (no compaction, no slot map, no shift):
  the engine's modules supply the weights and the GDN / FFN blocks, the attention of every
  full-attention layer is written here (logical positions for RoPE, an explicit -inf bias).
- `window_queries_numpy`: the observation window's post-q-norm, post-RoPE queries of an attention
  layer, recomputed in numpy from the GGUF's own weights (attn_q, attn_q_norm) and the layer's input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sharpi_jax.model.cache import AttnCache, GDNCache
from sharpi_jax.model.layers import rope_neox


def _attention(mixer, a, pos, k_cache, v_cache, allowed):
    """One row a [1, D] at logical position pos over a full cache [Hkv, S, hd] (slot s = position s),
    keys allowed [Hkv, S] bool (besides s <= pos). Returns (out [1, D], k_cache, v_cache)."""
    Hq, Hkv, hd = mixer.n_head, mixer.n_head_kv, mixer.head_dim
    G = Hq // Hkv
    y = mixer.w_qkv(a)
    qg = y[:, : 2 * Hq * hd].reshape(1, Hq, 2, hd)
    q, gate = qg[:, :, 0], qg[:, :, 1]
    k = y[:, 2 * Hq * hd: 2 * Hq * hd + Hkv * hd].reshape(1, Hkv, hd)
    v = y[:, 2 * Hq * hd + Hkv * hd:].reshape(1, Hkv, hd)
    p1 = jnp.reshape(pos, (1,))
    q = rope_neox(mixer.q_norm(q), p1, mixer.n_rot, mixer.rope_base, mixer.rope_freq_scale)
    k = rope_neox(mixer.k_norm(k), p1, mixer.n_rot, mixer.rope_base, mixer.rope_freq_scale)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.transpose(1, 0, 2), (0, pos, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.transpose(1, 0, 2), (0, pos, 0))
    S = k_cache.shape[1]
    ok = allowed & (jnp.arange(S)[None, :] <= pos)  # [Hkv, S]
    bias = jnp.where(ok, 0.0, -jnp.inf).astype(jnp.float32)
    qh = q[0].reshape(Hkv, G, hd)
    s = jnp.einsum("kgd,ksd->kgs", qh, k_cache) / jnp.sqrt(jnp.float32(hd)) + bias[:, None, :]
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("kgs,ksd->kgd", p, v_cache).reshape(1, Hq, hd) * jax.nn.sigmoid(gate)
    return mixer.w_o(o.reshape(1, Hq * hd)), k_cache, v_cache


def masked_decode(model, state, tokens, start, allowed):
    """Teacher-forced decode of `tokens` at positions start, start+1, ... from a full prefill `state`
    (per layer AttnCache without slot_pos / GDNCache); allowed: per attention layer (trunk order) the
    [Hkv, S] bool keys kept (evicted prompt positions False, positions >= start True). Returns the
    logits [len(tokens), V]."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, state, token, pos, allowed):
        m = nnx.merge(graphdef, params)
        x = m.embed(jnp.reshape(token, (1,)))
        new, ai = [], 0
        for blk, c in zip(m.layers, state, strict=True):
            a = blk.attn_norm(x)
            if isinstance(c, GDNCache):
                mix, conv, ssm = blk.mixer.recurrent(a, c.conv, c.ssm, None)
                c = GDNCache(conv[0], ssm[0])
            else:
                assert c.slot_pos is None, "the reference runs on the uncompacted cache"
                mix, k, v = _attention(blk.mixer, a, pos, c.k, c.v, allowed[ai])
                c, ai = AttnCache(k, v), ai + 1
            h = x + mix
            x = h + blk.feed_forward(h, jnp.ones((1,), bool))
            new.append(c)
        return m.lm_head(m.output_norm(x))[0], tuple(new)

    out = []
    for i, t in enumerate(tokens):
        logits, state = step(params, state, jnp.int32(t), jnp.int32(start + i), allowed)
        out.append(np.asarray(logits))
    return np.stack(out)


def allowed_keys(keep: np.ndarray, n: int, S: int) -> np.ndarray:
    """[Hkv, S] bool: the kept prompt positions `keep` [Hkv, m] and every position >= n."""
    a = np.zeros((keep.shape[0], S), bool)
    a[:, n:] = True
    np.put_along_axis(a, keep, True, axis=1)
    return a


def _rms(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_neox(x, positions, n_rot, base, freq_scale):
    half = n_rot // 2
    inv = 1.0 / base ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    th = (positions.astype(np.float64) * freq_scale)[:, None] * inv[None, :]
    cos, sin = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], axis=-1)


def window_queries_numpy(gguf_path, config, layer: int, a: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Post-q-norm post-RoPE queries [W, Hq, hd] (float64) of attention layer `layer` for its normed
    inputs a [W, D] at `positions`, from the GGUF's attn_q ([q_h | gate_h] per head) and attn_q_norm,
    dequantized by gguf-py."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(gguf_path)
    t = {x.name: x for x in r.tensors}

    def tensor(name):
        x = t[name]
        shape = tuple(int(s) for s in reversed(x.shape))  # gguf-py lists ggml's order: innermost first
        return np.asarray(dequantize(x.data, x.tensor_type), np.float64).reshape(shape)

    c = config
    wq = tensor(f"blk.{layer}.attn_q.weight")  # [2 * Hq * hd, D]
    q = (a.astype(np.float64) @ wq.T).reshape(len(a), c.n_head, 2, c.head_dim)[:, :, 0]
    q = _rms(q, tensor(f"blk.{layer}.attn_q_norm.weight"), c.rms_eps)
    return _rope_neox(q, positions, c.n_rot, c.rope_base, c.rope_freq_scale)
