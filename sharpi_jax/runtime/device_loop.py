"""Generation as ONE jitted program per run: the decode loop (MTP off), the MTP chain loop (draft,
verify, accept, rollback, emit, stop) and the MTP tree loop (draft a tree, verify it in one pass, take
the longest accepted path: `tree_device`) each run as a `lax.while_loop` on the device after the prefill.

The host loops (`generate.generate_ids`, `speculative.generate_mtp`, `tree.generate_tree`) are the
sequential reference;
these run the same jitted step functions (nested in the loop body), the same sampling rule
(`sampling.draw` with the key of each generated-token index) and the same stop order (an EOS set,
max_new_tokens, then the context end), so they give the same tokens bit for bit
(`tests/runtime/test_device_loop.py`). The host receives the tokens once, at the end.

Shapes are static per compile: the output buffer holds `out_slots(max_new_tokens, K)` tokens
(rounded up to a power of two, so nearby lengths share a compile), the verify width is K + 1 rows
(K = draft_tokens), and the number of drafts of a pass, the committed length P, the MTP catch-up rows
and the rollback index are device scalars. A pass drafts min(k, room) tokens, room being what is left
of max_context and, on a SnapKV-compacted cache, of its slots (as `decoder.Decoder.room`).
"""

from __future__ import annotations

import time
from typing import Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime import kv_eviction, tree_device
from sharpi_jax.runtime.compiled import derived_cache
from sharpi_jax.runtime.draft_vocab import DraftVocab
from sharpi_jax.runtime.generate import Generation, timing_stats
from sharpi_jax.runtime.sampling import SamplingParams, argmax, draw, traced_params
from sharpi_jax.runtime.mtp import MTPRuntime
from sharpi_jax.runtime.passes import pass_counts, pass_stats
from sharpi_jax.runtime.speculative import MTPDecoder
from sharpi_jax.runtime.state import repeat_as_snapshots
from sharpi_jax.runtime.steps import Runtime
from sharpi_jax.runtime.tree import TreeDecoder, snapshot_bytes_per_node

STOP_REASONS = (None, "eos", "max_new_tokens", "max_context")  # index = the loop's stop code


def out_slots(max_new_tokens: int, width: int = 0) -> int:
    """Output buffer length: max_new_tokens + width + 1 (a pass may emit width + 1 tokens), rounded up
    to a power of two (>= 64, so short runs share one compile)."""
    need = int(max_new_tokens) + int(width) + 1
    return max(64, 1 << (need - 1).bit_length())


def _eos_array(stop_ids: Collection[int]) -> np.ndarray:
    ids = sorted(int(i) for i in stop_ids)
    return np.array(ids or [-1], np.int32)  # -1: no token id matches


def _picker(greedy: bool, sampling):
    """token(logits [V], generated index) with the host loop's rule."""
    if greedy:
        return lambda logits, i: argmax(logits)
    seed, temperature, top_k, top_p, min_p = sampling
    return lambda logits, i: draw(logits, seed, i, temperature, top_k, top_p, min_p)


def _stop_code(tok, eos, n_out, max_new):
    """After emitting tok as the n_out-th token: 1 (EOS), 2 (max_new_tokens) or 0."""
    return jnp.where(jnp.any(tok == eos), 1, jnp.where(n_out == max_new, 2, 0)).astype(jnp.int32)


def _first_token(greedy: bool, sampling, logits, pos, eos, max_new, max_context):
    """(the token after the prefill, its stop code: EOS, max_new_tokens, then the context end at pos)."""
    tok = _picker(greedy, sampling)(logits, jnp.int32(0))
    stop = _stop_code(tok, eos, 1, max_new)
    return tok, jnp.where((stop == 0) & (pos >= max_context), 3, stop)


# Carry fields a stopped sequence of a batch may let go stale: the big state, never read after it stops.
_STALE_OK = frozenset({"cache", "state", "mtp_cache", "snaps"})


def _drive(init, body, fin, per_seq: tuple, batch: bool):
    """The generation loop: carry = init(*per_seq), then body while carry["stop"] == 0, then fin(carry).

    batch (a batch of sequences, `runtime.batch`; per_seq arrays with a leading sequence axis): init, body
    and fin run under jax.vmap, and the loop runs while any sequence is live. A stopped sequence's body
    runs with `live` False (its rows are padding rows) and only its small fields are held (a select per
    field); the big state (_STALE_OK) is left as the padding step leaves it, as nothing reads it after
    the stop. (vmap of a while_loop would instead select the whole carry, KV caches and GDN snapshots
    included, every step.)"""
    if not batch:
        return fin(jax.lax.while_loop(lambda c: c["stop"] == 0, body, init(*per_seq)))

    def step(c):
        new, live = jax.vmap(body)(c), c["stop"] == 0
        hold = lambda a, b: jnp.where(live.reshape(live.shape + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
        return {k: v if k in _STALE_OK else jax.tree.map(hold, v, c[k]) for k, v in new.items()}

    c = jax.lax.while_loop(lambda c: jnp.any(c["stop"] == 0), step, jax.vmap(init)(*per_seq))
    return jax.vmap(fin)(c)


@derived_cache
def _plain_fn(decode, batch: bool = False):
    """The jitted decode loop over one model graph's `decode` step (batch: over a batch of sequences)."""

    def run(params, cache, state, logits, pos, max_new, max_context, eos, sampling, out, greedy):
        def init(state, logits, pos, sampling, out):
            tok, stop = _first_token(greedy, sampling, logits, pos, eos, max_new, max_context)
            return dict(cache=cache, state=state, pos=pos, i=jnp.int32(0), tok=tok, out=out.at[0].set(tok),
                        stop=stop, sampling=sampling)

        def body(c):
            step, cache = decode(params, c["cache"], c["state"], c["tok"], c["pos"], c["stop"] == 0)
            pos, i = c["pos"] + 1, c["i"] + 1
            tok = _picker(greedy, c["sampling"])(step.logits, i)
            stop = _stop_code(tok, eos, i + 1, max_new)
            stop = jnp.where((stop == 0) & (pos >= max_context), 3, stop)
            return dict(cache=cache, state=step.state, pos=pos, i=i, tok=tok, out=c["out"].at[i].set(tok),
                        stop=stop, sampling=c["sampling"])

        def fin(c):  # c["cache"]: the residency cache, threaded through the steps (empty for a batch)
            return c["out"], c["i"] + 1, c["stop"], c["pos"], c["cache"]

        return _drive(init, body, fin, (state, logits, pos, sampling, out), batch)

    return jax.jit(run, donate_argnums=() if batch else (1,), static_argnames=("greedy",))


def generate_ids_device(runtime: Runtime, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                        stop_ids: Collection[int] = (), kv: SnapKV | None = None, resume=None) -> Generation:
    """`generate.generate_ids` (same arguments, tokens and stats, plus loop="device") with the decode
    loop on the device."""
    t0 = time.perf_counter()
    capacity = kv_eviction.kv_capacity(kv, max_new_tokens, runtime.max_context)
    _, logits, state, evicted = kv_eviction.prefill(runtime, prompt, kv, capacity, resume)
    logits.block_until_ready()
    t1 = time.perf_counter()
    pos = len(prompt)
    if max_new_tokens <= 0:
        tokens, stop = [], "max_new_tokens"
    else:
        fn = _plain_fn(runtime.steps.decode)
        out, n, code, end, runtime.cache = fn(
            runtime.params, runtime.cache, state, logits, np.int32(pos), np.int32(max_new_tokens),
            np.int32(runtime.max_context), _eos_array(stop_ids), traced_params(sampling),
            np.zeros(out_slots(max_new_tokens), np.int32), greedy=sampling.greedy)
        out, n, code, pos = jax.device_get((out, n, code, end))
        tokens, stop = [int(x) for x in out[:int(n)]], STOP_REASONS[int(code)]
    t2 = time.perf_counter()
    stats = timing_stats(len(prompt), len(tokens), t0, t1, t2, stop)
    return Generation(tokens, {**stats, **kv_eviction.kv_stats(evicted, int(pos), runtime.max_context),
                               "loop": "device"})


@derived_cache
def _chain_fn(commit_verify, draft, batch: bool = False):
    """The jitted MTP chain loop over one model graph's `commit_verify` and one head's `draft` (batch: over
    a batch of sequences)."""

    def run(params, cache, mtp_params, state, mtp_cache, logits, h_last, P, mtp_off, k, max_new, max_context,
            slot_room, eos, sampling, out, vocab, p_min, K, greedy):
        rows = jnp.arange(K + 1, dtype=jnp.int32)

        def init(state, mtp_cache, logits, h_last, P, sampling, out):
            D = h_last.shape[0]
            tok, stop = _first_token(greedy, sampling, logits, P, eos, max_new, max_context)
            zi = jnp.int32(0)
            counts = jnp.zeros((K + 1,), jnp.int32)  # per draft position i = 1..K (index 0 unused)
            return dict(
                cache=cache, state=state, mtp_cache=mtp_cache,
                snaps=repeat_as_snapshots(state, K + 1), a_prev=zi,  # rollback of the previous pass (none yet)
                vt=jnp.zeros((K + 1,), jnp.int32), n_pend=zi, pend_start=P, h_prev=h_last,
                hidden=jnp.zeros((K + 1, D), jnp.float32), t=tok, P=P, n_out=jnp.int32(1), out=out.at[0].set(tok),
                stop=stop, passes=zi, drafted=zi, accepted=zi, tried=counts, hit=counts, sampling=sampling)

        def body(c):
            pick = _picker(greedy, c["sampling"])
            P, live = c["P"], c["stop"] == 0  # live False: a stopped sequence of a batch (padding rows)
            n_draft = jnp.minimum(k, jnp.minimum(max_context - 1 - P, slot_room - P))
            # MTP catch-up rows (the previous pass's certain token and accepted drafts), then t.
            toks = jnp.concatenate([jnp.where(rows < c["n_pend"], c["vt"], 0), jnp.zeros((1,), jnp.int32)])
            toks = toks.at[c["n_pend"]].set(c["t"])
            vtokens, mtp_cache, h_t, n_made = draft(mtp_params, c["mtp_cache"], toks, c["h_prev"], c["hidden"],
                                                    c["pend_start"] - mtp_off, c["n_pend"] + 1,
                                                    jnp.maximum(n_draft, 1), vocab, p_min, live)
            n_draft = jnp.minimum(n_draft, n_made)  # draft_p_min may stop the chain early
            v, cache = commit_verify(params, c["cache"], c["state"], c["snaps"], c["a_prev"], vtokens, P,
                                     (n_draft + 1) * live)
            logits, greedy_rows, hidden, state, snaps = v
            if greedy:
                target = greedy_rows
            else:
                index = c["n_out"] - 1  # generated index of t
                target = jnp.stack([pick(logits[r], index + r + 1) for r in range(K + 1)])
            match = (rows[:K] < n_draft) & (target[:K] == vtokens[1:])
            a = jnp.sum(jnp.cumprod(match.astype(jnp.int32)))
            # Emit target[0..a] (the accepted drafts are the targets of their rows) up to a stop.
            n_out = c["n_out"]
            emitted = rows <= a
            is_eos = jnp.any(target[:, None] == eos[None, :], axis=1) & emitted
            is_max = (n_out + rows + 1 == max_new) & emitted
            hit_stop = is_eos | is_max
            j = jnp.argmax(hit_stop)  # the first stopping token (when any)
            any_stop = jnp.any(hit_stop)
            P_new = P + a + 1
            stop = jnp.where(any_stop, jnp.where(is_eos[j], 1, 2), jnp.where(P_new >= max_context, 3, 0))
            pos_i = rows[1:]  # draft positions 1..K
            return dict(
                cache=cache, state=state, mtp_cache=mtp_cache, snaps=snaps, a_prev=a,
                vt=vtokens, n_pend=a + 1, pend_start=P, h_prev=h_t, hidden=hidden, t=target[a], P=P_new,
                n_out=n_out + jnp.where(any_stop, j + 1, a + 1),
                out=jax.lax.dynamic_update_slice(c["out"], target, (n_out,)), stop=stop.astype(jnp.int32),
                passes=c["passes"] + 1, drafted=c["drafted"] + n_draft, accepted=c["accepted"] + a,
                tried=c["tried"].at[1:].add((n_draft >= pos_i).astype(jnp.int32)),
                hit=c["hit"].at[1:].add((a >= pos_i).astype(jnp.int32)), sampling=c["sampling"])

        def fin(c):
            counts = dict(passes=c["passes"], drafted=c["drafted"], accepted=c["accepted"], tried=c["tried"][1:],
                          hit=c["hit"][1:])
            return c["out"], c["n_out"], c["stop"], c["P"], counts, c["cache"]

        return _drive(init, body, fin, (state, mtp_cache, logits, h_last, P, sampling, out), batch)

    return jax.jit(run, donate_argnums=() if batch else (1,), static_argnames=("K", "greedy"))


def generate_mtp_device(runtime: Runtime, mtp: MTPRuntime, prompt: Sequence[int], max_new_tokens: int,
                        sampling: SamplingParams, stop_ids: Collection[int] = (), draft_tokens: int = 3,
                        kv: SnapKV | None = None, mtp_kv: str = "snapkv", zero_h_first: bool = False,
                        vocab: DraftVocab | None = None, p_min: float | None = None, resume=None) -> Generation:
    """`speculative.generate_mtp` with batched verify (same arguments, tokens and stats except draft_s /
    verify_s, which one device program cannot split; plus loop="device") with every pass on the device."""
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
        fn = _chain_fn(runtime.steps.commit_verify, mtp.draft_fn)
        out, n, code, end, counts, runtime.cache = fn(
            runtime.params, runtime.cache, mtp.params, dec.state, dec.cache, logits, dec.h_prev, np.int32(P),
            np.int32(dec.mtp_offset), np.int32(dec.k), np.int32(max_new_tokens),
            np.int32(runtime.max_context), np.int32(slot_room), _eos_array(stop_ids), traced_params(sampling),
            np.zeros(out_slots(max_new_tokens, K), np.int32), vocab, None if p_min is None else np.float32(p_min),
            K=K, greedy=sampling.greedy)
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



@derived_cache
def _tree_fn(tree_commit_verify, root, level, batch: bool = False):
    """The jitted MTP tree loop over one model graph's `tree_commit_verify` and one head's tree calls
    (batch: over a batch of sequences; a stopped sequence's passes still compute, their rows not padding)."""

    def run(params, cache, mtp_params, state, mtp_cache, logits, h_last, P, max_new, max_context, slot_room, eos,
            sampling, out, K, N, c, greedy):
        T = N + 1
        one = jax.tree.map(lambda a: a[0], mtp_cache) if batch else mtp_cache  # one sequence's cache (shapes)
        S = one.end_position()  # where the MTP cache's slots end, as a position (as the host drafter)
        rows = jnp.arange(T, dtype=jnp.int32)
        krows = jnp.arange(K + 1, dtype=jnp.int32)

        def init(state, mtp_cache, logits, h_last, P, sampling, out):
            D = h_last.shape[0]
            tok, stop = _first_token(greedy, sampling, logits, P, eos, max_new, max_context)
            zi = jnp.int32(0)
            rec = jnp.zeros((out.shape[0],), jnp.int32)  # per pass: nodes, depth, accepted
            return dict(
                cache=cache, state=state, mtp_cache=mtp_cache, snaps=repeat_as_snapshots(state, T), node=zi,
                prev=zi, path=jnp.zeros((T,), jnp.int32), n_path=zi,  # commit of the previous pass (none yet)
                vt=jnp.zeros((K + 1,), jnp.int32), n_pend=zi, pend_start=P, h_prev=h_last,
                hidden=jnp.zeros((K + 1, D), jnp.float32), t=tok, P=P, n_out=jnp.int32(1), out=out.at[0].set(tok),
                stop=stop, passes=zi, nodes=rec, depth=rec, acc=rec, sampling=sampling)

        def body(c_):
            pick = _picker(greedy, c_["sampling"])
            P = c_["P"]
            n_nodes = jnp.minimum(N, jnp.minimum(max_context - 1 - P, slot_room - P))
            depth = jnp.minimum(K, n_nodes)
            toks = jnp.concatenate([jnp.where(krows < c_["n_pend"], c_["vt"], 0), jnp.zeros((1,), jnp.int32)])
            toks = toks.at[c_["n_pend"]].set(c_["t"])
            tt, tp, _, n, mtp_cache, h_t = tree_device.draft_tree(
                root, level, mtp_params, c_["mtp_cache"], toks, c_["h_prev"], c_["hidden"], c_["pend_start"] - 1,
                c_["n_pend"] + 1, depth, n_nodes, K=K, N=N, c=c, S=S)
            tdepth, tparent, anc = tree_device.tree_arrays(tp, n)
            v, cache = tree_commit_verify(params, c_["cache"], c_["state"], c_["snaps"], c_["node"], c_["prev"],
                                          c_["path"], c_["n_path"], tt, P, n, tdepth, tparent, anc)
            logits, greedy_rows, hidden, state, snaps = v
            if greedy:
                target = greedy_rows
            else:
                index = c_["n_out"] - 1  # generated index of t
                target = jnp.stack([pick(logits[r], index + tdepth[r] + 1) for r in range(T)])
            path, a, last = tree_device.accept_path(tt, tparent, n, target, K)
            emit = target[path]  # row r <= a: the target's token at the path's node r
            n_out = c_["n_out"]
            emitted = rows <= a
            is_eos = jnp.any(emit[:, None] == eos[None, :], axis=1) & emitted
            is_max = (n_out + rows + 1 == max_new) & emitted
            hit_stop = is_eos | is_max
            j = jnp.argmax(hit_stop)
            any_stop = jnp.any(hit_stop)
            P_new = P + a + 1
            stop = jnp.where(any_stop, jnp.where(is_eos[j], 1, 2), jnp.where(P_new >= max_context, 3, 0))
            i = c_["passes"]
            return dict(
                cache=cache, state=state, mtp_cache=mtp_cache, snaps=snaps, node=last, prev=P, path=path,
                n_path=a + 1, vt=jnp.where(krows <= a, tt[path[:K + 1]], 0), n_pend=a + 1, pend_start=P,
                h_prev=h_t, hidden=hidden[path[:K + 1]], t=target[last], P=P_new,
                n_out=n_out + jnp.where(any_stop, j + 1, a + 1),
                out=jax.lax.dynamic_update_slice(c_["out"], emit, (n_out,)), stop=stop.astype(jnp.int32),
                passes=i + 1, nodes=c_["nodes"].at[i].set(n - 1), depth=c_["depth"].at[i].set(jnp.max(tdepth)),
                acc=c_["acc"].at[i].set(a), sampling=c_["sampling"])

        def fin(c_):
            counts = dict(passes=c_["passes"], nodes=c_["nodes"], depth=c_["depth"], acc=c_["acc"])
            return c_["out"], c_["n_out"], c_["stop"], c_["P"], counts, c_["cache"]

        return _drive(init, body, fin, (state, mtp_cache, logits, h_last, P, sampling, out), batch)

    return jax.jit(run, donate_argnums=() if batch else (1,), static_argnames=("K", "N", "c", "greedy"))


def generate_tree_device(runtime: Runtime, mtp: MTPRuntime, prompt: Sequence[int], max_new_tokens: int,
                         sampling: SamplingParams, stop_ids: Collection[int] = (), draft_tokens: int = 3,
                         tree_nodes: int = 8, max_snapshot_bytes: int | None = None,
                         kv: SnapKV | None = None, resume=None) -> Generation:
    """`tree.generate_tree` with batched verify (same arguments, tokens and stats except draft_s / verify_s;
    plus loop="device") with every pass (drafting the tree, verify, acceptance, commit) on the device."""
    t0 = time.perf_counter()
    dec = TreeDecoder(runtime, mtp, draft_tokens, tree_nodes, "batched", max_snapshot_bytes=max_snapshot_bytes,
                      kv=kv, kv_capacity=kv_eviction.kv_capacity(kv, max_new_tokens, runtime.max_context))
    dec.resume = resume
    logits = dec.prefill(prompt)
    t1 = time.perf_counter()
    P, passes = dec.P, []
    if max_new_tokens <= 0:
        tokens, stop = [], "max_new_tokens"
    else:
        fn = _tree_fn(runtime.steps.tree_commit_verify, dec.drafter.root, dec.drafter.level)
        slot_room = dec.last_position()  # as the chain: slot_room - P = the nodes the slots still hold
        out, n, code, end, counts, runtime.cache = fn(
            runtime.params, runtime.cache, mtp.params, dec.state, dec.cache, logits, dec.h_prev, np.int32(P),
            np.int32(max_new_tokens), np.int32(runtime.max_context), np.int32(slot_room), _eos_array(stop_ids),
            traced_params(sampling),
            np.zeros(out_slots(max_new_tokens, dec.n_nodes), np.int32), K=dec.k, N=dec.n_nodes, c=dec.drafter.c,
            greedy=sampling.greedy)
        out, n, code, P, counts = jax.device_get((out, n, code, end, counts))
        tokens, stop, P = [int(x) for x in out[:int(n)]], STOP_REASONS[int(code)], int(P)
        m = int(counts["passes"])
        passes = list(zip(*(counts[key][:m].tolist() for key in ("nodes", "depth", "acc"))))
    t2 = time.perf_counter()
    stats = {
        **timing_stats(len(prompt), len(tokens), t0, t1, t2, stop),
        "speculative": "mtp_tree",
        "draft_tokens": dec.k,
        "tree_nodes": dec.n_nodes,
        "verify": "batched",
        **pass_stats(dec.k, pass_counts(dec.k, passes), "accept_per_depth"),
        "drafted_nodes": [n for n, _, _ in passes],
        "snapshot_bytes_per_node": snapshot_bytes_per_node(runtime.config),
        **kv_eviction.kv_stats(dec.evicted, P, runtime.max_context),
        "loop": "device",
    }
    return Generation(tokens, stats)
