"""The number that decides whether (tree) speculation pays on a model: the time of one trunk pass of w rows
over the time of one single-token decode step, chain (w consecutive rows) and tree (w rows of a binary
tree, parent[t] = (t - 1) // 2), w = 1..16. Where a w-row pass costs about one decode step, drafting w
tokens per pass multiplies the decode speed by the accepted length. Used by `bench_verify --pass_widths`
and `bench_decode --widths`. A pass is timed as the MTP loops dispatch it: the previous pass's commit and
the rows in one call, its snapshots written into the previous pass's buffers.

The rows carry different tokens, as real drafts do (the prompt's first w tokens, repeated as its
continuation), so that a MoE routes them to different experts; each record also gives the distinct
experts the w rows read per MoE layer (from the router's top-k on the same rows, mean over layers).

A chain pass is timed twice: with its LM head on every row (`chain_ms`: what the host loop and the parity
tests run, and the device loop where `Runtime.full_head_rows` covers the width) and with the head on row 0
only (`chain_head1_ms`: the trunk, then one row of the head as the device loop's lazy walk computes it when
the first draft is rejected; each accepted draft adds one more head row). The second is the pass that
llama-bench's `-p w` times: it computes the logits of one row.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import numpy as np

from experiments.timing import put_spread, spread
from sharpi_jax.runtime.state import repeat_as_snapshots


def _timed(fn, state, repeats: int):
    """Warm once, then `repeats` timed calls of fn(state) -> state (the state, any pytree, is donated)."""
    # Dispatch is asynchronous: without this wait the first timed call would also wait for the warm call and
    # whatever ran before it (the prefill: ~0.9 s on the slice), and the median of 3 calls would be biased up.
    state = jax.block_until_ready(fn(state))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = fn(state)
        jax.block_until_ready(state)
        times.append(1e3 * (time.perf_counter() - t0))
    return times, state


def row_tokens(ids: Sequence[int], w: int) -> np.ndarray:
    """The tokens of a w-row pass after `ids`: the prompt's own first w tokens (cycled when it is shorter),
    so a wider pass's rows extend a narrower one's."""
    return np.resize(np.asarray(ids, np.int32), w)


def loop_pass(rt, tokens, P: int, parent: np.ndarray | None = None):
    """fn((state, snaps)) -> (state, snaps): one trunk pass of the w = len(tokens) rows at P as the MTP loops
    dispatch it: the previous pass's commit (snapshot 0; no KV rows moved), then the rows, their snapshots
    written into the previous pass's donated buffers. parent: draft-tree rows (None: a chain). Start it
    from (state, `repeat_as_snapshots`(state, w))."""
    w = len(tokens)

    def chain(c):
        v = rt.commit_verify(c[0], c[1], 0, tokens, P, w)
        return v.state, v.snaps

    def tree(c):
        v = rt.tree_commit_verify(c[0], c[1], 0, P, None, 0, tokens, P, w, parent)
        return v.state, v.snaps

    return chain if parent is None else tree


def loop_pass_head1(rt, tokens, P: int):
    """fn((state, snaps, _)) -> (state, snaps, logits of row 0): a chain pass as `loop_pass`'s without the LM
    head, then the head of row 0 alone (`head_row`, the lazy walk's product: the bits row 0 has in the full
    head), in two dispatches (the device loop runs both in one program): the work of a lazy device-loop pass
    that rejects its first draft."""
    w, fns = len(tokens), rt.steps

    def chain(c):
        v, rt.cache = fns.commit_verify(rt.params, rt.cache, c[0], c[1], np.int32(0), tokens, np.int32(P),
                                        np.int32(w), head=False)
        return v.state, v.snaps, fns.head_row(rt.params, rt.cache, v.hidden, np.int32(0))

    return chain


def experts_per_width(engine, ids: Sequence[int], widths: Sequence[int]) -> dict[int, float] | None:
    """Distinct routed experts the rows of each width's pass select, mean over the MoE layers (None for a
    dense model): one teacher-forced routing trace of ids + the widest pass's rows."""
    c = engine.config
    if not c.is_moe:
        return None
    from sharpi_jax.runtime.routing import trace_routing

    trace = trace_routing(engine.model, list(ids) + row_tokens(ids, max(widths)).tolist())
    P, k = len(ids), c.n_expert_used
    moe = [l for l in range(trace.probs.shape[0]) if not np.isnan(trace.probs[l, P:]).any()]
    out = {}
    for w in widths:
        top = [np.argsort(-trace.probs[l, P:P + w], axis=-1)[:, :k] for l in moe]
        out[w] = float(np.mean([len(np.unique(t)) for t in top]))
    return out


def pass_timing(engine, ids: Sequence[int], widths: Sequence[int], repeats: int) -> list[dict]:
    """One record per width w: decode_ms, chain_ms, chain_head1_ms, tree_ms (median/min/max/runs of `repeats`
    calls at the prompt's end), the ratios to decode_ms and, for a MoE, experts_per_pass (distinct experts of
    the w rows, mean over layers). w = 1 is the decode step itself."""
    experts = experts_per_width(engine, ids, widths)
    rt = engine.runtime
    _, _, state = rt.prefill(rt.new_state(), ids)
    P = len(ids)
    if P + max(widths) > rt.max_context:
        raise ValueError(f"prompt ({P}) + the widest pass ({max(widths)}) exceed max_context = {rt.max_context}")
    tok = int(ids[-1])

    def decode(s):
        return rt.decode_step(s, tok, P)[2]

    dec, state = _timed(decode, state, repeats)
    out = []
    for w in widths:
        rec = {"rows": w}
        put_spread(rec, "decode_ms", dec)
        if w == 1:
            chain = head1 = tree = dec
        else:
            tokens = row_tokens(ids, w)
            parent = np.array([-1] + [(t - 1) // 2 for t in range(1, w)], np.int32)

            chain, (state, _) = _timed(loop_pass(rt, tokens, P), (state, repeat_as_snapshots(state, w)), repeats)
            head1, (state, _, _) = _timed(loop_pass_head1(rt, tokens, P),
                                          (state, repeat_as_snapshots(state, w), None), repeats)
            tree, (state, _) = _timed(loop_pass(rt, tokens, P, parent), (state, repeat_as_snapshots(state, w)),
                                      repeats)
        put_spread(rec, "chain_ms", chain)
        put_spread(rec, "chain_head1_ms", head1)
        put_spread(rec, "tree_ms", tree)
        d = spread(dec)["median"]
        rec["chain_over_decode"] = rec["chain_ms"] / d
        rec["chain_head1_over_decode"] = rec["chain_head1_ms"] / d
        rec["tree_over_decode"] = rec["tree_ms"] / d
        if experts is not None:
            rec["experts_per_pass"] = experts[w]
        out.append(rec)
    return out


def print_pass_timing(records: list[dict], what: str) -> None:
    print(f"\none trunk pass of w rows vs one decode step ({what}; median [min-max] ms)")
    hdr = (f"{'w':>3} {'decode ms':>10} {'chain ms [min-max]':>28} {'chain/dec':>9} {'1 head row/dec':>14} "
           f"{'tree ms [min-max]':>28} {'tree/dec':>8}")
    experts = "experts_per_pass" in records[0]
    if experts:
        hdr += f" {'experts/pass':>12}"
    print(hdr)
    print("-" * len(hdr))
    for r in records:
        chain = f"{r['chain_ms']:.2f} [{r['chain_ms_min']:.2f}-{r['chain_ms_max']:.2f}]"
        tree = f"{r['tree_ms']:.2f} [{r['tree_ms_min']:.2f}-{r['tree_ms_max']:.2f}]"
        print(f"{r['rows']:>3} {r['decode_ms']:>10.2f} {chain:>28} {r['chain_over_decode']:>9.2f} "
              f"{r['chain_head1_over_decode']:>14.2f} {tree:>28} "
              f"{r['tree_over_decode']:>8.2f}" + (f" {r['experts_per_pass']:>12.1f}" if experts else ""))
    print("a pass of w rows costing about one decode step (ratio ~1) is where speculation pays. chain: the LM head "
          "on every row; 1 head row: the trunk and row 0's head (the device loop's lazy pass rejecting its first "
          "draft; llama-bench -p w computes one row's logits too).")
