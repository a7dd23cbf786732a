"""Batched generation: B sequences (prompts of any lengths) decoded together in ONE jitted device loop.

Each sequence is prefilled on its own (its own bucket plan, so its prefill is exactly the one-sequence
prefill), then the device loop of its strategy (`strategies`: MTP off, the chain or the tree) runs under
jax.vmap over the sequences: per sequence its own position, KV / GDN state, MTP cache, sampling stream (its seed)
and stop tests. The products are batched by their ops, not by the loop: under vmap the ggml matmul and
the grouped routed-expert op gather every sequence's valid rows into ONE call (`quant.ggml`), so a step
reads each weight once for the batch and each used expert once for all rows routed to it. Those ops are
row-stable (a row's bits depend only on its own activation row), and every other op acts per sequence,
so with kernels="ggml" each sequence's tokens are bitwise those of generating it alone, greedy and seeded
(`tests/runtime/test_batch.py`). On XLA and Pallas, a vmapped dot_general may change the last bits.

The loop runs while any sequence is live (`device_loop.drive`). A sequence that has stopped keeps its
tokens, counts and position (held by a select per small field) while the others go on; its next steps
run as padding rows (no product row, no expert read: `moe.padding_route` routes them like the batch's
first valid row): its MTP head rows and its trunk rows, for MTP off, the chain and the tree (whose
stopped sequence drafts the root alone). Its big state (KV, GDN, snapshots) goes stale unread.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.errors import InputError
from sharpi_jax.runtime import kv_eviction
from sharpi_jax.runtime.device_loop import STOP_REASONS, eos_array, out_slots
from sharpi_jax.runtime.draft_vocab import DraftVocab
from sharpi_jax.runtime.generate import Generation
from sharpi_jax.runtime.mtp import MTPRuntime
from sharpi_jax.runtime.options import GenerateOptions, drafter_p_min
from sharpi_jax.runtime.passes import pass_counts, pass_stats
from sharpi_jax.runtime.sampling import SamplingParams, traced_params
from sharpi_jax.runtime.speculative import MTPDecoder
from sharpi_jax.runtime.steps import Runtime
from sharpi_jax.runtime.strategies import chain, plain, tree
from sharpi_jax.runtime.tree import TreeDecoder, snapshot_bytes_per_node


def _stack(trees: Sequence[Any]) -> Any:
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def _sampling_rows(sampling: SamplingParams, seeds: Sequence[int]) -> tuple:
    """`traced_params` of each sequence's seed, stacked per field."""
    rows = [traced_params(dataclasses.replace(sampling, seed=int(s))) for s in seeds]
    return tuple(np.stack(col) for col in zip(*rows))


def check_seeds(seeds: Sequence[int] | None, n: int, default: int) -> list[int]:
    """One seed per sequence: `seeds` (validated), else the options' seed for each."""
    if seeds is None:
        return [int(default)] * n
    seeds = list(seeds)
    if len(seeds) != n or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < 2 ** 32
                              for s in seeds):
        raise InputError(f"seeds must be {n} integers in [0, 2**32) (one per prompt), got {seeds!r}")
    return [int(s) for s in seeds]


def generate_batch(runtime: Runtime, mtp: MTPRuntime | None, prompts: Sequence[Sequence[int]], opts: GenerateOptions,
                   stop_ids: Collection[int] = (), vocab: DraftVocab | None = None,
                   seeds: Sequence[int] | None = None) -> list[Generation]:
    """Generate after each of `prompts` (validated token ids) with `opts` (device loop; mtp: the MTP
    head's runtime for opts.speculative, else None; vocab: the draft vocabulary; seeds: one
    sampling seed per sequence, default opts.sampling.seed for all). Returns one `Generation` per prompt,
    in order: its tokens, its own stats (prompt_tokens, generated_tokens, stop_reason, prefill_s and
    the speculative pass stats) and the batch's (batch, batch_decode_s, batch_decode_tok_s: all
    sequences' tokens over the shared decode time)."""
    if not prompts:
        raise InputError("generate_batch needs at least one prompt")
    B, o = len(prompts), opts
    seeds = check_seeds(seeds, B, o.sampling.seed)
    eos = eos_array(stop_ids)
    decs, firsts, prefill_s = _prefill_each(runtime, mtp, prompts, o, vocab)
    P = np.array([len(ids) for ids in prompts], np.int32)
    logits, sampling = _stack(firsts), _sampling_rows(o.sampling, seeds)
    t1 = time.perf_counter()
    out, n, code, end, counts = jax.device_get(_decode_loop(runtime, mtp, decs, logits, P, eos, sampling, o, vocab))
    decode_s = time.perf_counter() - t1
    n_tok = int(np.sum(n))
    batch = {"batch": B, "batch_decode_s": decode_s, "batch_decode_tok_s": n_tok / decode_s if decode_s > 0 else 0.0,
             "loop": "device"}
    results = []
    for b, ids in enumerate(prompts):
        tokens = [int(x) for x in out[b, :int(n[b])]]
        stats = {"prompt_tokens": len(ids), "generated_tokens": len(tokens), "prefill_s": prefill_s[b],
                 "prefill_tok_s": len(ids) / prefill_s[b] if prefill_s[b] > 0 else float("inf"),
                 "stop_reason": STOP_REASONS[int(code[b])], "seed": seeds[b], **batch}
        _add_pass_stats(stats, runtime, o, vocab, counts, b, decs[b])
        results.append(Generation(tokens, stats))
    return results


def _prefill_each(runtime: Runtime, mtp: MTPRuntime | None, prompts: Sequence[Sequence[int]], o: GenerateOptions,
                  vocab: DraftVocab | None) -> tuple[list, list, list[float]]:
    """Prefill each prompt on its own: (its decode state, or its MTP / tree decoder; its first logits,
    ready; its prefill seconds) per prompt."""
    prefill_s, decs, firsts = [], [], []
    for ids in prompts:
        t0 = time.perf_counter()
        if o.speculative is None:
            _, logits, state, _ = kv_eviction.prefill(runtime, ids, None, None)
            decs.append(state)
        elif o.speculative == "mtp":
            dec = MTPDecoder(runtime, mtp, o.draft_tokens, "batched", vocab=vocab, p_min=drafter_p_min(o))
            logits = dec.prefill(ids)
            decs.append(dec)
        else:
            dec = TreeDecoder(runtime, mtp, o.draft_tokens, o.speculation.nodes, "batched",
                              max_snapshot_bytes=o.speculation.max_snapshot_bytes, vocab=vocab)
            logits = dec.prefill(ids)
            decs.append(dec)
        jax.block_until_ready(logits)
        firsts.append(logits)
        prefill_s.append(time.perf_counter() - t0)
    return decs, firsts, prefill_s


def _decode_loop(runtime: Runtime, mtp: MTPRuntime | None, decs: list, logits, P: np.ndarray, eos, sampling: tuple,
                 o: GenerateOptions, vocab: DraftVocab | None) -> tuple:
    """The batch's device loop from the prefilled `decs` (vmapped over the sequences): (out, n, code, end,
    counts), device arrays; counts None for MTP off and when nothing is to be generated."""
    B = len(decs)
    counts = None
    if o.max_new_tokens <= 0:
        out, n, code, end = (np.zeros((B, 1), np.int32), np.zeros(B, np.int32), np.full(B, 2, np.int32), P)
    elif o.speculative is None:
        out0 = np.zeros((B, out_slots(o.max_new_tokens)), np.int32)
        fn = plain.jitted_loop(runtime.steps.decode, True)
        out, n, code, end, _ = fn(runtime.params, runtime.cache, _stack(decs), logits, P,
                                  np.int32(o.max_new_tokens), np.int32(runtime.max_context), eos, sampling, out0,
                                  greedy=o.sampling.greedy)
    elif o.speculative == "mtp":
        d0 = decs[0]
        out0 = np.zeros((B, out_slots(o.max_new_tokens, d0.K)), np.int32)
        fn = chain.jitted_loop(runtime.steps.commit_verify, mtp.draft_fn, True)
        out, n, code, end, counts, _ = fn(
            runtime.params, runtime.cache, mtp.params, _stack([d.state for d in decs]),
            _stack([d.cache for d in decs]), logits, _stack([d.h_prev for d in decs]), P,
            np.int32(d0.mtp_offset), np.int32(d0.k), np.int32(o.max_new_tokens), np.int32(runtime.max_context),
            np.int32(d0.last_position()), eos, sampling, out0, vocab, None if drafter_p_min(o) is None else np.float32(drafter_p_min(o)),
            None, K=d0.K, greedy=o.sampling.greedy)
    else:
        d0 = decs[0]
        out0 = np.zeros((B, out_slots(o.max_new_tokens, d0.n_nodes)), np.int32)
        fn = tree.jitted_loop(runtime.steps.tree_commit_verify, d0.drafter.root, d0.drafter.level, True)
        out, n, code, end, counts, _ = fn(
            runtime.params, runtime.cache, mtp.params, _stack([d.state for d in decs]),
            _stack([d.cache for d in decs]), logits, _stack([d.h_prev for d in decs]), P,
            np.int32(o.max_new_tokens), np.int32(runtime.max_context), np.int32(d0.last_position()), eos, sampling,
            out0, None, vocab, K=d0.k, N=d0.n_nodes, c=d0.drafter.c, greedy=o.sampling.greedy)
    return out, n, code, end, counts


def _add_pass_stats(stats: dict, runtime: Runtime, o: GenerateOptions, vocab: DraftVocab | None, counts, b: int,
                    dec) -> None:
    """Add sequence b's speculative pass stats (from the loop's fetched `counts`; dec: its decoder) to its
    `stats`, as generating it alone reports them; nothing for MTP off."""
    if o.speculative == "mtp":
        c = None  # no pass ran (max_new_tokens = 0): pass_stats reports zeros, as the run alone does
        if counts is not None:
            c = {k: (v[b] if np.ndim(v) else v) for k, v in counts.items()}
            c = {k: (v.tolist() if isinstance(v, np.ndarray) else int(v)) for k, v in c.items()}
        stats.update(speculative="mtp", draft_tokens=o.draft_tokens, verify="batched",
                     draft_vocab=None if vocab is None else vocab.size, draft_p_min=drafter_p_min(o),
                     **pass_stats(o.draft_tokens, c, "accept_per_position"))
    elif o.speculative == "mtp_tree":
        m = 0 if counts is None else int(counts["passes"][b])
        passes = [] if m == 0 else list(zip(*(counts[key][b][:m].tolist() for key in ("nodes", "depth", "acc"))))
        stats.update(speculative="mtp_tree", draft_tokens=o.draft_tokens, tree_nodes=dec.n_nodes,
                     verify="batched", **tree.vocab_stats(vocab),
                     **pass_stats(o.draft_tokens, pass_counts(o.draft_tokens, passes), "accept_per_depth"),
                     drafted_nodes=[x for x, _, _ in passes],
                     snapshot_bytes_per_node=snapshot_bytes_per_node(runtime.config))
