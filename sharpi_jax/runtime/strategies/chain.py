"""The MTP chain: k drafts per trunk pass from the MTP head, verified in one pass (the algorithm and
its decoder: `speculative`). `generate_mtp` (the host loop over `speculative.MTPDecoder`),
`generate_mtp_device` (every pass on the device: `jitted_loop`, its pass `_body`, on the `device_loop`
skeleton) and `ChainStrategy`, both behind `base.Strategy`.

On the device the verify width is K + 1 rows (K = draft_tokens); the number of drafts of a pass, the
committed length P, the MTP catch-up rows and the rollback index are device scalars. A pass drafts
min(k, room) tokens, room being what is left of max_context and, on a SnapKV-compacted cache, of its
slots (as `decoder.Decoder.room`).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Collection, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime import kv_eviction
from sharpi_jax.runtime.compiled import derived_cache
from sharpi_jax.runtime.decoder import generate_passes
from sharpi_jax.runtime.device_loop import (STOP_REASONS, drive, eos_array, first_token, jit_loop, lazy_walk,
                                            out_slots, pass_stop, picker, row_targets)
from sharpi_jax.runtime.draft_vocab import DraftVocab
from sharpi_jax.runtime.generate import Generation, timing_stats
from sharpi_jax.runtime.mtp import MTPRuntime
from sharpi_jax.runtime.options import drafter_p_min
from sharpi_jax.runtime.passes import pass_stats
from sharpi_jax.runtime.sampling import SamplingParams, traced_params
from sharpi_jax.runtime.speculative import MTPDecoder
from sharpi_jax.runtime.state import first_snapshots
from sharpi_jax.runtime.steps import Runtime
from sharpi_jax.runtime.strategies.base import Strategy


def generate_mtp(runtime: Runtime, mtp: MTPRuntime, prompt: Sequence[int], max_new_tokens: int,
                 sampling: SamplingParams, stop_ids: Collection[int] = (), draft_tokens: int = 3,
                 verify: str = "batched", width: int | None = None, full_rows: bool = False,
                 trace: list | None = None, zero_h_first: bool = False, kv: SnapKV | None = None,
                 mtp_kv: str = "snapkv", vocab: DraftVocab | None = None, p_min: float | None = None,
                 resume=None) -> Generation:
    """Speculative generation; the tokens are those of `plain.generate_ids` with the same arguments
    (kv: the same SnapKV eviction; mtp_kv: evict the MTP head's KV too, or keep it whole).

    stats: those of `generate_ids` (prompt_tokens, generated_tokens, prefill_s, prefill_tok_s (trunk +
    MTP prompt processing), decode_s, decode_tok_s, stop_reason) plus speculative, draft_tokens,
    verify, drafted (draft tokens verified), accepted, verify_passes, acceptance_rate
    (accepted / drafted), mean_accept_len (mean over passes of accepted drafts + 1 = tokens per
    trunk pass), accept_per_position (k fractions: position i accepted, over the passes that drafted
    it), draft_s and verify_s (MTP vs trunk time; the rest of decode_s is host bookkeeping), kv_slots,
    kv_evicted, kv_capacity (`kv_eviction.kv_stats`).
    """
    t0 = time.perf_counter()
    capacity = kv_eviction.kv_capacity(kv, max_new_tokens, runtime.max_context)
    dec = MTPDecoder(runtime, mtp, draft_tokens, verify, width, full_rows, trace, zero_h_first, kv, capacity, mtp_kv,
                     vocab, p_min)
    dec.resume = resume  # a session's continued prefill (`session.Resume`)
    out, stats, _ = generate_passes(dec, prompt, max_new_tokens, sampling, stop_ids, "accept_per_position", t0)
    return Generation(out, {**stats, "speculative": "mtp", "draft_tokens": dec.k, "verify": verify,
                            "draft_vocab": None if vocab is None else vocab.size, "draft_p_min": p_min,
                            **kv_eviction.kv_stats(dec.evicted, dec.P, runtime.max_context)})


class _Loop(NamedTuple):
    """What the chain loop's passes read besides the carry: the step functions, their params, the run's
    scalars (device arrays) and its static K (verify rows K + 1) and greedy; rows = arange(K + 1);
    head_row: the LM head on one row (`RunConfig.verify_head` lazy), None: the pass computes every row's."""

    commit_verify: Callable
    draft: Callable
    params: Any
    mtp_params: Any
    mtp_off: Any
    k: Any
    max_new: Any
    max_context: Any
    slot_room: Any
    eos: Any
    vocab: Any
    p_min: Any
    K: int
    greedy: bool
    rows: Any
    head_row: Callable | None


def _init(e: _Loop, cache, buffers, state, mtp_cache, logits, h_last, P, sampling, out) -> dict:
    """The carry after the prefill: the first token emitted, no pass yet. buffers: snapshot buffers to
    reuse (`Runtime.snapshot_buffers`), None: new ones."""
    K = e.K
    D = h_last.shape[0]
    tok, stop = first_token(e.greedy, sampling, logits, P, e.eos, e.max_new, e.max_context)
    zi = jnp.int32(0)
    counts = jnp.zeros((K + 1,), jnp.int32)  # per draft position i = 1..K (index 0 unused)
    return dict(
        cache=cache, state=state, mtp_cache=mtp_cache,
        snaps=first_snapshots(state, K + 1, buffers), a_prev=zi,
        vt=jnp.zeros((K + 1,), jnp.int32), n_pend=zi, pend_start=P, h_prev=h_last,
        hidden=jnp.zeros((K + 1, D), jnp.float32), t=tok, P=P, n_out=jnp.int32(1), out=out.at[0].set(tok),
        stop=stop, passes=zi, drafted=zi, accepted=zi, tried=counts, hit=counts, sampling=sampling)


def _draft_verify(e: _Loop, c: dict) -> tuple:
    """A pass's drafts and its verify: (vtokens [t, d1..dK], MTP cache, h_t, n_draft, the verify's
    outputs, the trunk's residency cache)."""
    P, live = c["P"], c["stop"] == 0  # live False: a stopped sequence of a batch (padding rows)
    n_draft = jnp.minimum(e.k, jnp.minimum(e.max_context - 1 - P, e.slot_room - P))
    # MTP catch-up rows (the previous pass's certain token and accepted drafts), then t.
    toks = jnp.concatenate([jnp.where(e.rows < c["n_pend"], c["vt"], 0), jnp.zeros((1,), jnp.int32)])
    toks = toks.at[c["n_pend"]].set(c["t"])
    vtokens, mtp_cache, h_t, n_made = e.draft(e.mtp_params, c["mtp_cache"], toks, c["h_prev"], c["hidden"],
                                              c["pend_start"] - e.mtp_off, c["n_pend"] + 1,
                                              jnp.maximum(n_draft, 1), e.vocab, e.p_min, live)
    n_draft = jnp.minimum(n_draft, n_made)  # draft_p_min may stop the chain early
    v, cache = e.commit_verify(e.params, c["cache"], c["state"], c["snaps"], c["a_prev"], vtokens, P,
                               (n_draft + 1) * live, head=e.head_row is None)
    return vtokens, mtp_cache, h_t, n_draft, v, cache


def _body(e: _Loop, c: dict) -> dict:
    """One pass: draft, verify, accept the leading drafts that match, emit target[0..a] up to a stop."""
    K, rows, P = e.K, e.rows, c["P"]
    vtokens, mtp_cache, h_t, n_draft, v, cache = _draft_verify(e, c)
    logits, greedy_rows, hidden, state, snaps = v
    if e.head_row is None:
        target = row_targets(e.greedy, c["sampling"], logits, greedy_rows, c["n_out"], lambda r: r, K + 1)
        match = (rows[:K] < n_draft) & (target[:K] == vtokens[1:])
        a = jnp.sum(jnp.cumprod(match.astype(jnp.int32)))
    else:  # the head of rows 0..a only (a: the accepted drafts), one row at a time
        pick, index = picker(e.greedy, c["sampling"]), c["n_out"] - 1
        _, a, _, target = lazy_walk(
            lambda r: e.head_row(e.params, cache, hidden, r), lambda logits_r, r: pick(logits_r, index + r + 1),
            lambda r, tok: ((r < n_draft) & (vtokens[jnp.minimum(r + 1, K)] == tok), r + 1), K + 1, K)
    # Emit target[0..a] (the accepted drafts are the targets of their rows) up to a stop.
    n_out = c["n_out"]
    stop, any_stop, j, P_new = pass_stop(target, a, n_out, P, rows, e.eos, e.max_new, e.max_context)
    pos_i = rows[1:]  # draft positions 1..K
    return dict(
        cache=cache, state=state, mtp_cache=mtp_cache, snaps=snaps, a_prev=a,
        vt=vtokens, n_pend=a + 1, pend_start=P, h_prev=h_t, hidden=hidden, t=target[a], P=P_new,
        n_out=n_out + jnp.where(any_stop, j + 1, a + 1),
        out=jax.lax.dynamic_update_slice(c["out"], target, (n_out,)), stop=stop.astype(jnp.int32),
        passes=c["passes"] + 1, drafted=c["drafted"] + n_draft, accepted=c["accepted"] + a,
        tried=c["tried"].at[1:].add((n_draft >= pos_i).astype(jnp.int32)),
        hit=c["hit"].at[1:].add((a >= pos_i).astype(jnp.int32)), sampling=c["sampling"])


def _fin(c: dict, back: bool = False) -> tuple:
    """The loop's results; back (one sequence): its donated buffers too (state, MTP cache: aliased, so
    never copied into the loop's own; snapshots: for the next loop to reuse)."""
    counts = dict(passes=c["passes"], drafted=c["drafted"], accepted=c["accepted"], tried=c["tried"][1:],
                  hit=c["hit"][1:])
    out = (c["out"], c["n_out"], c["stop"], c["P"], counts, c["cache"])
    return out + ((c["state"], c["mtp_cache"], c["snaps"]),) if back else out


@derived_cache
def jitted_loop(commit_verify, draft, batch: bool = False, head_row=None):
    """The jitted MTP chain loop over one model graph's `commit_verify` and one head's `draft` (batch: over
    a batch of sequences; head_row: that graph's `head_row` for a lazy LM head, one sequence only). One
    sequence: the state, the MTP cache and the snapshot buffers (`Runtime.snapshot_buffers`) donated; they
    come back as a last result."""

    def run(params, cache, mtp_params, state, mtp_cache, logits, h_last, P, mtp_off, k, max_new, max_context,
            slot_room, eos, sampling, out, vocab, p_min, buffers, K, greedy):
        rows = jnp.arange(K + 1, dtype=jnp.int32)
        e = _Loop(commit_verify, draft, params, mtp_params, mtp_off, k, max_new, max_context, slot_room, eos, vocab,
                  p_min, K, greedy, rows, head_row)
        return drive(functools.partial(_init, e, cache, buffers), functools.partial(_body, e),
                     functools.partial(_fin, back=not batch), (state, mtp_cache, logits, h_last, P, sampling, out),
                     batch)

    return jit_loop(run, batch, ("K", "greedy"), donate=("state", "mtp_cache", "buffers"))


def generate_mtp_device(runtime: Runtime, mtp: MTPRuntime, prompt: Sequence[int], max_new_tokens: int,
                        sampling: SamplingParams, stop_ids: Collection[int] = (), draft_tokens: int = 3,
                        kv: SnapKV | None = None, mtp_kv: str = "snapkv", zero_h_first: bool = False,
                        vocab: DraftVocab | None = None, p_min: float | None = None, resume=None) -> Generation:
    """`generate_mtp` with batched verify (same arguments, tokens and stats except draft_s / verify_s,
    which one device program cannot split; plus loop="device") with every pass on the device."""
    t0 = time.perf_counter()
    capacity = kv_eviction.kv_capacity(kv, max_new_tokens, runtime.max_context)
    dec = MTPDecoder(runtime, mtp, draft_tokens, "batched", zero_h_first=zero_h_first, kv=kv, kv_capacity=capacity,
                     mtp_kv=mtp_kv, vocab=vocab, p_min=p_min)
    dec.resume = resume
    logits = dec.prefill(prompt)
    t1 = time.perf_counter()
    K, P = dec.K, dec.P
    if max_new_tokens <= 0:
        tokens, stop, counts = [], "max_new_tokens", None
    else:
        slot_room = dec.last_position()  # slot_room - P: the drafts the caches' slots still hold
        fn = jitted_loop(runtime.steps.commit_verify, mtp.draft_fn, False,
                         runtime.steps.head_row if runtime.lazy_head_for(K + 1) else None)
        out, n, code, end, counts, runtime.cache, (_, _, buffers) = fn(
            runtime.params, runtime.cache, mtp.params, dec.state, dec.cache, logits, dec.h_prev, np.int32(P),
            np.int32(dec.mtp_offset), np.int32(dec.k), np.int32(max_new_tokens),
            np.int32(runtime.max_context), np.int32(slot_room), eos_array(stop_ids), traced_params(sampling),
            np.zeros(out_slots(max_new_tokens, K), np.int32), vocab, None if p_min is None else np.float32(p_min),
            runtime.snapshot_buffers(dec.state, K + 1), K=K, greedy=sampling.greedy)
        runtime.keep_snapshot_buffers(buffers)
        out, n, code, P, counts = jax.device_get((out, n, code, end, counts))
        tokens, stop, P = [int(x) for x in out[:int(n)]], STOP_REASONS[int(code)], int(P)
    t2 = time.perf_counter()
    stats = {
        **timing_stats(len(prompt), len(tokens), t0, t1, t2, stop),
        "speculative": "mtp",
        "draft_tokens": dec.k,
        "verify": "batched",
        "draft_vocab": None if vocab is None else vocab.size,
        "draft_p_min": p_min,
        **pass_stats(dec.k, counts, "accept_per_position"),
        **kv_eviction.kv_stats(dec.evicted, P, runtime.max_context),
        "loop": "device",
    }
    return Generation(tokens, stats)


class ChainStrategy(Strategy):
    """The MTP chain (`GenerateOptions.speculation` a `Chain`): `generate_mtp`, `generate_mtp_device`."""

    def host(self, runtime, mtp, ids, opts, stop_ids=(), kv=None, vocab=None, resume=None) -> Generation:
        return generate_mtp(runtime, mtp, ids, opts.max_new_tokens, opts.sampling, stop_ids, opts.speculation.k,
                            opts.verify, kv=kv, vocab=vocab, p_min=drafter_p_min(opts), resume=resume)

    def device(self, runtime, mtp, ids, opts, stop_ids=(), kv=None, vocab=None, resume=None) -> Generation:
        return generate_mtp_device(runtime, mtp, ids, opts.max_new_tokens, opts.sampling, stop_ids,
                                   opts.speculation.k, kv=kv, vocab=vocab, p_min=drafter_p_min(opts), resume=resume)
