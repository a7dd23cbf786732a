"""MTP speculative decoding: batched verify == sequential verify bit for bit, output == plain decoding
(greedy and seeded sampling), stats, stops, and acceptance next to llama.cpp's on the fixtures.

Every fixture variant (4 tiny-qwen35moe, 3 tiny-qwen35, 2 tiny-qwen3next files) and a synthetic model
of mixed quant types. Drafts use WIDTH slots compiled once per model graph, so k = 1..7 share one
verify and one draft compile (`engine.generate` compiles width k; k = WIDTH reuses them). Run with -s
for the figures.
"""

from __future__ import annotations


import numpy as np
import pytest

import sharpi_jax as sj
from sharpi_jax.config import tiny_qwen35moe
from sharpi_jax.errors import InputError
from sharpi_jax.runtime.sampling import SamplingParams
from sharpi_jax.runtime.llamacpp import llamacpp_protocol
from sharpi_jax.runtime.strategies.chain import generate_mtp
from sharpi_jax.runtime.strategies.plain import generate_ids
from sharpi_jax.testing import write_synthetic_gguf
from tests.bitwise import assert_bitwise_equal
from tests.conftest import fixture_engine, fixture_path, load_references

MAX_CONTEXT = 512  # as the other fixture tests: compiled steps are shared with them
WIDTH = 7
KS = tuple(range(1, 8))
VARIANTS = [("tiny-qwen35moe", v) for v in ("F32", "BF16", "Q8_0", "Q4_K_M")] + \
           [("tiny-qwen35", v) for v in ("F32", "Q8_0", "Q4_K_M")] + \
           [("tiny-qwen3next", v) for v in ("F32", "Q8_0")]
IDS = [f"{n[5:]}-{v}" for n, v in VARIANTS]
GREEDY = SamplingParams()


def engine(name: str, variant: str):
    return fixture_engine(name, variant, MAX_CONTEXT, (32,))


references = load_references


def prompts(name: str, variant: str) -> list[list[int]]:
    return references(name)["variants"][f"{name}-{variant}"]["tokens"]


def plain(e, prompt, n, sampling=GREEDY, stop_ids=()):
    return generate_ids(e.runtime, prompt, n, sampling, stop_ids)


def spec(e, prompt, n, k, verify="batched", sampling=GREEDY, stop_ids=(), trace=None, full_rows=False):
    return generate_mtp(e.runtime, e.mtp, prompt, n, sampling, stop_ids, k, verify, width=WIDTH,
                        full_rows=full_rows, trace=trace)


def check_parity(e, prompt, n, ks=KS):
    """For each k: batched-verify trace == full sequential trace (every row's logits and hidden, the GDN
    conv/SSM state after every row, tokens, acceptance), the early-stopping sequential rows are a prefix
    of them, and all three outputs == plain greedy decoding. Returns the accepted counts."""
    ref, _ = plain(e, prompt, n)
    accepted = []
    for k in ks:
        tb, ts, te = [], [], []
        out_b, st_b = spec(e, prompt, n, k, "batched", trace=tb)
        out_s, st_s = spec(e, prompt, n, k, "sequential", trace=ts, full_rows=True)
        out_e, st_e = spec(e, prompt, n, k, "sequential", trace=te)
        assert_bitwise_equal(tb, ts)
        assert len(te) == len(tb)
        for b, s in zip(tb, te):  # early stop: rows 0..a only, bitwise those of the batched pass
            m = len(s["tokens"])
            assert m == b["accepted"] + 1 == s["accepted"] + 1
            assert_bitwise_equal((s["tokens"], s["logits"], s["hidden"]),
                                        (b["tokens"][:m], b["logits"][:m], b["hidden"][:m]))
        assert out_b == out_s == out_e == ref, f"k={k}"
        for key in ("drafted", "accepted", "verify_passes", "accept_per_position", "generated_tokens"):
            assert st_b[key] == st_s[key] == st_e[key], key
        accepted.append([t["accepted"] for t in tb])
    return accepted


@pytest.mark.parametrize("name,variant", VARIANTS, ids=IDS)
def test_batched_verify_bitwise_equals_sequential(name, variant):
    """Batched vs sequential verify, every row, k = 1..7, prompt 0: logits, hidden, GDN snapshots."""
    acc = check_parity(engine(name, variant), prompts(name, variant)[0], 40)
    flat = [a for per_k in acc for a in per_k]
    assert sum(flat) > 0 and any(a == 0 for a in flat)  # both accepting and rejecting passes were checked
    assert any(0 < a < k for k, per_k in zip(KS, acc) for a in per_k)  # partial acceptance: rollback


@pytest.mark.parametrize("name,variant", VARIANTS, ids=IDS)
def test_greedy_mtp_equals_plain_every_prompt_and_k(name, variant):
    """Greedy output with MTP == greedy output without, token for token, every prompt, k = 1..7."""
    e = engine(name, variant)
    for i, prompt in enumerate(prompts(name, variant)):
        ref, _ = plain(e, prompt, 48)
        for k in KS:
            out, stats = spec(e, prompt, 48, k)
            assert out == ref, f"prompt {i}, k={k}"
            assert stats["generated_tokens"] == 48


@pytest.mark.parametrize("name", ["tiny-qwen35moe", "tiny-qwen35", "tiny-qwen3next"])
def test_sampled_mtp_equals_plain(name):
    """Seeded sampling: exact-match acceptance against the target's sampled token (same key per
    generated-token index) gives the same tokens as plain sampling, both verify modes."""
    e = engine(name, "F32")
    prompt = prompts(name, "F32")[0]
    greedy, _ = plain(e, prompt, 32)
    for seed in (0, 7):
        sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=seed)
        ref, _ = plain(e, prompt, 32, sampling)
        assert ref != greedy  # the sampler is really sampling
        for k in (1, 3, 7):
            for verify in ("batched", "sequential"):
                out, stats = spec(e, prompt, 32, k, verify, sampling)
                assert out == ref, f"seed {seed}, k={k}, {verify}"
            assert stats["accepted"] > 0


@pytest.fixture(scope="module")
def synthetic_engine(tmp_path_factory):
    """A random 2-layer (GDN + attention) + MTP model of mixed quant types, hidden 256 so that K-quant
    rows fit: Q6_K matrices and token embedding (raw-block row lookups for the trunk and the MTP head),
    Q4_K gate/up experts (struct-of-arrays path), 64-wide down experts falling back to Q8_0."""
    c = tiny_qwen35moe(n_layer=2).replace(d_model=256, recurrent_layers=(True, False, False))
    path = tmp_path_factory.mktemp("synthetic") / "tiny-Q6_K-Q4_K.gguf"
    write_synthetic_gguf(path, c, qtype="Q6_K", expert_qtype="Q4_K", seed=3)
    return sj.load(path, max_context=MAX_CONTEXT, prefill_buckets=(32,))


def test_synthetic_quant_types_parity(synthetic_engine):
    """Random weights (layout coverage, not correctness): batched == sequential bitwise and == plain
    greedy for k = 1..7 with this file's quant types."""
    e = synthetic_engine
    qtypes = {t.qtype.name for t in e.gguf.tensors.values()}
    assert {"Q6_K", "Q4_K", "Q8_0"} <= qtypes
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, e.config.n_vocab, 20)]
    check_parity(e, prompt, 24)


@pytest.mark.parametrize("name,variant", VARIANTS, ids=IDS)
def test_acceptance_vs_llamacpp(name, variant):
    """Acceptance on prompt 0 (greedy, 48 tokens, same k) next to llama.cpp draft-mtp's, counted as
    llama-speculative-simple counts (llama.cpp's MTP position-0 convention; for qwen3next its
    checkpoint-replay counting). Ours must not be much below theirs."""
    e = engine(name, variant)
    ref = references(name)["variants"][f"{name}-{variant}"]
    if not ref.get("mtp"):
        pytest.skip("no llama.cpp MTP record for this variant")
    prompt = ref["tokens"][0]
    replay = name == "tiny-qwen3next"
    for k_str, rec in sorted(ref["mtp"].items()):
        k, theirs = int(k_str), rec["stats"]
        ours = llamacpp_protocol(e.runtime, e.mtp, prompt, k, 48, replay=replay, width=WIDTH)
        native = llamacpp_protocol(e.runtime, e.mtp, prompt, k, 48, width=WIDTH, zero_h_first=False)
        print(f"{name}-{variant} k={k}: llama.cpp {theirs['n_accept']}/{theirs['n_drafted']} = "
              f"{theirs['accept_pct']:.1f}% | ours (their counting) {ours['n_accept']}/{ours['n_drafted']} = "
              f"{ours['accept_pct']:.1f}% | ours (own convention, snapshot rollback) "
              f"{native['n_accept']}/{native['n_drafted']} = {native['accept_pct']:.1f}%")
        assert ours["accept_pct"] >= theirs["accept_pct"] - 10.0
        assert native["accept_pct"] >= theirs["accept_pct"] - 15.0 - (20.0 if replay else 0.0)


def test_stats_and_stops():
    """Stats agree with the per-pass trace; EOS inside an accepted draft run and the context end stop
    exactly where plain decoding stops."""
    name = "tiny-qwen35moe"
    e = engine(name, "F32")
    prompt = prompts(name, "F32")[0]
    k = 3
    trace = []
    out, s = spec(e, prompt, 48, k, trace=trace)
    acc = [t["accepted"] for t in trace]
    assert s["verify_passes"] == len(trace) and s["accepted"] == sum(acc) and s["drafted"] == k * len(trace)
    assert s["acceptance_rate"] == pytest.approx(sum(acc) / (k * len(trace)))
    assert s["mean_accept_len"] == pytest.approx(np.mean(acc) + 1)
    assert s["accept_per_position"] == pytest.approx([np.mean([a >= i for a in acc]) for i in range(1, k + 1)])
    assert s["generated_tokens"] == len(out) == 48 and s["stop_reason"] == "max_new_tokens"
    for key in ("decode_tok_s", "prefill_tok_s", "draft_s", "verify_s"):
        assert s[key] > 0
    # EOS = a token emitted as an accepted draft (not the pass's last token): stop mid-pass.
    emitted, pos = [], 1  # token 0 comes from the prefill
    for a in acc:
        emitted += list(range(pos, pos + a))
        pos += a + 1
    stop = out[next(i for i in emitted if out[i] not in out[:i])]
    ref, rs = plain(e, prompt, 48, stop_ids={stop})
    got, gs = spec(e, prompt, 48, k, stop_ids={stop})
    assert got == ref and gs["stop_reason"] == rs["stop_reason"] == "eos"
    # Context end: the last passes have fewer than k drafts.
    long = prompts(name, "F32")[3]
    ref, rs = plain(e, long, 200)
    for verify in ("batched", "sequential"):
        got, gs = spec(e, long, 200, 7, verify)
        assert got == ref and gs["stop_reason"] == rs["stop_reason"] == "max_context"
        assert len(got) == MAX_CONTEXT - len(long) + 1


def test_engine_generate_api():
    """engine.generate(speculative="mtp") == plain generate; bad options raise. (k = 7 = WIDTH: the
    API's width-k functions are the ones compiled above.)"""
    name = "tiny-qwen35moe"
    e = engine(name, "F32")
    prompt = prompts(name, "F32")[1]
    ref = e.generate(prompt, max_new_tokens=24)
    for verify in ("batched", "sequential"):
        out = e.generate(prompt, max_new_tokens=24, speculative="mtp", draft_tokens=WIDTH, verify=verify, loop="host")
        assert out.tokens == ref.tokens and out.text == ref.text
        spec = out.stats.speculation
        for field in ("drafted", "accepted", "mean_accept_len", "acceptance_rate", "accept_per_position",
                      "verify_passes", "draft_s", "verify_s"):
            assert getattr(spec, field) is not None, field
        assert out.stats.speed.decode_tok_s > 0 and out.stats.speed.prefill_tok_s > 0
        assert out.stats.speculation.mode == "mtp" and out.stats.speculation.verify == verify
        assert len(out.stats.speculation.accept_per_position) == WIDTH
    for kw in (dict(draft_tokens=0), dict(draft_tokens=True), dict(verify="tree")):
        with pytest.raises(InputError):
            e.generate(prompt, speculative="mtp", **kw)
    zoo = sj.load(fixture_path("quant-zoo", "zoo-Q8_0.gguf"), max_context=64)
    assert not zoo.config.has_mtp
    with pytest.raises(InputError, match="no MTP"):
        zoo.generate([1, 2, 3], max_new_tokens=2, speculative="mtp")
