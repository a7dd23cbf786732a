"""The device loop (`sharpi_jax.runtime.device_loop`): one jitted while_loop per generation gives the
host loop's tokens and stats, bit for bit, for MTP off, the MTP chain and the MTP tree, greedy and
seeded; stops (EOS inside an accepted run, max_new_tokens, the context end) land where the host loop's
do; SnapKV. The verify head (`RunConfig.verify_head`): "lazy" computes the LM head of the walked rows
only, "full" every row, the default on ggml full up to 4 rows and lazy above; all, and lazy on XLA, give
the host loop's tokens, and the lazy program has no full-width head product.

Fast tier: the embedded default model and one fixture file; slow: every fixture file."""

from __future__ import annotations

import re

import pytest

import sharpi_jax as sj
from sharpi_jax.errors import InputError
from sharpi_jax.model.snapkv import policy
from sharpi_jax.runtime.device_loop import out_slots
from sharpi_jax.runtime.sampling import SamplingParams
from sharpi_jax.runtime.strategies import chain, tree
from sharpi_jax.runtime.strategies.chain import generate_mtp, generate_mtp_device
from sharpi_jax.runtime.strategies.plain import generate_ids, generate_ids_device
from sharpi_jax.runtime.strategies.tree import generate_tree, generate_tree_device
from sharpi_jax.runtime.steps import ALL_ROWS, AUTO_FULL_HEAD_ROWS, full_head_rows
from tests.conftest import fixture_engine, load_references

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7)
SHARED = ("generated_tokens", "stop_reason", "kv_slots", "kv_evicted", "kv_capacity")
PASSES = ("drafted", "accepted", "verify_passes", "accept_per_position", "mean_accept_len", "acceptance_rate")
TREE_PASSES = ("drafted", "drafted_nodes", "accepted", "verify_passes", "accept_per_depth", "mean_accept_len",
               "tree_nodes")
VARIANTS = [("tiny-qwen35moe", v) for v in ("F32", "BF16", "Q8_0", "Q4_K_M")] + \
           [("tiny-qwen35", v) for v in ("F32", "Q8_0", "Q4_K_M")] + \
           [("tiny-qwen3next", v) for v in ("F32", "Q8_0")]


@pytest.fixture(scope="module")
def default_engine():
    return sj.load(max_context=256)


def check(e, prompt, n, sampling, k=3, stop_ids=(), kv=None, modes=("plain", "chain", "tree"), nodes=8):
    """Device loop == host loop (tokens and stats) for the given modes, and chain == tree == plain
    (the tree: depth k, `nodes` nodes). Returns the host runs {mode: (tokens, stats)}."""
    ref = generate_ids(e.runtime, prompt, n, sampling, stop_ids, kv)
    runs = {"plain": ref}
    if "plain" in modes:
        dev = generate_ids_device(e.runtime, prompt, n, sampling, stop_ids, kv)
        assert dev[0] == ref[0]
        for key in SHARED:
            assert dev[1][key] == ref[1][key], key
        assert dev[1]["loop"] == "device"
    if "chain" in modes:
        host = generate_mtp(e.runtime, e.mtp, prompt, n, sampling, stop_ids, k, kv=kv)
        dev = generate_mtp_device(e.runtime, e.mtp, prompt, n, sampling, stop_ids, k, kv=kv)
        assert host[0] == ref[0] and dev[0] == ref[0]
        for key in SHARED + PASSES:
            assert dev[1][key] == host[1][key], key
        runs["chain"] = host
    if "tree" in modes and kv is None:
        host = generate_tree(e.runtime, e.mtp, prompt, n, sampling, stop_ids, k, nodes)
        dev = generate_tree_device(e.runtime, e.mtp, prompt, n, sampling, stop_ids, k, nodes)
        assert host[0] == ref[0] and dev[0] == ref[0]
        for key in SHARED[:2] + TREE_PASSES:
            assert dev[1][key] == host[1][key], key
        assert dev[1]["loop"] == "device"
        runs["tree"] = host
    return runs


def test_greedy_and_seeded_equal_host_loop(default_engine, monkeypatch):
    """The device loops with the lazy verify head (the walk; `test_full_verify_head_gives_the_lazy_loops_tokens`
    holds the full head to it) give the host loop's tokens and stats, greedy and seeded."""
    e = default_engine
    monkeypatch.setattr(e.runtime, "full_head_rows", 0)
    prompt = e.tokenizer.encode("def fibonacci(n):\n")
    greedy = check(e, prompt, 40, GREEDY)
    seeded = check(e, prompt, 40, SEEDED, modes=("chain", "tree"))
    assert seeded["plain"][0] != greedy["plain"][0]  # the sampler is really sampling
    for runs in (greedy, seeded):
        for mode in ("chain", "tree"):
            s = runs[mode][1]
            assert s["accepted"] > 0 and s["accepted"] < s["drafted"]  # accepting and rejecting passes (rollback)


def test_device_loops_reuse_their_snapshot_buffers(default_engine):
    """A speculative device loop hands its GDN snapshot buffers back to the runtime, and the next loop of
    the same width writes into those same buffers (no new ones per generation), seeding row 0 with its
    state: what they held, the last generation's snapshots, is never read. Different prompts in a row
    give the host loop's tokens and, bit for bit, its last pass's snapshots (one pass: n = 3; several:
    n = 24), for the chain and the tree."""
    import jax
    import numpy as np
    from sharpi_jax.runtime.state import gdn_caches
    from tests.bitwise import assert_bitwise_equal
    e = default_engine
    rt = e.runtime
    prompts = [e.tokenizer.encode(t) for t in ("def fibonacci(n):\n", "import os\nimport sys\n\n\nclass ")]
    runs = {"chain": (lambda p, n, trace: generate_mtp(rt, e.mtp, p, n, GREEDY, (), 3, trace=trace),
                      lambda p, n: generate_mtp_device(rt, e.mtp, p, n, GREEDY, (), 3)),
            "tree": (lambda p, n, trace: generate_tree(rt, e.mtp, p, n, GREEDY, (), 3, 8, trace=trace),
                     lambda p, n: generate_tree_device(rt, e.mtp, p, n, GREEDY, (), 3, 8))}
    for mode, (host, device) in runs.items():
        ptrs = []
        for p, n in [(p, n) for n in (3, 24) for p in prompts]:
            trace = []
            want = host(p, n, trace)[0]
            assert device(p, n)[0] == want, (mode, n)
            last = trace[-1]
            m = len(last["conv"][0])  # the last pass's rows
            kept = gdn_caches(rt._snapshot_buffers)
            # (copies: a numpy view of a buffer would keep the next loop from donating it)
            got = (tuple(np.array(g.conv)[:m] for g in kept), tuple(np.array(g.ssm)[:m] for g in kept))
            del kept
            assert_bitwise_equal(got, (last["conv"], last["ssm"]))
            ptrs.append([a.unsafe_buffer_pointer() for a in jax.tree.leaves(rt._snapshot_buffers)])
        assert ptrs[0] and all(q == ptrs[0] for q in ptrs), mode


def test_decode_loop_copies_no_state(default_engine):
    """The MTP-off device loop takes the sequence's state donated and hands it back: the compiled loop
    copies no KV cache or GDN state into its own buffers (not donated, XLA copied every one of them at
    the start of every generation)."""
    import jax
    import numpy as np
    from sharpi_jax.runtime.device_loop import eos_array
    from sharpi_jax.runtime.sampling import traced_params
    from sharpi_jax.runtime.strategies import plain
    rt = default_engine.runtime
    state = rt.new_state()
    logits = np.zeros(default_engine.config.n_vocab, np.float32)
    fn = plain.jitted_loop(rt.steps.decode)
    text = fn.lower(rt.params, rt.cache, state, logits, np.int32(3), np.int32(8), np.int32(rt.max_context),
                    eos_array(()), traced_params(GREEDY), np.zeros(out_slots(8), np.int32),
                    greedy=True).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    shapes = {"f32[" + ",".join(map(str, a.shape)) + "]" for a in jax.tree.leaves(state)}
    copies = [line.strip()[:120] for line in entry.splitlines()
              if (m := re.match(r"\s*(?:ROOT )?%\S+ = (f32\[[\d,]*\])\S* copy\(", line)) and m.group(1) in shapes]
    assert not copies, copies


def test_tree_shapes(default_engine):
    """The tree loop at other depths / node counts (the chain as a tree: nodes = depth; a single level)."""
    e = default_engine
    prompt = e.tokenizer.encode("import os\nimport sys\n\n\nclass ")
    for k, nodes in ((1, 4), (3, 3), (2, 5)):
        check(e, prompt, 24, GREEDY, k=k, modes=("tree",), nodes=nodes)


def test_stops(default_engine):
    """EOS = a token emitted as an accepted draft (mid-pass), max_new_tokens 0 / 1 / inside a pass, and
    the context end (the last passes draft fewer than k tokens)."""
    e = default_engine
    prompt = e.tokenizer.encode("import os\nimport sys\n\n\nclass ")
    runs = check(e, prompt, 40, GREEDY, modes=("chain", "tree"))
    out, s = runs["chain"]
    trace = []
    assert generate_mtp(e.runtime, e.mtp, prompt, 40, GREEDY, (), 3, trace=trace)[0] == out
    emitted, pos = [], 1
    for t in trace:
        emitted += list(range(pos, pos + t["accepted"]))
        pos += t["accepted"] + 1
    first_new = [i for i in emitted if out[i] not in out[:i]]
    assert first_new
    stop = out[first_new[0]]
    host = check(e, prompt, 40, GREEDY, stop_ids={stop})
    assert host["chain"][1]["stop_reason"] == "eos" and len(host["chain"][0]) == first_new[0] + 1
    assert host["tree"][1]["stop_reason"] == "eos"
    for n in (0, 1, 2, 5):
        check(e, prompt, n, GREEDY)
    long = e.tokenizer.encode("def f(x):\n    return x\n" * 40)[: e.max_context - 20]
    ctx = check(e, long, 60, GREEDY)
    assert ctx["chain"][1]["stop_reason"] == ctx["tree"][1]["stop_reason"] == "max_context"
    assert ctx["tree"][1]["drafted_nodes"][-1] < 8  # the last passes' trees shrink at the context end
    assert len(ctx["chain"][0]) == e.max_context - len(long) + 1


def test_snapkv(default_engine):
    e = default_engine
    prompt = e.tokenizer.encode("def f(x):\n    return x + 1\n" * 12)
    kv = policy("snapkv", 48, 16, 7)
    runs = check(e, prompt, 24, GREEDY, kv=kv)
    assert runs["chain"][1]["kv_evicted"] > 0


def test_engine_generate_loop_option(default_engine):
    e = default_engine
    for spec in (None, "mtp", "mtp_tree"):
        host = e.generate("def fibonacci(n):\n", max_new_tokens=20, speculative=spec, loop="host")
        dev = e.generate("def fibonacci(n):\n", max_new_tokens=20, speculative=spec)
        assert dev.tokens == host.tokens and dev.text == host.text
        assert (host.stats.speed.loop, dev.stats.speed.loop) == ("host", "device")
    seq = e.generate("def fibonacci(n):\n", max_new_tokens=20, speculative="mtp", verify="sequential")
    assert seq.stats.speed.loop == "host" and seq.tokens == dev.tokens  # sequential verify is the host reference
    with pytest.raises(InputError, match="loop must be one of"):
        e.generate("x", loop="gpu")


def test_full_verify_head_gives_the_lazy_loops_tokens(default_engine, monkeypatch):
    """verify_head "full" (every verify row's head in the pass) gives the tokens and pass stats of the
    lazy head (which the tests above hold to the host loop): the chain greedy, the tree seeded.
    (Batches of sequences run the full head too: `tests/runtime/test_batch.py` holds them to these loops.)"""
    e = default_engine
    monkeypatch.setattr(e.runtime, "full_head_rows", 0)
    prompt = e.tokenizer.encode("def fibonacci(n):\n")
    runs = dict(chain=lambda: generate_mtp_device(e.runtime, e.mtp, prompt, 40, GREEDY, (), 3),
                tree=lambda: generate_tree_device(e.runtime, e.mtp, prompt, 40, SEEDED, (), 3, 8))
    lazy = {mode: run() for mode, run in runs.items()}
    monkeypatch.setattr(e.runtime, "full_head_rows", ALL_ROWS)
    for mode, run in runs.items():
        tokens, stats = run()
        assert tokens == lazy[mode][0], mode
        for key in SHARED[:2] + (PASSES if mode == "chain" else TREE_PASSES):
            assert stats[key] == lazy[mode][1][key], (mode, key)
        assert 0 < stats["accepted"] < stats["drafted"]


def test_verify_head_option():
    """`verify_head` resolves at load: "auto" computes the head of passes up to AUTO_FULL_HEAD_ROWS rows in one
    product on ggml and of every pass off ggml; "full" and "lazy" hold for every width; a bad value is a
    one-line error."""
    widest = 1 << 20
    auto = sj.load(max_context=64).runtime
    assert auto.lazy_head_for(AUTO_FULL_HEAD_ROWS + 1) and not auto.lazy_head_for(2)
    assert not auto.lazy_head_for(AUTO_FULL_HEAD_ROWS)
    assert not sj.load(max_context=64, verify_head="full").runtime.lazy_head_for(widest)
    assert sj.load(max_context=64, verify_head="lazy").runtime.lazy_head_for(2)
    assert not sj.load(max_context=64, kernels="xla").runtime.lazy_head_for(widest)
    assert sj.load(max_context=64, run=sj.RunConfig(kernels="xla", verify_head="lazy")).runtime.lazy_head_for(2)
    with pytest.raises(InputError, match="verify_head must be one of"):
        sj.load(max_context=64, verify_head="sometimes")


def test_lazy_verify_head_on_xla_equals_the_host_loop():
    """Lazy forced on XLA, whose float head computes a 2-row bucket per walked row (M >= 2 keeps a row's
    bits): the host loop's tokens, the tree (the walk over children) seeded."""
    with sj.load(max_context=256, kernels="xla", verify_head="lazy") as e:
        prompt = e.tokenizer.encode("def fibonacci(n):\n")
        runs = check(e, prompt, 24, SEEDED, modes=("tree",))
        assert 0 < runs["tree"][1]["accepted"] < runs["tree"][1]["drafted"]  # the walk goes down and stops


_LOOPS = {chain: chain.jitted_loop, tree: tree.jitted_loop}


class _Lowered(Exception):
    pass


def _head_products(monkeypatch, e, module, run) -> list[tuple[int, int]]:
    """The [rows, n_vocab] ggml products in the program of `module.jitted_loop` that `run()` dispatches."""
    texts, build = [], _LOOPS[module]

    def spy(*fns):
        fn = build(*fns)

        def call(*args, **kwargs):
            texts.append(fn.lower(*args, **kwargs).as_text())
            raise _Lowered  # the program's text is all this needs: no compile, no run
        return call

    monkeypatch.setattr(module, "jitted_loop", spy)
    with pytest.raises(_Lowered):
        run()
    V = e.config.n_vocab
    (text,) = texts
    calls = [line for line in text.splitlines() if "sharpi_ggml_matmul" in line and "custom_call" in line]
    return [(int(m), V) for line in calls for m in re.findall(rf"tensor<(\d+)x{V}xf32>", line.split("->")[-1])]


def test_lazy_verify_head_computes_one_head_row_at_a_time(default_engine, monkeypatch):
    """The lever itself: with the lazy head the chain's and the tree's loop programs hold no trunk head
    product of the pass's width ([K + 1, V] for the chain, [N + 1, V] for the tree), only the 2-row bucket of
    one walked row (row 1 not computed), while "full" holds the pass-wide one. (The MTP drafter's own head
    products, the same matrix, are the same in both.)"""
    e = default_engine
    monkeypatch.setattr(e.runtime, "full_head_rows", 0)
    prompt, V = e.tokenizer.encode("def f(x):\n"), e.config.n_vocab
    runs = dict(chain=(chain, lambda: generate_mtp_device(e.runtime, e.mtp, prompt, 4, GREEDY, (), 3)),
                tree=(tree, lambda: generate_tree_device(e.runtime, e.mtp, prompt, 4, GREEDY, (), 3, 8)))
    lazy = {name: _head_products(monkeypatch, e, *run) for name, run in runs.items()}
    monkeypatch.setattr(e.runtime, "full_head_rows", ALL_ROWS)
    full = {name: _head_products(monkeypatch, e, *run) for name, run in runs.items()}
    for name, width in (("chain", 4), ("tree", 9)):
        assert (width, V) in full[name] and (width, V) not in lazy[name], (name, full[name], lazy[name])
        assert (2, V) in lazy[name]
        assert set(full[name]) - {(width, V)} <= set(lazy[name])  # only the pass's head changed


def test_auto_verify_head_picks_by_pass_width(default_engine, monkeypatch):
    """"auto" on ggml (the default here): a chain pass of up to AUTO_FULL_HEAD_ROWS rows holds the pass-wide
    head product and a wider one (chain k = 4, the 9-row tree) walks lazily. Read from the loop programs, as
    the test above."""
    e = default_engine
    monkeypatch.setattr(e.runtime, "full_head_rows", full_head_rows("auto", on_ggml=True))
    prompt, V = e.tokenizer.encode("def f(x):\n"), e.config.n_vocab
    full_at = AUTO_FULL_HEAD_ROWS
    runs = [(chain, k + 1, lambda k=k: generate_mtp_device(e.runtime, e.mtp, prompt, 4, GREEDY, (), k))
            for k in (AUTO_FULL_HEAD_ROWS - 1, AUTO_FULL_HEAD_ROWS)]
    runs.append((tree, 9, lambda: generate_tree_device(e.runtime, e.mtp, prompt, 4, GREEDY, (), 3, 8)))
    for module, width, run in runs:
        products = _head_products(monkeypatch, e, module, run)
        assert ((width, V) in products) == (width <= full_at), (module.__name__, width, products)


def test_out_slots():
    assert out_slots(1) == 64 and out_slots(48, 3) == 64 and out_slots(61, 3) == 128
    assert all(out_slots(n, k) >= n + k + 1 for n in range(300) for k in range(8))


@pytest.mark.parametrize("name,variant", [("tiny-qwen35moe", "Q8_0")], ids=["qwen35moe-Q8_0"])
def test_fixture_greedy(name, variant):
    e = fixture_engine(name, variant, 512, (32,))
    prompt = load_references(name)["variants"][f"{name}-{variant}"]["tokens"][0]
    check(e, prompt, 24, GREEDY)


@pytest.mark.slow
@pytest.mark.parametrize("name,variant", VARIANTS, ids=[f"{n[5:]}-{v}" for n, v in VARIANTS])
def test_every_fixture_file(name, variant):
    e = fixture_engine(name, variant, 512, (32,))
    for prompt in load_references(name)["variants"][f"{name}-{variant}"]["tokens"]:
        for sampling in (GREEDY, SEEDED):
            check(e, prompt, 32, sampling)


def test_eos_at_every_depth_of_a_tree_pass(default_engine):
    """EOS emitted as the accepted draft at each depth 1..k of a tree pass, and as a pass's own (bonus)
    token: the device loop and the host loop both stop on it, with plain decoding's tokens up to it
    (plain greedy decoding without EOS, cut after the first EOS) and the same pass stats."""
    e, k, n = default_engine, 3, 32
    prompt = e.tokenizer.encode("import os\nimport sys\n\n\nclass ")
    plain = generate_ids(e.runtime, prompt, n, GREEDY)[0]
    trace = []
    assert generate_tree(e.runtime, e.mtp, prompt, n, GREEDY, (), k, 8, trace=trace)[0] == plain
    at_depth: dict[int, int] = {}  # depth (1..k: accepted draft, 0: the pass's bonus token) -> index in plain
    pos = 1
    for t in trace:
        for d in range(t["accepted"] + 1):
            i = pos + d
            if i < len(plain) and plain[i] not in plain[:i]:
                at_depth.setdefault(d + 1 if d < t["accepted"] else 0, i)
        pos += t["accepted"] + 1
    assert set(at_depth) == set(range(k + 1)), at_depth
    for depth, i in sorted(at_depth.items()):
        host = generate_tree(e.runtime, e.mtp, prompt, n, GREEDY, {plain[i]}, k, 8)
        dev = generate_tree_device(e.runtime, e.mtp, prompt, n, GREEDY, {plain[i]}, k, 8)
        assert host[0] == dev[0] == plain[:i + 1], depth
        assert host[1]["stop_reason"] == dev[1]["stop_reason"] == "eos", depth
        for key in TREE_PASSES:
            assert dev[1][key] == host[1][key], (depth, key)
