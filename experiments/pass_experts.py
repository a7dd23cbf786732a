"""Distinct routed experts the verify passes of a speculative generation read, per MoE layer: what a
pass costs in expert bytes beside the tokens it yields (an MTP-off step reads top-k experts a layer).

`pass_rows(engine, ids, n, **kw)` runs the generation once on the host loop (greedy, batched verify,
the same drafts as the device loop: both loops give the same tokens) and keeps each pass's verify rows:
their tokens, positions and, for a tree, parents. `experts_per_pass(engine, ids, run)` routes every row
of every pass teacher-forced (`runtime.routing.trace_routing`: the trunk's own router, each row seeing
its own prefix): rows on the generated sequence from one trace of it, a rejected draft's rows (and a tree's
off-path branches) from a trace of the committed prefix plus that branch. A replay can differ from the
pass in the last bits, so an expert choice at a near-tie of router probabilities may differ; the count
is a measurement aid, not a bitwise claim. Traces are padded to one length, so one compilation serves
every pass (rows are causal: padding after a row does not change its routing). The single-pass timing's
fixed rows (`--pass_widths`) have their own count: `pass_timing.experts_per_width`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Pass:
    """One verify pass: row tokens [m] (row 0 the certain token), its position P, each row's parent
    (a chain: r - 1; -1 for row 0) and accepted drafts (the rows 0..accepted on the emitted path)."""

    tokens: np.ndarray
    P: int
    parent: np.ndarray
    path: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Run:
    """A host-loop generation's tokens (after the prompt) and passes."""

    tokens: list[int]
    passes: list[Pass]


class _RowsOnly(list):
    """A decoder trace (`speculative.MTPDecoder` / `tree.TreeDecoder`) that keeps each pass's row tokens,
    parents and accepted path and drops the rest (logits, hidden and GDN states: hundreds of MB a pass at
    real shapes)."""

    def append(self, d: dict) -> None:
        toks = np.asarray(d["tokens"])
        if "parent" in d:  # a tree (batched verify): nodes 0..n-1 in row order, the accepted path of nodes
            parent, path = np.asarray(d["parent"]), tuple(int(i) for i in d["path"])
        else:  # a chain: rows 0..m-1, a prefix accepted
            parent, path = np.arange(len(toks)) - 1, tuple(range(int(d["accepted"]) + 1))
        super().append((np.array(toks, np.int32), np.array(parent, np.int32), path))


def pass_rows(engine, ids: Sequence[int], n: int, speculative: str = "mtp", draft_tokens: int = 1,
              tree_nodes: int | None = None, draft_vocab: int | None = None,
              draft_p_min: float | None = None) -> Run:
    """The host-loop greedy generation of n tokens after ids (no stop at EOS) with these options, and its
    passes' rows."""
    from sharpi_jax.runtime.sampling import SamplingParams
    from sharpi_jax.runtime.strategies.chain import generate_mtp
    from sharpi_jax.runtime.strategies.tree import generate_tree

    trace = _RowsOnly()
    if speculative == "mtp":
        out, _ = generate_mtp(engine.runtime, engine.mtp, ids, n, SamplingParams(), (), draft_tokens, "batched",
                              trace=trace, vocab=engine.mtp.draft_vocab(draft_vocab), p_min=draft_p_min)
    else:
        out, _ = generate_tree(engine.runtime, engine.mtp, ids, n, SamplingParams(), (), draft_tokens,
                               tree_nodes or 8, "batched", trace=trace, vocab=engine.mtp.draft_vocab(draft_vocab))
    passes, P = [], len(ids)  # the first pass's certain token is the prefill's, at position len(ids)
    for toks, parent, path in trace:
        passes.append(Pass(toks, P, parent, path))
        P += len(path)  # the accepted drafts and the certain token
    return Run([int(t) for t in out], passes)


def _node_paths(parent: np.ndarray) -> list[list[int]]:
    """Each node's path from the root (node 0), root included."""
    paths: list[list[int]] = []
    for i, p in enumerate(parent):
        paths.append([i] if p < 0 else paths[int(p)] + [i])
    return paths


def experts_per_pass(engine, ids: Sequence[int], run: Run) -> float | None:
    """Mean over passes of the distinct routed experts a pass's rows select, mean over the MoE layers
    (None for a dense model or a run without passes)."""
    from sharpi_jax.runtime.routing import top_k_ids, trace_routing

    c = engine.config
    if not c.is_moe or not run.passes:
        return None
    seq = list(ids) + run.tokens
    depth = max(len(p.tokens) for p in run.passes)
    T = max(len(seq), max(p.P for p in run.passes) + depth)
    T = -(-T // 64) * 64  # one padded length: one compilation for every trace

    def route(tokens: list[int]) -> np.ndarray:
        """[L, len(tokens), k] expert ids of a teacher-forced trace (NaN layers: not MoE, dropped later)."""
        tr = trace_routing(engine.model, tokens + [0] * (T - len(tokens)))
        return tr.probs[:, :len(tokens)]

    probs_seq = route(seq)
    moe = [l for l in range(probs_seq.shape[0]) if not np.isnan(probs_seq[l]).any()]
    k = c.n_expert_used
    per_pass = []
    for p in run.passes:
        paths = _node_paths(p.parent)
        rows: dict[int, np.ndarray] = {}  # node -> [L, E] router probs
        for node, path in enumerate(paths):
            if node in rows:
                continue
            branch = [int(p.tokens[i]) for i in path]
            pos = p.P + len(path) - 1
            prefix = seq[:p.P]
            if seq[p.P:pos + 1] == branch:  # the node lies on the generated sequence
                rows[node] = probs_seq[:, pos]
                continue
            # A rejected branch: replay its deepest path through this node once for all its nodes.
            leaf = max((q for q in paths if q[:len(path)] == path), key=len)
            probs = route(prefix + [int(p.tokens[i]) for i in leaf])
            for d, q in enumerate(leaf):
                rows.setdefault(q, probs[:, p.P + d])
        stacked = np.stack([rows[i] for i in range(len(paths))], axis=1)  # [L, m, E]
        top = top_k_ids(stacked[moe], k)  # [L', m, k]
        per_pass.append(np.mean([len(np.unique(t)) for t in top]))
    return float(np.mean(per_pass))
