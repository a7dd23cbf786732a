"""SnapKV prefill eviction: kept positions == a plain numpy SnapKV (also on window queries recomputed in
numpy from the GGUF weights), the compacted decode == an independent decode on the full cache with the
evicted positions masked out (`snapkv_reference`), a budget >= the prompt is bitwise the path without
eviction, and on an evicted cache MTP batched verify == sequential verify (every row, bitwise) == plain
decoding with the same eviction (greedy and seeded sampling), three archs.

Prompts are a 128-token cut of each fixture's long prompt (prompt 3), so eviction really drops most of
it (budget 64). The fast tier runs k in FAST_KS, the slow tier the rest of 1..7 and the quantized
files. Run with -s for the acceptance figures.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharpi_jax.errors import InputError
from sharpi_jax.model import snapkv
from sharpi_jax.model.snapkv import SnapKV, keep_positions
from sharpi_jax.runtime import kv_eviction
from sharpi_jax.runtime.sampling import SamplingParams
from sharpi_jax.runtime.strategies.chain import generate_mtp
from sharpi_jax.runtime.strategies.plain import generate_ids
from sharpi_jax.runtime.state import attention_caches, with_attention
from tests.bitwise import assert_bitwise_equal
from tests.conftest import fixture_engine, fixture_path, load_references
from tests.runtime.snapkv_reference import allowed_keys, masked_decode, window_queries_numpy

MAX_CONTEXT = 192
WIDTH = 7
N_PROMPT = 128
N_NEW = 16
KV = SnapKV(budget=64, window=16, pool=5)
ARCHS = ("tiny-qwen35moe", "tiny-qwen35", "tiny-qwen3next")
FAST_KS = (3, 7)
SLOW_KS = (1, 2, 4, 5, 6)
GREEDY = SamplingParams()
# Eviction patterns for the masked full-cache reference: (budget, window, pool), both with shift > 0.
PATTERNS = (KV, SnapKV(budget=40, window=8, pool=3))
# Compacted decode vs the masked full-cache reference: the same operands, but a shorter cache (a
# different reduction length) and single-row matmuls on the reference side, so not bitwise.
REF_ATOL = 1e-5  # times max |reference logit|, every decoded row


def engine(name: str, variant: str = "F32"):
    return fixture_engine(name, variant, MAX_CONTEXT, (32,))


def long_prompt(name: str, variant: str = "F32", n: int = N_PROMPT) -> list[int]:
    return load_references(name)["variants"][f"{name}-{variant}"]["tokens"][3][:n]


def reference_keep(q: np.ndarray, k: np.ndarray, n: int, budget: int, window: int, pool: int) -> np.ndarray:
    """Plain numpy SnapKV (float64, loops): q [W, Hq, hd] window queries at positions n-W..n-1, k
    [Hkv, >= n, hd] keys at positions 0..; q-head j reads KV head j // (Hq / Hkv). Per KV head: causal
    softmax of each window row, summed over rows and the head's query heads over the prefix, a centred
    moving average of width `pool` (zeros outside), the top budget - window (ties: lower position),
    plus the window. Returns [Hkv, budget] ascending."""
    q, k = q.astype(np.float64), k[:, :n].astype(np.float64)
    W, Hq, hd = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    out = []
    for h in range(Hkv):
        votes = np.zeros(n - W)
        for j in range(h * G, (h + 1) * G):
            for w in range(W):
                s = k[h, : n - W + w + 1] @ q[w, j] / np.sqrt(hd)
                p = np.exp(s - s.max())
                votes += (p / p.sum())[: n - W]
        pooled = np.convolve(votes, np.ones(pool), "full")[pool // 2: pool // 2 + n - W] / pool
        top = np.argsort(-pooled, kind="stable")[: budget - W]
        out.append(np.concatenate([np.sort(top), np.arange(n - W, n)]))
    return np.stack(out)


@pytest.mark.parametrize("name", ARCHS)
def test_kept_positions_equal_numpy_reference(name):
    """Trunk attention layers and the MTP head: the kept positions per KV head == `reference_keep` on
    the same window queries and keys; the compacted cache holds exactly those rows (bitwise) in its
    first budget slots and positions s + shift after them."""
    e = engine(name)
    rt, ids = e.runtime, long_prompt(name)
    n = len(ids)
    queries = []
    chunks, _, state = rt.prefill(rt.new_state(), ids, queries=queries)
    full = [(np.asarray(c.k), np.asarray(c.v)) for c in attention_caches(state)]
    window = kv_eviction.window_queries(queries, KV.window)
    cap = kv_eviction.kv_capacity(KV, N_NEW, MAX_CONTEXT)
    _, _, evicted_state, ev = kv_eviction.prefill(rt, ids, KV, cap)
    assert ev == kv_eviction.Evicted(capacity=KV.budget + N_NEW, shift=n - KV.budget, evicted=n - KV.budget)
    for i, ((k, v), q, c) in enumerate(zip(full, window, attention_caches(evicted_state), strict=True)):
        want = reference_keep(np.asarray(q), k, n, KV.budget, KV.window, KV.pool)
        got = np.asarray(keep_positions(q, k, n_rows=n, budget=KV.budget, pool=KV.pool))
        np.testing.assert_array_equal(got, want, err_msg=f"{name} attention layer {i}")
        assert (want[:, : KV.budget - KV.window] < n - KV.window).all() and len(np.unique(want)) > KV.budget
        slot_pos = np.asarray(c.slot_pos)
        np.testing.assert_array_equal(slot_pos[:, : KV.budget], want)
        tail = np.arange(KV.budget, cap) + ev.shift  # appended rows: slot s holds position s + shift
        np.testing.assert_array_equal(slot_pos[:, KV.budget:], np.broadcast_to(tail, (len(want), len(tail))))
        assert int(c.shift) == ev.shift and c.k.shape == (k.shape[0], cap, k.shape[2])
        kept = np.take_along_axis(k, want[:, :, None], axis=1), np.take_along_axis(v, want[:, :, None], axis=1)
        assert_bitwise_equal((np.asarray(c.k)[:, : KV.budget], np.asarray(c.v)[:, : KV.budget]), kept)
    # The MTP head's own KV (rows = pairs (ids[p], h[p-1]), MTP position p - 1): the same rule.
    mq = []
    cache, _, _ = e.mtp.prefill(e.mtp.new_cache(), ids, chunks, False, mq)
    m_rows = n - 1
    q = kv_eviction.window_queries(mq, KV.window)[0]
    want = reference_keep(np.asarray(q), np.asarray(cache.k), m_rows, KV.budget, KV.window, KV.pool)
    compacted, _ = kv_eviction.mtp_prefill(e.mtp, ids, chunks, False, KV, cap)
    np.testing.assert_array_equal(np.asarray(compacted.slot_pos)[:, : KV.budget], want)
    assert int(compacted.shift) == m_rows - KV.budget
    # The MTP cache's memory bound: kv_budget + max_new_tokens slots of K and V, one position per slot.
    hkv, hd = e.config.n_head_kv, e.config.head_dim
    assert compacted.k.shape == compacted.v.shape == (hkv, cap, hd) and compacted.slot_pos.shape == (hkv, cap)


def trunk_inputs(e, ids, layer):
    """The residual stream entering trunk block `layer` for prompt ids (blocks 0..layer-1 run at model
    level in the prefill form, one bucket)."""
    from flax import nnx

    from sharpi_jax.model.cache import cache_shapes, zeros

    model = e.model
    n = len(ids)
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, tokens):
        m = nnx.merge(graphdef, params)
        x = m.embed(tokens)
        pos, valid = jnp.arange(n, dtype=jnp.int32), jnp.ones((n,), bool)
        for blk in list(m.layers)[:layer]:
            x, _, _ = blk(x, zeros(cache_shapes(e.config, blk.layer, MAX_CONTEXT)), pos, valid, "chunked")
        return x

    return np.asarray(run(params, jnp.asarray(ids, jnp.int32)))


def test_scoring_uses_queries_recomputed_from_the_weights():
    """The kept positions of every trunk attention layer == `reference_keep` fed window queries that
    this test recomputes in numpy from the GGUF weights (attn_norm, attn_q, q-norm, NEOX RoPE at the
    logical positions) and the layer's input, not the engine's captured queries; those agree with the
    engine's captured queries to 1e-4 of their scale (the float64 vs float32 gap)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    name = "tiny-qwen35moe"
    e = engine(name)
    rt, ids = e.runtime, long_prompt(name)
    n, c = len(ids), e.config
    path = fixture_path(name, f"{name}-F32.gguf")
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    queries = []
    _, _, state = rt.prefill(rt.new_state(), ids, queries=queries)
    captured = kv_eviction.window_queries(queries, KV.window)
    full = attention_caches(state)
    _, _, evicted_state, _ = kv_eviction.prefill(rt, ids, KV, kv_eviction.kv_capacity(KV, N_NEW, MAX_CONTEXT))
    positions = np.arange(n - KV.window, n)
    for i, layer in enumerate(c.attention_layers):
        x = trunk_inputs(e, ids, layer)[n - KV.window:].astype(np.float64)
        t = tensors[f"blk.{layer}.attn_norm.weight"]
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float64)
        a = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_eps) * w
        q = window_queries_numpy(path, c, layer, a, positions)
        cq = np.asarray(captured[i])
        np.testing.assert_allclose(q, cq, rtol=0, atol=1e-4 * np.abs(q).max(), err_msg=f"layer {layer}")
        want = reference_keep(q, np.asarray(full[i].k), n, KV.budget, KV.window, KV.pool)
        got = np.asarray(attention_caches(evicted_state)[i].slot_pos)[:, : KV.budget]
        np.testing.assert_array_equal(got, want, err_msg=f"layer {layer}")


@pytest.mark.parametrize("kv", PATTERNS, ids=lambda kv: f"b{kv.budget}w{kv.window}p{kv.pool}")
def test_evicted_decode_equals_masked_full_cache(kv):
    """Greedy decode on the compacted cache (shift > 0, kept positions different per KV head) == a
    decode on the full, uncompacted prefill cache with the evicted positions masked out
    (`snapkv_reference.masked_decode`: no compaction, no slot map, RoPE at logical positions), every
    row's logits within REF_ATOL and the same greedy tokens."""
    name = "tiny-qwen35moe"
    e = engine(name)
    rt, ids = e.runtime, long_prompt(name)
    n = len(ids)
    _, logits, state, ev = kv_eviction.prefill(rt, ids, kv, kv_eviction.kv_capacity(kv, N_NEW, MAX_CONTEXT))
    assert ev.shift == n - kv.budget > 0
    keep = [np.asarray(cache.slot_pos)[:, : kv.budget] for cache in attention_caches(state)]
    assert all((k[0] != k[1]).any() for k in keep), "the pattern should differ between KV heads"
    toks, rows = [int(np.argmax(logits))], []
    for i in range(N_NEW):
        lg, _, state = rt.decode_step(state, toks[-1], n + i)
        rows.append(np.asarray(lg))
        toks.append(int(np.argmax(rows[-1])))
    _, _, full = rt.prefill(rt.new_state(), ids)
    ref = masked_decode(e.model, full, toks[:-1], n, [allowed_keys(k, n, MAX_CONTEXT) for k in keep])
    got = np.stack(rows)
    np.testing.assert_allclose(got, ref, rtol=0, atol=REF_ATOL * np.abs(ref).max())
    assert [int(t) for t in np.argmax(ref, axis=-1)] == toks[1:]
    print(f"{kv}: max |compacted - masked full| / max|ref| = {np.abs(got - ref).max() / np.abs(ref).max():.2e}")


def test_compacted_cache_uses_logical_positions():
    """Compacting every position (nothing evicted) into max_context slots, slot s = position s, decodes
    bitwise like the uncompacted cache; with the prompt rows stored in reverse slot order (logical
    positions per slot, RoPE already in K) it decodes the same up to the reduction order."""
    e = engine("tiny-qwen35moe")
    rt, ids = e.runtime, long_prompt("tiny-qwen35moe", n=40)
    n = len(ids)
    _, _, state = rt.prefill(rt.new_state(), ids)
    toks = [5, 17, 99]

    def decode(st):
        rows = []
        for i, t in enumerate(toks):
            lg, _, st = rt.decode_step(st, t, n + i)
            rows.append(np.asarray(lg))
        return np.stack(rows)

    ref = decode(jax.tree.map(jnp.copy, state))
    keep = snapkv.every_position(e.config.n_head_kv, n)
    for order, k in (("same", keep), ("reversed", keep[:, ::-1])):
        attn = [snapkv.compact(c, k, n_rows=n, capacity=MAX_CONTEXT) for c in attention_caches(state)]
        got = decode(with_attention(jax.tree.map(jnp.copy, state), attn))
        if order == "same":
            assert_bitwise_equal(got, ref)
        else:
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_budget_at_least_the_prompt_is_no_eviction():
    """kv_budget >= prompt length: the prefill state is bitwise the one without a policy, and plain and
    MTP generation (logits of every verify row) are bitwise those without eviction (budget = prompt)."""
    name = "tiny-qwen35moe"
    e = engine(name)
    rt, ids = e.runtime, long_prompt(name, n=70)
    ref_chunks, ref_logits, ref_state = rt.prefill(rt.new_state(), ids)
    ref_plain, ref_stats = generate_ids(rt, ids, N_NEW, GREEDY)
    ref_trace = []
    ref_mtp, _ = generate_mtp(rt, e.mtp, ids, N_NEW, GREEDY, (), 3, width=WIDTH, trace=ref_trace)
    for budget in (len(ids) + 50, len(ids)):
        kv = SnapKV(budget, 16, 5)
        chunks, logits, state, ev = kv_eviction.prefill(rt, ids, kv, kv_eviction.kv_capacity(kv, N_NEW, MAX_CONTEXT))
        assert ev is None
        assert_bitwise_equal((chunks, logits, state), (ref_chunks, ref_logits, ref_state))
    out, stats = generate_ids(rt, ids, N_NEW, GREEDY, kv=kv)
    assert out == ref_plain and stats["kv_evicted"] == 0 and stats["kv_slots"] == ref_stats["kv_slots"]
    trace = []
    out, stats = generate_mtp(rt, e.mtp, ids, N_NEW, GREEDY, (), 3, width=WIDTH, trace=trace, kv=kv)
    assert out == ref_mtp == ref_plain
    assert_bitwise_equal(trace, ref_trace)
    assert stats["kv_capacity"] == MAX_CONTEXT


def check_evicted_parity(e, ids, ks, n_new=N_NEW):
    """On the evicted cache, for each k: the batched trace == the full sequential trace (every row's
    logits, hidden, GDN states, acceptance), early-stopping sequential rows are its prefix, and all
    three outputs == plain decoding with the same eviction. Returns the accepted counts per k."""
    rt = e.runtime
    ref, ref_stats = generate_ids(rt, ids, n_new, GREEDY, kv=KV)
    assert ref_stats["kv_evicted"] == len(ids) - KV.budget and ref_stats["kv_capacity"] == KV.budget + n_new
    assert ref_stats["kv_slots"] == KV.budget + n_new - 1
    accepted = {}
    for k in ks:
        tb, ts, te = [], [], []
        out_b, st_b = generate_mtp(rt, e.mtp, ids, n_new, GREEDY, (), k, "batched", WIDTH, trace=tb, kv=KV)
        out_s, st_s = generate_mtp(rt, e.mtp, ids, n_new, GREEDY, (), k, "sequential", WIDTH, True, ts, kv=KV)
        out_e, _ = generate_mtp(rt, e.mtp, ids, n_new, GREEDY, (), k, "sequential", WIDTH, trace=te, kv=KV)
        assert_bitwise_equal(tb, ts)
        assert len(te) == len(tb)
        for b, s in zip(tb, te):
            m = len(s["tokens"])
            assert m == b["accepted"] + 1
            assert_bitwise_equal((s["tokens"], s["logits"], s["hidden"]),
                                 (b["tokens"][:m], b["logits"][:m], b["hidden"][:m]))
        assert out_b == out_s == out_e == ref, f"k={k}"
        assert st_b["kv_evicted"] == st_s["kv_evicted"] == len(ids) - KV.budget
        assert st_b["kv_slots"] <= st_b["kv_capacity"] == KV.budget + n_new
        accepted[k] = [t["accepted"] for t in tb]
    print(f"accepted per pass on the evicted cache: {accepted}")
    return accepted


@pytest.mark.parametrize("name", ARCHS)
def test_evicted_batched_equals_sequential_equals_plain(name):
    """k in FAST_KS, greedy; the MTP KV kept whole (k = 3); and seeded sampling (k = 3, both verify
    modes) == plain seeded sampling, all on the same evicted cache."""
    e = engine(name)
    ids = long_prompt(name)
    acc = check_evicted_parity(e, ids, FAST_KS)
    assert any(0 < a < k for k, per_k in acc.items() for a in per_k)  # partial acceptance: rollback
    ref, _ = generate_ids(e.runtime, ids, N_NEW, GREEDY, kv=KV)
    keep, _ = generate_mtp(e.runtime, e.mtp, ids, N_NEW, GREEDY, (), 3, "batched", WIDTH, kv=KV, mtp_kv="keep")
    assert keep == ref  # the MTP head's KV kept whole: only acceptance may change
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7)
    ref, _ = generate_ids(e.runtime, ids, N_NEW, sampling, kv=KV)
    for verify in ("batched", "sequential"):
        out, _ = generate_mtp(e.runtime, e.mtp, ids, N_NEW, sampling, (), 3, verify, WIDTH, kv=KV)
        assert out == ref, verify


@pytest.mark.slow
@pytest.mark.parametrize("name,variant", [(n, "F32") for n in ARCHS] + [("tiny-qwen35moe", "Q4_K_M"),
                                                                         ("tiny-qwen35", "Q8_0"),
                                                                         ("tiny-qwen3next", "Q8_0")])
def test_evicted_parity_every_k(name, variant):
    """The rest of k = 1..7 (every k for the quantized files), MTP KV evicted and kept whole, seeded
    sampling for every k."""
    e = engine(name, variant)
    ids = long_prompt(name, variant)
    check_evicted_parity(e, ids, SLOW_KS if variant == "F32" else tuple(range(1, 8)))
    ref, _ = generate_ids(e.runtime, ids, N_NEW, GREEDY, kv=KV)
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=3)
    ref_s, _ = generate_ids(e.runtime, ids, N_NEW, sampling, kv=KV)
    for k in range(1, 8):
        for verify in ("batched", "sequential"):
            out, _ = generate_mtp(e.runtime, e.mtp, ids, N_NEW, GREEDY, (), k, verify, WIDTH, kv=KV, mtp_kv="keep")
            assert out == ref, (k, verify)
            out, _ = generate_mtp(e.runtime, e.mtp, ids, N_NEW, sampling, (), k, verify, WIDTH, kv=KV)
            assert out == ref_s, (k, verify)


def test_bad_options_raise_input_error():
    for kw, match in ((dict(kv_budget=8, kv_window=16), "at least kv_window"),
                      (dict(kv_budget=-4), "kv_budget must be >= 1"),
                      (dict(kv_budget=64, kv_window=-1), "kv_window must be >= 1"),
                      (dict(kv_budget=64, kv_window=0), "kv_window must be >= 1"),
                      (dict(kv_budget=64, kv_pool=0), "kv_pool must be >= 1"),
                      (dict(kv_budget=64.0), "integer"),
                      (dict(kv_budget=True), "integer"),
                      (dict(kv_budget=None), "needs kv_budget")):
        opts = dict(kv_policy="snapkv", kv_budget=None, kv_window=None, kv_pool=None) | kw
        with pytest.raises(InputError, match=match):
            snapkv.policy(**opts)
    with pytest.raises(InputError, match="kv_policy must be one of"):
        snapkv.policy("h2o", 64, None, None)
    assert snapkv.policy(None, None, None, None) is None
    assert snapkv.policy("snapkv", 64, None, None) == SnapKV(64, snapkv.DEFAULT_WINDOW, snapkv.DEFAULT_POOL)


def test_engine_generate_options():
    """engine.generate(kv_policy="snapkv", ...) == generate_ids with the same SnapKV (plain and MTP);
    sj.load defaults are taken by "default" and overridden per call; bad options raise InputError."""
    from sharpi_jax.api import _kv_policy

    name = "tiny-qwen35moe"
    e = engine(name)
    ids = long_prompt(name)
    ref, _ = generate_ids(e.runtime, ids, N_NEW, GREEDY, kv=KV)
    opts = dict(kv_policy="snapkv", kv_budget=KV.budget, kv_window=KV.window, kv_pool=KV.pool)
    for spec in (dict(), dict(speculative="mtp", draft_tokens=WIDTH)):
        out = e.generate(ids, max_new_tokens=N_NEW, stop_on_eos=False, **opts, **spec)
        assert out.tokens == ref
        assert out.stats.kv.evicted == len(ids) - KV.budget and out.stats.kv.capacity == KV.budget + N_NEW
    base = SnapKV(100, 8, 3)
    assert _kv_policy("default", None, None, None, base) == base
    assert _kv_policy("default", 50, None, None, base) == SnapKV(50, 8, 3)
    assert _kv_policy(None, None, None, None, base) is None
    assert _kv_policy("default", None, None, None, None) is None
    assert _kv_policy("snapkv", 64, None, None, None) == SnapKV(64, 32, 7)
    for kw in (dict(kv_policy="snapkv", kv_budget=8, kv_window=16), dict(kv_policy="snapkv"),
               dict(kv_policy="snapkv", kv_budget=64, kv_pool=-1), dict(kv_policy="streaming", kv_budget=64),
               dict(kv_policy=None, kv_budget=64)):
        with pytest.raises(InputError):
            e.generate(ids, max_new_tokens=2, **kw)


@pytest.mark.parametrize("name", ["tiny-qwen35moe", "tiny-qwen3next"])
def test_tree_over_an_evicted_cache_equals_plain(name):
    """Draft trees (depth 3, 8 nodes) verified over the same evicted cache: host batched, host
    sequential and the device loop give the tokens of plain decoding with that eviction (greedy and
    seeded), with partial acceptance (the accepted path's K/V moved to its compacted slots)."""
    from sharpi_jax.runtime.strategies.tree import generate_tree, generate_tree_device
    e = engine(name)
    rt, ids = e.runtime, long_prompt(name)
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7)
    for sp in (GREEDY, sampling):
        ref, ref_stats = generate_ids(rt, ids, N_NEW, sp, kv=KV)
        host, st = generate_tree(rt, e.mtp, ids, N_NEW, sp, (), 3, 8, "batched", kv=KV)
        seq, _ = generate_tree(rt, e.mtp, ids, N_NEW, sp, (), 3, 8, "sequential", kv=KV)
        dev, st_d = generate_tree_device(rt, e.mtp, ids, N_NEW, sp, (), 3, 8, kv=KV)
        assert host == seq == dev == ref, sp
        assert st["kv_evicted"] == st_d["kv_evicted"] == ref_stats["kv_evicted"] == len(ids) - KV.budget
        assert st["accepted"] == st_d["accepted"]
        if sp is GREEDY:
            assert 0 < st["accepted"] < st["drafted"]
