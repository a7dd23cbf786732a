"""The MTP tree: a draft tree per trunk pass, verified in one pass (the algorithm and its decoder:
`runtime.tree`). `generate_tree` (the host loop over `tree.TreeDecoder`), `generate_tree_device` (every
pass on the device: `jitted_loop`, its pass `_body` over the traced tree logic of `tree_device`, on the
`device_loop` skeleton) and `TreeStrategy`, both behind `base.Strategy`."""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Collection, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime import kv_eviction, tree_device
from sharpi_jax.runtime.compiled import derived_cache
from sharpi_jax.runtime.decoder import generate_passes
from sharpi_jax.runtime.device_loop import (STOP_REASONS, drive, eos_array, first_token, jit_loop, lazy_walk,
                                            out_slots, pass_stop, picker, row_targets)
from sharpi_jax.runtime.draft_vocab import DraftVocab
from sharpi_jax.runtime.generate import Generation, timing_stats
from sharpi_jax.runtime.mtp import MTPRuntime
from sharpi_jax.runtime.passes import pass_counts, pass_stats
from sharpi_jax.runtime.sampling import SamplingParams, traced_params
from sharpi_jax.runtime.state import first_snapshots
from sharpi_jax.runtime.steps import Runtime
from sharpi_jax.runtime.strategies.base import Strategy
from sharpi_jax.runtime.tree import TreeDecoder, snapshot_bytes_per_node


def generate_tree(runtime: Runtime, mtp: MTPRuntime, prompt: Sequence[int], max_new_tokens: int,
                  sampling: SamplingParams, stop_ids: Collection[int] = (), draft_tokens: int = 3,
                  tree_nodes: int = 8, verify: str = "batched", trace: list | None = None,
                  max_snapshot_bytes: int | None = None, kv: SnapKV | None = None, resume=None,
                  vocab: DraftVocab | None = None) -> Generation:
    """Tree speculative generation; the tokens are those of `plain.generate_ids` with the same arguments.

    stats: those of `generate_ids` plus speculative ("mtp_tree"), draft_tokens (depth), tree_nodes
    (after the memory cap: the most a pass drafts), verify, drafted (draft nodes verified), drafted_nodes
    (the nodes each pass actually drafted and verified, a list), accepted, verify_passes,
    acceptance_rate (accepted / drafted), mean_accept_len (accepted + 1 per trunk pass),
    accept_per_depth (fraction of the passes whose tree reached depth i that accepted >= i tokens),
    snapshot_bytes_per_node, draft_s, verify_s. kv: SnapKV eviction at prefill (trunk and MTP head, as
    `chain.generate_mtp`), adding kv_slots / kv_evicted / kv_capacity. vocab: a draft vocabulary (every
    drafting call over its ids only), adding draft_vocab (its size).
    """
    t0 = time.perf_counter()
    dec = TreeDecoder(runtime, mtp, draft_tokens, tree_nodes, verify, trace, max_snapshot_bytes, kv=kv,
                      kv_capacity=kv_eviction.kv_capacity(kv, max_new_tokens, runtime.max_context), vocab=vocab)
    dec.resume = resume  # a session's continued prefill (`session.Resume`)
    out, stats, passes = generate_passes(dec, prompt, max_new_tokens, sampling, stop_ids, "accept_per_depth", t0)
    return Generation(out, {**stats, "speculative": "mtp_tree", "draft_tokens": dec.k, "tree_nodes": dec.n_nodes,
                            "verify": verify, **vocab_stats(vocab), "drafted_nodes": [n for n, _, _ in passes],
                            "snapshot_bytes_per_node": snapshot_bytes_per_node(runtime.config),
                            **kv_eviction.kv_stats(dec.evicted, dec.P, runtime.max_context)})


def vocab_stats(vocab: DraftVocab | None) -> dict:
    """A tree's draft_vocab stat: its size, only when it has one (a chain always reports the key); the host
    and device loops and `generate_batch` report it alike."""
    return {} if vocab is None else {"draft_vocab": vocab.size}


class _Loop(NamedTuple):
    """What the tree loop's passes read besides the carry: the step functions, their params, the run's
    scalars (device arrays), its static depth K, nodes N, branching and greedy; T = N + 1 trunk rows, S
    where the MTP cache's slots end (as a position), rows = arange(T), krows = arange(K + 1); head_row: the
    LM head on one row (`RunConfig.verify_head` lazy), None: the pass computes every row's; vocab: the draft
    vocabulary (None: the full head drafts)."""

    tree_commit_verify: Callable
    root: Callable
    level: Callable
    params: Any
    mtp_params: Any
    max_new: Any
    max_context: Any
    slot_room: Any
    eos: Any
    K: int
    N: int
    branching: int
    greedy: bool
    T: int
    S: Any
    rows: Any
    krows: Any
    head_row: Callable | None
    vocab: Any


def _init(e: _Loop, cache, buffers, state, mtp_cache, logits, h_last, P, sampling, out) -> dict:
    """The carry after the prefill: the first token emitted, no pass yet. buffers: snapshot buffers to
    reuse (`Runtime.snapshot_buffers`), None: new ones."""
    K, T = e.K, e.T
    D = h_last.shape[0]
    tok, stop = first_token(e.greedy, sampling, logits, P, e.eos, e.max_new, e.max_context)
    zi = jnp.int32(0)
    rec = jnp.zeros((out.shape[0],), jnp.int32)  # per pass: nodes, depth, accepted
    return dict(
        cache=cache, state=state, mtp_cache=mtp_cache, snaps=first_snapshots(state, T, buffers), node=zi,
        prev=zi, path=jnp.zeros((T,), jnp.int32), n_path=zi,  # commit of the previous pass (none yet)
        vt=jnp.zeros((K + 1,), jnp.int32), n_pend=zi, pend_start=P, h_prev=h_last,
        hidden=jnp.zeros((K + 1, D), jnp.float32), t=tok, P=P, n_out=jnp.int32(1), out=out.at[0].set(tok),
        stop=stop, passes=zi, nodes=rec, depth=rec, acc=rec, sampling=sampling)


def _draft_verify(e: _Loop, c: dict) -> tuple:
    """A pass's tree and its verify: (tokens, parent rows, depths of the tree's rows, its rows n, MTP cache,
    h_t, the verify's outputs, the trunk's residency cache)."""
    P, live = c["P"], c["stop"] == 0  # live False: a stopped sequence of a batch (padding rows)
    n_nodes = jnp.minimum(e.N, jnp.minimum(e.max_context - 1 - P, e.slot_room - P))
    depth = jnp.minimum(e.K, n_nodes)
    toks = jnp.concatenate([jnp.where(e.krows < c["n_pend"], c["vt"], 0), jnp.zeros((1,), jnp.int32)])
    toks = toks.at[c["n_pend"]].set(c["t"])
    tt, tp, _, n, mtp_cache, h_t = tree_device.draft_tree(
        e.root, e.level, e.mtp_params, c["mtp_cache"], toks, c["h_prev"], c["hidden"], c["pend_start"] - 1,
        c["n_pend"] + 1, depth, n_nodes, K=e.K, N=e.N, c=e.branching, S=e.S, live=live, vocab=e.vocab)
    tdepth, tparent, anc = tree_device.tree_arrays(tp, n)
    v, cache = e.tree_commit_verify(e.params, c["cache"], c["state"], c["snaps"], c["node"], c["prev"],
                                    c["path"], c["n_path"], tt, P, n * live, tdepth, tparent, anc,
                                    head=e.head_row is None)
    return tt, tparent, tdepth, n, mtp_cache, h_t, v, cache


def _body(e: _Loop, c: dict) -> dict:
    """One pass: draft a tree, verify it, accept the longest matching root path, emit up to a stop."""
    K, P = e.K, c["P"]
    tt, tparent, tdepth, n, mtp_cache, h_t, v, cache = _draft_verify(e, c)
    logits, greedy_rows, hidden, state, snaps = v
    if e.head_row is None:
        target = row_targets(e.greedy, c["sampling"], logits, greedy_rows, c["n_out"], lambda r: tdepth[r], e.T)
        path, a, last = tree_device.accept_path(tt, tparent, n, target, K)
    else:  # the head of the walked path's nodes only, one at a time
        pick, index = picker(e.greedy, c["sampling"]), c["n_out"] - 1
        path, a, last, target = lazy_walk(lambda r: e.head_row(e.params, cache, hidden, r),
                                          lambda logits_r, r: pick(logits_r, index + tdepth[r] + 1),
                                          functools.partial(tree_device.child_holding, tt, tparent, n), e.T,
                                          min(K, e.T - 1))
    emit = target[path]  # row r <= a: the target's token at the path's node r
    n_out = c["n_out"]
    stop, any_stop, j, P_new = pass_stop(emit, a, n_out, P, e.rows, e.eos, e.max_new, e.max_context)
    i = c["passes"]
    return dict(
        cache=cache, state=state, mtp_cache=mtp_cache, snaps=snaps, node=last, prev=P, path=path,
        n_path=a + 1, vt=jnp.where(e.krows <= a, tt[path[:K + 1]], 0), n_pend=a + 1, pend_start=P,
        h_prev=h_t, hidden=hidden[path[:K + 1]], t=target[last], P=P_new,
        n_out=n_out + jnp.where(any_stop, j + 1, a + 1),
        out=jax.lax.dynamic_update_slice(c["out"], emit, (n_out,)), stop=stop.astype(jnp.int32),
        passes=i + 1, nodes=c["nodes"].at[i].set(n - 1), depth=c["depth"].at[i].set(jnp.max(tdepth)),
        acc=c["acc"].at[i].set(a), sampling=c["sampling"])


def _fin(c: dict, back: bool = False) -> tuple:
    """The loop's results; back (one sequence): its donated buffers too (state, MTP cache: aliased, so
    never copied into the loop's own; snapshots: for the next loop to reuse)."""
    counts = dict(passes=c["passes"], nodes=c["nodes"], depth=c["depth"], acc=c["acc"])
    out = (c["out"], c["n_out"], c["stop"], c["P"], counts, c["cache"])
    return out + ((c["state"], c["mtp_cache"], c["snaps"]),) if back else out


@derived_cache
def jitted_loop(tree_commit_verify, root, level, batch: bool = False, head_row=None):
    """The jitted MTP tree loop over one model graph's `tree_commit_verify` and one head's tree calls
    (batch: over a batch of sequences, a stopped sequence's rows padding; head_row: that graph's `head_row`
    for a lazy LM head, one sequence only). One sequence: the state, the MTP cache and the snapshot
    buffers (`Runtime.snapshot_buffers`) donated; they come back as a last result. The run's `vocab` (a
    draft vocabulary or None) is an argument, so a loop compiles once per vocabulary size, not per ranking."""

    def run(params, cache, mtp_params, state, mtp_cache, logits, h_last, P, max_new, max_context, slot_room, eos,
            sampling, out, buffers, vocab, K, N, c, greedy):
        T = N + 1
        one = jax.tree.map(lambda a: a[0], mtp_cache) if batch else mtp_cache  # one sequence's cache (shapes)
        S = one.end_position()  # where the MTP cache's slots end, as a position (as the host drafter)
        rows = jnp.arange(T, dtype=jnp.int32)
        krows = jnp.arange(K + 1, dtype=jnp.int32)
        e = _Loop(tree_commit_verify, root, level, params, mtp_params, max_new, max_context, slot_room, eos, K, N, c,
                  greedy, T, S, rows, krows, head_row, vocab)
        return drive(functools.partial(_init, e, cache, buffers), functools.partial(_body, e),
                     functools.partial(_fin, back=not batch), (state, mtp_cache, logits, h_last, P, sampling, out),
                     batch)

    return jit_loop(run, batch, ("K", "N", "c", "greedy"), donate=("state", "mtp_cache", "buffers"))


def generate_tree_device(runtime: Runtime, mtp: MTPRuntime, prompt: Sequence[int], max_new_tokens: int,
                         sampling: SamplingParams, stop_ids: Collection[int] = (), draft_tokens: int = 3,
                         tree_nodes: int = 8, max_snapshot_bytes: int | None = None,
                         kv: SnapKV | None = None, resume=None, vocab: DraftVocab | None = None) -> Generation:
    """`generate_tree` with batched verify (same arguments, tokens and stats except draft_s / verify_s;
    plus loop="device") with every pass (drafting the tree, verify, acceptance, commit) on the device."""
    t0 = time.perf_counter()
    dec = TreeDecoder(runtime, mtp, draft_tokens, tree_nodes, "batched", max_snapshot_bytes=max_snapshot_bytes,
                      kv=kv, kv_capacity=kv_eviction.kv_capacity(kv, max_new_tokens, runtime.max_context),
                      vocab=vocab)
    dec.resume = resume
    logits = dec.prefill(prompt)
    t1 = time.perf_counter()
    P, passes = dec.P, []
    if max_new_tokens <= 0:
        tokens, stop = [], "max_new_tokens"
    else:
        fn = jitted_loop(runtime.steps.tree_commit_verify, dec.drafter.root, dec.drafter.level, False,
                         runtime.steps.head_row if runtime.lazy_head_for(dec.n_nodes + 1) else None)
        slot_room = dec.last_position()  # as the chain: slot_room - P = the nodes the slots still hold
        out, n, code, end, counts, runtime.cache, (_, _, buffers) = fn(
            runtime.params, runtime.cache, mtp.params, dec.state, dec.cache, logits, dec.h_prev, np.int32(P),
            np.int32(max_new_tokens), np.int32(runtime.max_context), np.int32(slot_room), eos_array(stop_ids),
            traced_params(sampling), np.zeros(out_slots(max_new_tokens, dec.n_nodes), np.int32),
            runtime.snapshot_buffers(dec.state, dec.n_nodes + 1), vocab, K=dec.k, N=dec.n_nodes, c=dec.drafter.c,
            greedy=sampling.greedy)
        runtime.keep_snapshot_buffers(buffers)
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
        **vocab_stats(vocab),
        **pass_stats(dec.k, pass_counts(dec.k, passes), "accept_per_depth"),
        "drafted_nodes": [n for n, _, _ in passes],
        "snapshot_bytes_per_node": snapshot_bytes_per_node(runtime.config),
        **kv_eviction.kv_stats(dec.evicted, P, runtime.max_context),
        "loop": "device",
    }
    return Generation(tokens, stats)


class TreeStrategy(Strategy):
    """The MTP tree (`GenerateOptions.speculation` a `Tree`): `generate_tree`, `generate_tree_device`."""

    def host(self, runtime, mtp, ids, opts, stop_ids=(), kv=None, vocab=None, resume=None) -> Generation:
        spec = opts.speculation
        return generate_tree(runtime, mtp, ids, opts.max_new_tokens, opts.sampling, stop_ids, spec.depth, spec.nodes,
                             opts.verify, max_snapshot_bytes=spec.max_snapshot_bytes, kv=kv, resume=resume,
                             vocab=vocab)

    def device(self, runtime, mtp, ids, opts, stop_ids=(), kv=None, vocab=None, resume=None) -> Generation:
        spec = opts.speculation
        return generate_tree_device(runtime, mtp, ids, opts.max_new_tokens, opts.sampling, stop_ids, spec.depth,
                                    spec.nodes, max_snapshot_bytes=spec.max_snapshot_bytes, kv=kv, resume=resume,
                                    vocab=vocab)
