"""`experiments.pass_experts`: the distinct experts a speculative run's verify passes read, against a
brute-force count (every row of every pass routed by its own unpadded teacher-forced trace of the
committed prefix plus the row's path), on the trained tiny MoE fixture, chain and tree."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.pass_experts import experts_per_pass, pass_rows
from sharpi_jax.runtime.routing import top_k_ids, trace_routing
from tests.conftest import fixture_engine, load_references

N_NEW = 8


def _brute_force(engine, ids, run) -> float:
    """Each row: prefix (the committed tokens before its pass) + the tokens on its path from the pass's
    root, traced alone; a pass's count: per MoE layer, the union of its rows' top-k."""
    seq, k = list(ids) + run.tokens, engine.config.n_expert_used
    per_pass = []
    for p in run.passes:
        rows = []
        for node in range(len(p.tokens)):
            path = [node]
            while p.parent[path[-1]] >= 0:
                path.append(int(p.parent[path[-1]]))
            toks = seq[:p.P] + [int(p.tokens[i]) for i in reversed(path)]
            rows.append(trace_routing(engine.model, toks).probs[:, -1])  # [L, E]
        top = top_k_ids(np.stack(rows, axis=1), k)  # [L, m, k]
        per_pass.append(np.mean([len(np.unique(t)) for t in top]))
    return float(np.mean(per_pass))


@pytest.mark.parametrize("kw", [dict(speculative="mtp", draft_tokens=3),
                                dict(speculative="mtp_tree", draft_tokens=2, tree_nodes=4)],
                         ids=["chain-k3", "tree-2x4"])
def test_experts_per_pass_matches_every_row_traced_alone(kw):
    e = fixture_engine("tiny-qwen35moe", "F32", 64)
    ids = load_references("tiny-qwen35moe")["variants"]["tiny-qwen35moe-F32"]["tokens"][0]
    run = pass_rows(e, ids, N_NEW, **kw)
    assert run.tokens == e.generate(ids, max_new_tokens=N_NEW, stop_on_eos=False).tokens  # lossless: MTP off's
    rows = [len(p.tokens) for p in run.passes]
    # The claim is not trivial here: passes verify several rows, and some drafts are rejected (their rows
    # are off the generated sequence, so only a replay of their branch routes them).
    assert max(rows) > 1 and any(len(p.path) < len(p.tokens) for p in run.passes)
    # The prefill gives the first token; each pass emits its accepted drafts and the target's next token.
    assert 1 + sum(len(p.path) for p in run.passes) >= N_NEW
    got = experts_per_pass(e, ids, run)
    k = e.config.n_expert_used
    assert k <= got <= k * max(rows)
    assert got == pytest.approx(_brute_force(e, ids, run), abs=1e-12)
