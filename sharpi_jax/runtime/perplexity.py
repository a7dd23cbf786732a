"""Perplexity and KL divergence over a token stream, chunked as llama.cpp's `llama-perplexity` chunks it.

The stream is cut into floor(len / ctx) non-overlapping chunks of ctx tokens (the tail is dropped);
each chunk starts from an empty state (its first token replaced by BOS when the vocab adds one), and
only its second half is scored: the logits at positions first = ctx // 2 .. ctx - 2 predict the tokens
at first + 1 .. ctx - 1, ctx - 1 - first scored tokens per chunk. Perplexity = exp(mean NLL), its
uncertainty sqrt(var(NLL) / (count - 1)) * PPL, as llama-perplexity prints them.

Against a reference model's logits on the same chunks: per scored token KL(reference || model) over the
full vocabulary, and whether both put their top-1 on the same token (llama.cpp's "same top p").

`chunk_logits` runs B chunks at once as one batch of sequences (every chunk is full, ctx tokens from
position 0): the routed experts are grouped over all B * ctx rows.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sharpi_jax.errors import InputError
from sharpi_jax.experts.residency import ExpertCache
from sharpi_jax.runtime.compiled import Graph, jit_factory
from sharpi_jax.runtime.state import init_state
from sharpi_jax.runtime.steps import Runtime

# Percentiles of the per-token KL divergence that llama-perplexity --kl-divergence prints.
KL_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)


def chunks(ids: Sequence[int], ctx: int, n_chunks: int | None = None, bos: int | None = None) -> np.ndarray:
    """The [N, ctx] int32 chunks of `ids`: floor(len / ctx) of them (at most n_chunks), the tail dropped;
    bos: every chunk's first token replaced by it (a vocab that adds BOS). Needs 2 * ctx tokens."""
    if isinstance(ctx, bool) or not isinstance(ctx, (int, np.integer)) or ctx < 4:
        raise InputError(f"ctx must be an integer >= 4, got {ctx!r}")
    ids = np.asarray(ids, np.int32)
    if len(ids) < 2 * ctx:
        raise InputError(f"the text is {len(ids)} tokens: perplexity with a context of {ctx} needs at least "
                         f"{2 * ctx} (as llama-perplexity)")
    n = len(ids) // ctx
    if n_chunks is not None:
        if n_chunks < 1:
            raise InputError(f"n_chunks must be >= 1, got {n_chunks}")
        n = min(n, n_chunks)
    out = ids[:n * ctx].reshape(n, ctx).copy()
    if bos is not None:
        out[:, 0] = bos
    return out


@jit_factory
def _score_fns(graph: Graph) -> dict:
    def logits(params, cache, tokens, first):
        """tokens [N, T] from position 0, each row its own sequence -> logits [N, T - 1 - first, V] of
        positions first .. T - 2."""
        model = graph.merge(params, cache)
        N, T = tokens.shape
        one = init_state(model.config, T)
        state = jax.tree.map(lambda a: jnp.broadcast_to(a[None], (N,) + a.shape), one)
        hidden, _ = model.prefill(state, tokens, jnp.int32(0), jnp.int32(T))
        h = hidden[:, first:T - 1]
        out = model.lm_head(h.reshape(-1, h.shape[-1])).reshape(N, T - 1 - first, -1)
        return out, tuple(jax.tree.leaves(nnx.state(model, ExpertCache)))

    return dict(logits=(logits, dict(static_argnames=("first",), donate_argnums=(1,))))


def chunk_logits(runtime: Runtime, tokens: np.ndarray, first: int) -> np.ndarray:
    """Teacher-forced logits [N, ctx - 1 - first, V] float32 of the scored positions first .. ctx - 2 of
    N chunks [N, ctx], each from an empty state, in one batched pass. One compile per (N, ctx, first)."""
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or not 0 <= first < tokens.shape[1] - 1:
        raise InputError(f"chunk_logits needs chunks [N, ctx] and 0 <= first < ctx - 1, got shape "
                         f"{tokens.shape} and first {first}")
    if tokens.min() < 0 or tokens.max() >= runtime.config.n_vocab:
        raise InputError(f"chunk token ids must lie in [0, {runtime.config.n_vocab})")
    out, runtime.cache = _score_fns(runtime.graph).logits(runtime.params, runtime.cache, tokens, first=int(first))
    return np.asarray(out)


def score_chunks(runtime: Runtime, chunk_ids: np.ndarray, first: int, batch: int = 4,
                 ref_runtime: Runtime | None = None) -> dict:
    """`token_scores` [N, ctx - 1 - first] of every chunk, `batch` chunks per pass (the last pass padded
    with copies of its last chunk, so one program serves every pass); ref_runtime: the reference's
    logits of the same chunks, for KL and top-1 agreement."""
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise InputError(f"batch must be a positive integer, got {batch!r}")
    chunk_ids = np.asarray(chunk_ids, np.int32)
    parts = []
    for i in range(0, len(chunk_ids), batch):
        toks = chunk_ids[i:i + batch]
        n = len(toks)
        padded = np.concatenate([toks, np.repeat(toks[-1:], batch - n, axis=0)]) if n < batch else toks
        logits = chunk_logits(runtime, padded, first)[:n]
        ref = chunk_logits(ref_runtime, padded, first)[:n] if ref_runtime is not None else None
        parts.append(token_scores(logits, toks[:, first + 1:], ref))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis, float64."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_scores(logits: np.ndarray, targets: np.ndarray, ref_logits: np.ndarray | None = None) -> dict:
    """Per scored token: nll [...] (-log p(target)); with ref_logits also ref_nll, kl (KL(ref || model),
    nats) and same_top1 (bool: equal argmax). logits / ref_logits [..., V], targets [...]."""
    lp = log_softmax(logits)
    t = np.asarray(targets)[..., None]
    out = {"nll": -np.take_along_axis(lp, t, -1)[..., 0]}
    if ref_logits is not None:
        if ref_logits.shape != logits.shape:
            raise InputError(f"reference logits {ref_logits.shape} differ in shape from the model's {logits.shape}")
        rp = log_softmax(ref_logits)
        out["ref_nll"] = -np.take_along_axis(rp, t, -1)[..., 0]
        out["kl"] = np.maximum(np.sum(np.exp(rp) * (rp - lp), axis=-1), 0.0)
        out["same_top1"] = np.argmax(logits, -1) == np.argmax(ref_logits, -1)
    return out


def ppl(nll: np.ndarray) -> dict:
    """{"ppl", "ppl_err", "nll", "count"} of per-token NLLs, the error as llama-perplexity computes it."""
    nll = np.asarray(nll, np.float64).ravel()
    n = nll.size
    mean = float(nll.mean())
    var = float(np.mean(nll ** 2) - mean ** 2)
    p = float(np.exp(mean))
    return {"ppl": p, "ppl_err": float(np.sqrt(var / (n - 1)) * p) if n > 1 and var > 0 else 0.0,
            "nll": mean, "count": n}


def summary(scores: dict) -> dict:
    """Perplexity, and with a reference (kl present): the reference's perplexity, the KL divergence's
    mean, its standard error, min / max and KL_PERCENTILES, and top-1 agreement with its error."""
    out = ppl(scores["nll"])
    if "kl" in scores:
        kl = np.asarray(scores["kl"], np.float64).ravel()
        same = np.asarray(scores["same_top1"], np.float64).ravel()
        n = kl.size
        ref = ppl(scores["ref_nll"])
        out.update(ref_ppl=ref["ppl"], ref_ppl_err=ref["ppl_err"], ppl_ratio=out["ppl"] / ref["ppl"],
                   kl_mean=float(kl.mean()), kl_err=float(kl.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0,
                   kl_max=float(kl.max()), kl_min=float(kl.min()),
                   kl_percentiles={str(q): float(np.percentile(kl, q)) for q in KL_PERCENTILES},
                   top1_agreement=float(same.mean()),
                   top1_agreement_err=float(np.sqrt(same.mean() * (1 - same.mean()) / (n - 1))) if n > 1 else 0.0)
    return out


def bucket_bounds(first: int, ctx: int, n_buckets: int) -> list[tuple[int, int]]:
    """n_buckets contiguous ranges [lo, hi) of the scored positions first .. ctx - 2, near-equal sizes
    (fewer when there are fewer positions)."""
    n = ctx - 1 - first
    k = max(1, min(int(n_buckets), n))
    edges = [first + round(i * n / k) for i in range(k + 1)]
    return [(edges[i], edges[i + 1]) for i in range(k)]


def by_position(scores: dict, first: int, ctx: int, n_buckets: int) -> list[dict]:
    """`summary` per bucket of chunk positions (scores [N, ctx - 1 - first] per key); each adds its
    positions [lo, hi) (the position of the logits row: it predicts the token at position + 1)."""
    rows = []
    for lo, hi in bucket_bounds(first, ctx, n_buckets):
        part = {k: np.asarray(v)[:, lo - first:hi - first] for k, v in scores.items()}
        rows.append({"positions": [lo, hi], **summary(part)})
    return rows


__all__ = ["KL_PERCENTILES", "bucket_bounds", "by_position", "chunk_logits", "chunks", "log_softmax", "ppl",
           "score_chunks", "summary", "token_scores"]
