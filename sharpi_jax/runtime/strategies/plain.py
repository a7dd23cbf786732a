"""MTP off: one decode step per token. `generate_ids` (the host loop: bucketed prefill, then one decode
step per token; stop on EOS, budget or context), `generate_ids_device` (the same loop as one jitted
program: `jitted_loop`, on the `device_loop` skeleton) and `PlainStrategy`, both behind `base.Strategy`."""

from __future__ import annotations

import time
from typing import Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime import kv_eviction
from sharpi_jax.runtime.compiled import derived_cache
from sharpi_jax.runtime.device_loop import (STOP_REASONS, drive, eos_array, first_token, jit_loop, out_slots,
                                            picker, stop_code)
from sharpi_jax.runtime.generate import Generation, timing_stats
from sharpi_jax.runtime.sampling import SamplingParams, sample, traced_params
from sharpi_jax.runtime.steps import Runtime
from sharpi_jax.runtime.strategies.base import Strategy


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


@derived_cache
def jitted_loop(decode, batch: bool = False):
    """The jitted decode loop over one model graph's `decode` step (batch: over a batch of sequences)."""

    def run(params, cache, state, logits, pos, max_new, max_context, eos, sampling, out, greedy):
        def init(state, logits, pos, sampling, out):
            tok, stop = first_token(greedy, sampling, logits, pos, eos, max_new, max_context)
            return dict(cache=cache, state=state, pos=pos, i=jnp.int32(0), tok=tok, out=out.at[0].set(tok),
                        stop=stop, sampling=sampling)

        def body(c):
            step, cache = decode(params, c["cache"], c["state"], c["tok"], c["pos"], c["stop"] == 0)
            pos, i = c["pos"] + 1, c["i"] + 1
            tok = picker(greedy, c["sampling"])(step.logits, i)
            stop = stop_code(tok, eos, i + 1, max_new)
            stop = jnp.where((stop == 0) & (pos >= max_context), 3, stop)
            return dict(cache=cache, state=step.state, pos=pos, i=i, tok=tok, out=c["out"].at[i].set(tok),
                        stop=stop, sampling=c["sampling"])

        def fin(c):  # c["cache"]: the residency cache, threaded through the steps (empty for a batch)
            # One sequence: the donated state comes back too (aliased: no copy into the loop's buffers).
            return (c["out"], c["i"] + 1, c["stop"], c["pos"], c["cache"]) + (() if batch else (c["state"],))

        return drive(init, body, fin, (state, logits, pos, sampling, out), batch)

    return jit_loop(run, batch, ("greedy",), donate=("state",))


def generate_ids_device(runtime: Runtime, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                        stop_ids: Collection[int] = (), kv: SnapKV | None = None, resume=None) -> Generation:
    """`generate_ids` (same arguments, tokens and stats, plus loop="device") with the decode loop on the
    device."""
    t0 = time.perf_counter()
    capacity = kv_eviction.kv_capacity(kv, max_new_tokens, runtime.max_context)
    _, logits, state, evicted = kv_eviction.prefill(runtime, prompt, kv, capacity, resume)
    logits.block_until_ready()
    t1 = time.perf_counter()
    pos = len(prompt)
    if max_new_tokens <= 0:
        tokens, stop = [], "max_new_tokens"
    else:
        fn = jitted_loop(runtime.steps.decode)
        out, n, code, end, runtime.cache, _ = fn(
            runtime.params, runtime.cache, state, logits, np.int32(pos), np.int32(max_new_tokens),
            np.int32(runtime.max_context), eos_array(stop_ids), traced_params(sampling),
            np.zeros(out_slots(max_new_tokens), np.int32), greedy=sampling.greedy)
        out, n, code, pos = jax.device_get((out, n, code, end))
        tokens, stop = [int(x) for x in out[:int(n)]], STOP_REASONS[int(code)]
    t2 = time.perf_counter()
    stats = timing_stats(len(prompt), len(tokens), t0, t1, t2, stop)
    return Generation(tokens, {**stats, **kv_eviction.kv_stats(evicted, int(pos), runtime.max_context),
                               "loop": "device"})


class PlainStrategy(Strategy):
    """MTP off (`GenerateOptions.speculation` None): `generate_ids`, `generate_ids_device`."""

    def host(self, runtime, mtp, ids, opts, stop_ids=(), kv=None, vocab=None, resume=None) -> Generation:
        return generate_ids(runtime, ids, opts.max_new_tokens, opts.sampling, stop_ids, kv, resume)

    def device(self, runtime, mtp, ids, opts, stop_ids=(), kv=None, vocab=None, resume=None) -> Generation:
        return generate_ids_device(runtime, ids, opts.max_new_tokens, opts.sampling, stop_ids, kv, resume)
