"""Tree speculative decoding: every tree node == single-token decode steps along its root path (bit for
bit: logits, hidden row, GDN conv/SSM snapshot), output == plain decoding (greedy and seeded, both
verify modes), acceptance >= the chain's, stats, stops, memory cap, API.

Fast tier: one file per architecture and a few (depth, tree_nodes); `@pytest.mark.slow` runs every
fixture file and more shapes. Run with -s for the acceptance figures.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharpi_jax.errors import InputError
from sharpi_jax.model.tree import tree_arrays
from sharpi_jax.runtime import draft_vocab
from sharpi_jax.runtime.sampling import SamplingParams
from sharpi_jax.runtime.state import gdn_caches
from sharpi_jax.runtime.strategies.chain import generate_mtp
from sharpi_jax.runtime.strategies.plain import generate_ids
from sharpi_jax.runtime.strategies.tree import generate_tree, generate_tree_device
from sharpi_jax.runtime.tree import capped_tree_nodes, snapshot_bytes_per_node
from sharpi_jax.runtime.tree_draft import branching
from tests.bitwise import assert_bitwise_equal
from tests.conftest import fixture_engine, load_references

MAX_CONTEXT = 512
GREEDY = SamplingParams()
FILES = [("tiny-qwen35moe", v) for v in ("F32", "BF16", "Q8_0", "Q4_K_M")] + \
        [("tiny-qwen35", v) for v in ("F32", "Q8_0", "Q4_K_M")] + [("tiny-qwen3next", v) for v in ("F32", "Q8_0")]


def files(fast):
    """Every fixture file; those not in `fast` are marked slow (CI skips them)."""
    return [pytest.param(n, v, id=f"{n[5:]}-{v}", marks=() if (n, v) in fast else pytest.mark.slow)
            for n, v in FILES]

# Tree shapes as parent lists (row 0 is the root), all run in one 16-row bucket (padding rows past them).
WIDTH = 16
SHAPES = {
    "chain": [-1, 0, 1, 2, 3],
    "star": [-1, 0, 0, 0, 0, 0],
    "binary3": [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6],
    "random": None,  # drawn below: parent[t] uniform in [0, t)
}


def engine(name, variant):
    return fixture_engine(name, variant, MAX_CONTEXT, (32,))


def prompts(name, variant):
    return load_references(name)["variants"][f"{name}-{variant}"]["tokens"]


def root_path(parent, node):
    path = [node]
    while parent[path[-1]] >= 0:
        path.append(parent[path[-1]])
    return path[::-1]


def test_tree_arrays():
    """Depths and ancestor tables from parents; bad trees raise."""
    depth, parent, anc = tree_arrays([-1, 0, 0, 1, 3], 5, 6)
    assert depth.tolist() == [0, 1, 1, 2, 3, 0] and parent.tolist() == [-1, 0, 0, 1, 3, -1]
    assert anc[4, :4].tolist() == [0, 1, 3, 4] and anc[2, :2].tolist() == [0, 2]
    assert anc[4, 4:].tolist() == [4, 5]  # past the depth: the view slot itself (masked)
    for bad in ([0, 0], [-1, 1], [-1, 0, 2], [-1, -1]):
        with pytest.raises(ValueError):
            tree_arrays(bad, len(bad))


@pytest.mark.parametrize("name,variant", files([("tiny-qwen35moe", "F32"), ("tiny-qwen3next", "F32")]))
def test_tree_nodes_bitwise_equal_decode_along_root_path(name, variant):
    """One trunk pass over chain / star / full binary depth 3 / random trees (with bucket padding), from
    a prefilled prompt: every node's logits, final-normed hidden and GDN conv/SSM snapshot == those of
    single-token decode steps along the node's root path, bit for bit."""
    e = engine(name, variant)
    rt = e.runtime
    prompt = prompts(name, variant)[0]
    _, _, state = rt.prefill(rt.new_state(), prompt)
    P = len(prompt)
    rng = np.random.default_rng(len(prompt))
    shapes = dict(SHAPES, random=[-1] + [int(rng.integers(0, t)) for t in range(1, 12)])
    for shape, parent in shapes.items():
        n = len(parent)
        tokens = np.zeros(WIDTH, np.int32)
        tokens[:n] = rng.integers(0, e.config.n_vocab, n)
        par = np.full(WIDTH, -1, np.int32)
        par[:n] = parent
        logits, greedy, hidden, _, snaps = rt.tree_commit_verify(jax.tree.map(jnp.copy, state), None, 0, 0, None, 0,
                                                                 jnp.asarray(tokens), P, n, par)
        logits, greedy, hidden = np.asarray(logits), np.asarray(greedy), np.asarray(hidden)
        gdn = [(np.asarray(g.conv), np.asarray(g.ssm)) for g in gdn_caches(snaps)]
        for node in range(n):
            s = jax.tree.map(jnp.copy, state)
            for d, j in enumerate(root_path(parent, node)):
                lg, h, s = rt.decode_step(s, int(tokens[j]), P + d)
            assert_bitwise_equal((np.asarray(lg), np.asarray(h)), (logits[node], hidden[node]), f"{shape} node {node}")
            assert_bitwise_equal([(np.asarray(g.conv), np.asarray(g.ssm)) for g in gdn_caches(s)],
                                 [(c[node], m[node]) for c, m in gdn], f"{shape} node {node} GDN state")
            assert greedy[node] == np.argmax(logits[node])


def check_generation(e, prompt, n, k, nodes, sampling=GREEDY):
    """Tree output (both verify modes) == plain output; the batched trace's accepted-path rows are bitwise
    the sequential trace's rows; stats agree. Returns (the batched stats, its trace)."""
    ref, _ = generate_ids(e.runtime, prompt, n, sampling)
    tb, ts = [], []
    out_b, st_b = generate_tree(e.runtime, e.mtp, prompt, n, sampling, (), k, nodes, "batched", trace=tb)
    out_s, st_s = generate_tree(e.runtime, e.mtp, prompt, n, sampling, (), k, nodes, "sequential", trace=ts)
    assert out_b == out_s == ref, f"k={k}, nodes={nodes}"
    assert len(tb) == len(ts)
    for b, s in zip(tb, ts):
        assert_bitwise_equal((b["tokens"], b["parent"]), (s["tokens"], s["parent"]))  # same drafts
        assert b["path"] == s["path"]
        p = b["path"]
        assert_bitwise_equal((b["logits"][p], b["hidden"][p], tuple(c[p] for c in b["conv"]),
                              tuple(c[p] for c in b["ssm"])), (s["logits"], s["hidden"], s["conv"], s["ssm"]))
        assert b["chain"].sum() == b["depth"].max() + 1  # the root + the greedy chain to the tree's depth
    for key in ("drafted", "accepted", "verify_passes", "accept_per_depth", "generated_tokens"):
        assert st_b[key] == st_s[key], key
    return st_b, tb


@pytest.mark.parametrize("name,variant", files([("tiny-qwen35moe", "F32")]))
def test_tree_greedy_equals_plain_and_beats_chain(name, variant):
    """Greedy tree output == plain, every prompt (prompt 3 runs into max_context), both verify modes;
    mean accepted length >= the chain's at the same depth on every prompt, strictly above it on average."""
    e = engine(name, variant)
    k, nodes = 3, 8
    tree_len, chain_len = [], []
    for i, prompt in enumerate(prompts(name, variant)):
        n = 40 if len(prompt) < 100 else 120
        st, trace = check_generation(e, prompt, n, k, nodes)
        chain_trace = []
        _, chain = generate_mtp(e.runtime, e.mtp, prompt, n, GREEDY, (), k, trace=chain_trace)
        first = trace[0]  # the first pass starts from the same state as the chain's: it holds the chain's drafts
        assert first["tokens"][first["chain"]].tolist() == chain_trace[0]["tokens"].tolist()
        print(f"{name}-{variant} prompt {i}: tree(k={k}, nodes={nodes}) {st['mean_accept_len']:.2f} vs chain "
              f"{chain['mean_accept_len']:.2f} tokens/pass")
        assert st["mean_accept_len"] >= chain["mean_accept_len"]
        tree_len.append(st["mean_accept_len"])
        chain_len.append(chain["mean_accept_len"])
        if i == 0:  # tree_nodes = depth: the tree is the chain drafter's chain, pass for pass
            _, same = generate_tree(e.runtime, e.mtp, prompt, n, GREEDY, (), k, k)
            assert (same["accepted"], same["verify_passes"]) == (chain["accepted"], chain["verify_passes"])
    assert np.mean(tree_len) > np.mean(chain_len)  # a tree, not just the chain: strictly more per pass


@pytest.mark.slow
@pytest.mark.parametrize("name,variant", [("tiny-qwen35moe", "F32"), ("tiny-qwen35", "Q8_0"),
                                          ("tiny-qwen3next", "F32")])
def test_tree_greedy_more_shapes(name, variant):
    """More (depth, tree_nodes): tree == chain drafter at tree_nodes = depth, wider trees lossless."""
    e = engine(name, variant)
    prompt = prompts(name, variant)[0]
    for k, nodes in ((1, 1), (1, 4), (2, 6), (4, 4), (4, 16), (6, 12)):
        st, _ = check_generation(e, prompt, 40, k, nodes)
        if nodes == k:
            _, chain = generate_mtp(e.runtime, e.mtp, prompt, 40, GREEDY, (), k)
            assert st["accepted"] == chain["accepted"] and st["verify_passes"] == chain["verify_passes"]


@pytest.mark.parametrize("name", ["tiny-qwen35moe", pytest.param("tiny-qwen3next", marks=pytest.mark.slow)])
def test_tree_sampled_equals_plain(name):
    """Seeded sampling: exact-match acceptance gives the plain sampler's tokens, both verify modes, on
    every prompt (32 tokens; 24 on the 411-token prompt)."""
    e = engine(name, "F32")
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7)
    for prompt in prompts(name, "F32"):
        st, _ = check_generation(e, prompt, 32 if len(prompt) < 100 else 24, 3, 8, sampling)
        assert st["accepted"] > 0


def test_stats_stops_and_memory_cap():
    """Stats against the trace; EOS inside an accepted path stops where plain decoding stops; the
    snapshot cap lowers tree_nodes and a cap below depth + 1 snapshots raises."""
    name = "tiny-qwen35moe"
    e = engine(name, "F32")
    prompt = prompts(name, "F32")[0]
    k, nodes = 3, 8
    trace = []
    out, s = generate_tree(e.runtime, e.mtp, prompt, 40, GREEDY, (), k, nodes, trace=trace)
    acc = [t["accepted"] for t in trace]
    assert s["verify_passes"] == len(trace) and s["accepted"] == sum(acc)
    assert s["drafted"] == sum(len(t["tokens"]) - 1 for t in trace)
    assert s["mean_accept_len"] == pytest.approx(np.mean(acc) + 1)
    assert s["accept_per_depth"] == pytest.approx([np.mean([a >= i for a in acc]) for i in range(1, k + 1)])
    assert all(len(t["tokens"]) - 1 <= nodes and t["depth"].max() <= k for t in trace)
    assert s["speculative"] == "mtp_tree" and s["tree_nodes"] == nodes and s["draft_s"] > 0 < s["verify_s"]
    # EOS = a token emitted as an accepted draft: stop mid-pass.
    emitted, pos = [], 1
    for a in acc:
        emitted += list(range(pos, pos + a))
        pos += a + 1
    stop = out[next(i for i in emitted if out[i] not in out[:i])]
    ref, rs = generate_ids(e.runtime, prompt, 40, GREEDY, {stop})
    got, gs = generate_tree(e.runtime, e.mtp, prompt, 40, GREEDY, {stop}, k, nodes)
    assert got == ref and gs["stop_reason"] == rs["stop_reason"] == "eos"
    # Memory: per-node bytes = every GDN layer's conv + SSM state.
    c = e.config
    per = sum(4 * ((c.ssm_conv_kernel - 1) * c.conv_dim + c.ssm_d_inner * c.ssm_d_state)
              for i in range(c.n_layer) if c.is_recurrent(i))
    assert snapshot_bytes_per_node(c) == per == s["snapshot_bytes_per_node"]
    assert capped_tree_nodes(c, nodes, 5 * per) == 4 and capped_tree_nodes(c, nodes, None) == nodes
    got, gs = generate_tree(e.runtime, e.mtp, prompt, 40, GREEDY, (), k, nodes, max_snapshot_bytes=5 * per)
    assert got == out[:40] and gs["tree_nodes"] == 4
    with pytest.raises(InputError, match="max_snapshot_bytes"):
        generate_tree(e.runtime, e.mtp, prompt, 4, GREEDY, (), k, nodes, max_snapshot_bytes=3 * per)


def test_engine_generate_tree_api():
    """engine.generate(speculative="mtp_tree") == plain generate; bad options raise InputError."""
    name = "tiny-qwen35moe"
    e = engine(name, "F32")
    prompt = prompts(name, "F32")[1]
    ref = e.generate(prompt, max_new_tokens=24)
    for verify in ("batched", "sequential"):
        out = e.generate(prompt, max_new_tokens=24, speculative="mtp_tree", draft_tokens=3, tree_nodes=8,
                         verify=verify)
        assert out.tokens == ref.tokens and out.text == ref.text
        for field in ("drafted", "accepted", "mean_accept_len", "accept_per_depth", "verify_passes", "tree_nodes",
                      "snapshot_bytes_per_node"):
            assert getattr(out.stats.speculation, field) is not None, field
    for kw in (dict(tree_nodes=2, draft_tokens=3), dict(tree_nodes=0), dict(tree_nodes=True), dict(verify="x"),
               dict(max_snapshot_bytes=1)):
        with pytest.raises(InputError):
            e.generate(prompt, max_new_tokens=4, speculative="mtp_tree", **kw)
    with pytest.raises(InputError, match="mtp_tree"):
        e.generate(prompt, max_new_tokens=4, speculative="mtp", tree_nodes=8)
    out = e.generate(prompt, max_new_tokens=4, speculative="mtp_tree", kv_policy="snapkv", kv_budget=8,
                     kv_window=4)  # combined (tokens checked in tests/runtime/test_snapkv.py)
    assert out.tokens == e.generate(prompt, max_new_tokens=4, kv_policy="snapkv", kv_budget=8, kv_window=4).tokens
    assert out.stats.kv.evicted > 0


def reference_tree(e, prompt, t, k, nodes, ids=None):
    """The drafting rule of `tree_draft` re-derived from sequential single-row MTP steps (no tree rows,
    no beam batching): every expanded node runs one MTP row on a copy of its parent's MTP cache, at MTP
    position P - 1 + depth, paired with its parent's MTP output. ids (ascending): a draft vocabulary, the
    full head's logits at those ids only. Returns {root path (tuple of tokens, root excluded): (cumulative
    float64 log-prob, on the greedy chain)} for the kept nodes, and the number of candidates."""
    rt, mtp = e.runtime, e.mtp
    chunks, _, _ = rt.prefill(rt.new_state(), prompt)
    cache, h_last, _ = mtp.prefill(mtp.new_cache(), prompt, chunks)
    c = branching(k, nodes)
    P = len(prompt)

    def expand(cache, tok, h, pos):
        hp, cache, _ = mtp.rows(jax.tree.map(jnp.copy, cache), [tok, tok], jnp.stack([h, h]), pos, 1)
        x = np.asarray(mtp.logits(hp))[0].astype(np.float64)
        tok = np.arange(x.shape[0]) if ids is None else np.asarray(ids)
        x = x[tok]
        lp = x - x.max() - np.log(np.sum(np.exp(x - x.max())))
        top = np.argsort(-lp, kind="stable")[:c]  # ties: the lower id (ids ascending)
        return cache, hp[0], [(int(tok[j]), float(lp[j])) for j in top]

    cand = {}  # path -> (score, chain)
    state = {(): expand(cache, t, h_last, P - 1)}
    for j, (tok, lp) in enumerate(state[()][2]):
        cand[(tok,)] = (lp, j == 0)
    for d in range(1, k):
        level = [p for p in cand if len(p) == d]
        beam = sorted(level, key=lambda p: (not cand[p][1], -cand[p][0]))[:c]
        for p in beam:
            pc, ph, _ = state[p[:-1]]
            state[p] = expand(pc, p[-1], ph, P - 1 + d)
            for j, (tok, lp) in enumerate(state[p][2]):
                cand[p + (tok,)] = (cand[p][0] + lp, cand[p][1] and j == 0)
    chain = [p for p in cand if cand[p][1]]
    others = sorted((p for p in cand if not cand[p][1]), key=lambda p: (-cand[p][0], len(p)))
    kept = chain + others[:max(0, nodes - len(chain))]
    return {p: cand[p] for p in kept}, len(cand)


def tree_paths(tr):
    """{root path (tokens, root excluded): on the greedy chain} of a traced pass."""
    out = {}
    for i in range(1, len(tr["tokens"])):
        path, j = [], i
        while tr["parent"][j] >= 0:
            path.append(int(tr["tokens"][j]))
            j = tr["parent"][j]
        out[tuple(path[::-1])] = bool(tr["chain"][i])
    return out


@pytest.mark.parametrize("k,nodes", [(1, 12), (2, 5), (3, 8)])
def test_drafter_drafts_the_best_tree(k, nodes):
    """tree_nodes > depth: every pass drafts min(tree_nodes, candidates) nodes, stats["drafted_nodes"]
    reports them, non-chain nodes exist; the first pass's tree == `reference_tree` (the greedy chain plus
    the best other candidates by cumulative log-prob of MTP logits computed by sequential MTP steps)."""
    name = "tiny-qwen35moe"
    e = engine(name, "F32")
    prompt = prompts(name, "F32")[0]
    trace = []
    out, st = generate_tree(e.runtime, e.mtp, prompt, 24, GREEDY, (), k, nodes, trace=trace)
    want, n_cand = reference_tree(e, prompt, out[0], k, nodes)
    c = branching(k, nodes)
    assert n_cand == c + (k - 1) * c * c
    assert st["drafted_nodes"] == [len(t["tokens"]) - 1 for t in trace] == [min(nodes, n_cand)] * len(trace)
    assert st["drafted"] == sum(st["drafted_nodes"]) and st["tree_nodes"] == nodes
    assert all((~t["chain"][1:]).any() and t["depth"].max() == k for t in trace)
    got = tree_paths(trace[0])
    assert got == {p: ch for p, (_, ch) in want.items()}
    print(f"k={k} nodes={nodes}: {len(want)} nodes, {n_cand} candidates, chain "
          f"{[p for p, ch in got.items() if ch]}")


@pytest.mark.parametrize("k,nodes", [(2, 5), (3, 8)])
def test_tree_with_a_draft_vocabulary(k, nodes):
    """Tree.draft_vocab: every drafting call over N ids only. The first pass's tree == `reference_tree`
    over the full head's logits at those ids; every drafted token is one of them and the trees differ
    from the full head's (the subset changes the drafts); the tokens == plain decoding, greedy and seeded;
    the device loop's tokens and pass stats == the host loop's."""
    name = "tiny-qwen35moe"
    e = engine(name, "F32")
    prompt = prompts(name, "F32")[0]
    ref, _ = generate_ids(e.runtime, prompt, 24, GREEDY)
    # The subset: the tokens of the greedy text (so drafts are often right) and every third id of the rest.
    V = e.config.n_vocab
    keep = set(prompt) | set(ref) | set(range(0, V, 3))
    rank = np.array(sorted(keep) + sorted(set(range(V)) - keep), np.int32)
    vocab = draft_vocab.build(e.mtp._head_parts, rank, len(keep))
    ids = np.asarray(vocab.ids)
    full_trace, trace = [], []
    generate_tree(e.runtime, e.mtp, prompt, 24, GREEDY, (), k, nodes, trace=full_trace)
    out, st = generate_tree(e.runtime, e.mtp, prompt, 24, GREEDY, (), k, nodes, trace=trace, vocab=vocab)
    assert out == ref and st["draft_vocab"] == len(keep) and st["accepted"] > 0
    want, _ = reference_tree(e, prompt, out[0], k, nodes, ids)
    assert tree_paths(trace[0]) == {p: ch for p, (_, ch) in want.items()}
    drafted = np.concatenate([t["tokens"][1:] for t in trace])
    assert np.isin(drafted, ids).all()
    assert tree_paths(trace[0]) != tree_paths(full_trace[0])
    for sampling in (GREEDY, SamplingParams(temperature=0.8, top_k=40, seed=3)):
        host, hs = generate_tree(e.runtime, e.mtp, prompt, 24, sampling, (), k, nodes, vocab=vocab)
        dev, ds = generate_tree_device(e.runtime, e.mtp, prompt, 24, sampling, (), k, nodes, vocab=vocab)
        assert host == dev == generate_ids(e.runtime, prompt, 24, sampling)[0]
        for key in ("drafted", "accepted", "verify_passes", "drafted_nodes", "accept_per_depth", "draft_vocab"):
            assert ds[key] == hs[key], key
