"""The generation loop: bucketed prefill, then one decode step per token; stop on EOS, budget or context."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Collection, NamedTuple, Sequence

import jax

from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime import kv_eviction
from sharpi_jax.runtime.sampling import SamplingParams, sample
from sharpi_jax.runtime.steps import Runtime


class Generation(NamedTuple):
    """What every generation loop returns: the generated token ids (not the prompt) and the run's stats."""

    tokens: list[int]
    stats: dict[str, Any]


@dataclasses.dataclass
class GenerateOutput:
    """tokens/text: the generated part only (not the prompt); stats: timings and counts."""

    tokens: list[int]
    text: str
    stats: dict[str, Any]


def generate_ids(runtime: Runtime, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                 stop_ids: Collection[int] = (), kv: SnapKV | None = None, resume=None) -> Generation:
    """Generate up to max_new_tokens after `prompt` (validated by the caller). Returns `Generation(tokens, stats)`.
    kv: SnapKV eviction at prefill (`kv_eviction`; None: keep every position); resume: a session's
    `session.Resume` (the prefill continued from its saved state; every loop takes it).

    stats: prompt_tokens, generated_tokens, prefill_s, prefill_tok_s, decode_s, decode_tok_s
    (generated tokens per second after the prefill, sampling included), stop_reason
    ("eos" | "max_new_tokens" | "max_context"), kv_slots, kv_evicted, kv_capacity (`kv_eviction.kv_stats`).
    """
    t0 = time.perf_counter()
    capacity = kv_eviction.kv_capacity(kv, max_new_tokens, runtime.max_context)
    _, logits, state, evicted = kv_eviction.prefill(runtime, prompt, kv, capacity, resume)
    logits.block_until_ready()
    t1 = time.perf_counter()
    pos, out, stop = len(prompt), [], "max_new_tokens"
    stop_ids = frozenset(stop_ids)
    for i in range(max_new_tokens):
        tok = int(sample(logits, sampling, i))
        out.append(tok)
        if tok in stop_ids:
            stop = "eos"
            break
        if i == max_new_tokens - 1:
            break
        if pos >= runtime.max_context:
            stop = "max_context"
            break
        logits, _, state = runtime.decode_step(state, tok, pos)
        pos += 1
    jax.block_until_ready(logits)
    t2 = time.perf_counter()
    stats = timing_stats(len(prompt), len(out), t0, t1, t2, stop if max_new_tokens > 0 else "max_new_tokens")
    return Generation(out, {**stats, **kv_eviction.kv_stats(evicted, pos, runtime.max_context)})


def timing_stats(n_prompt: int, n_out: int, t0: float, t1: float, t2: float, stop: str) -> dict[str, Any]:
    """The stats every generation loop reports: prefill from t0 to t1, decode from t1 to t2."""
    prefill_s, decode_s = t1 - t0, t2 - t1
    return {
        "prompt_tokens": n_prompt,
        "generated_tokens": n_out,
        "prefill_s": prefill_s,
        "prefill_tok_s": n_prompt / prefill_s if prefill_s > 0 else float("inf"),
        "decode_s": decode_s,
        "decode_tok_s": n_out / decode_s if decode_s > 0 and n_out else 0.0,
        "stop_reason": stop,
    }
