"""`GenerateStats`: the typed stats of a generation. `from_dict` of the loops' flat dict and `to_dict`
back give the same keys and values (the JSON records stay compatible), for hand-written dicts of every
mode (fast) and for the dicts real runs of every mode build (MTP off / chain / tree, device and host
loops, draft vocabulary and p_min, SnapKV, an expert budget, a session, generate_batch); an unknown key
or a group with a key missing raises; every field is filled by some real run."""

from __future__ import annotations

import copy
import dataclasses

import pytest

import sharpi_jax as sj
from sharpi_jax.runtime.stats import GenerateStats

SPEED = dict(prompt_tokens=5, generated_tokens=4, prefill_s=0.5, prefill_tok_s=10.0, decode_s=0.25, decode_tok_s=16.0,
             stop_reason="max_new_tokens", loop="device")
KV = dict(kv_slots=8, kv_evicted=0, kv_capacity=256)
BACKENDS = dict(backends={"ggml": 30}, matrix_backends={"lm_head.w": "ggml"})
PASSES = dict(draft_tokens=3, verify="batched", drafted=6, accepted=2, verify_passes=2, acceptance_rate=1 / 3,
              mean_accept_len=2.0)
CHAIN = dict(speculative="mtp", **PASSES, accept_per_position=[0.5, 0.5, 0.0], draft_vocab=None, draft_p_min=None)
TREE = dict(speculative="mtp_tree", **PASSES, accept_per_depth=[0.5, 0.5, 0.0], tree_nodes=8, drafted_nodes=[3, 3],
            snapshot_bytes_per_node=58368)
BATCH = dict(batch=2, batch_decode_s=0.5, batch_decode_tok_s=16.0, seed=7)
FLAT = {
    "off": {**SPEED, **KV, **BACKENDS},
    "chain_host": {**SPEED, **CHAIN, "loop": "host", "draft_s": 0.1, "verify_s": 0.2, **KV, **BACKENDS},
    "chain_vocab": {**SPEED, **CHAIN, "draft_vocab": 64, "draft_p_min": 0.3, "draft_vocab_ranking": "token id order",
                    **KV, **BACKENDS},
    "tree": {**SPEED, **TREE, **KV, **BACKENDS},
    "experts_session": {**SPEED, **KV, **BACKENDS, "experts": {"hit_rate": 0.5, "per_layer": {0: {"hits": 1}}},
                        "session_reused_tokens": 3, "session_prefilled_tokens": 2},
    "batch_chain": {k: v for k, v in {**SPEED, **CHAIN, **BATCH, "backends": {"ggml": 30}}.items()
                    if k not in ("decode_s", "decode_tok_s")},
    "batch_tree": {k: v for k, v in {**SPEED, **TREE, **BATCH, "backends": {"ggml": 30}}.items()
                   if k not in ("decode_s", "decode_tok_s")},
}


@pytest.mark.parametrize("mode", sorted(FLAT))
def test_round_trip(mode):
    flat = FLAT[mode]
    stats = GenerateStats.from_dict(flat)
    assert stats.to_dict() == flat
    assert GenerateStats.from_dict(stats.to_dict()) == stats


def test_groups_and_fields():
    chain = GenerateStats.from_dict(FLAT["chain_host"])
    assert chain.speed.decode_tok_s == 16.0 and chain.speed.loop == "host"
    assert chain.speculation.mode == "mtp" and chain.speculation.accept_per_position == [0.5, 0.5, 0.0]
    assert chain.speculation.tree_nodes is None and chain.speculation.draft_vocab is None
    assert chain.kv.capacity == 256 and chain.backends.counts == {"ggml": 30}
    assert (chain.experts, chain.session, chain.batch) == (None, None, None)
    off = GenerateStats.from_dict(FLAT["off"])
    assert off.speculation is None and "draft_vocab" not in off.to_dict()
    tree = GenerateStats.from_dict(FLAT["tree"])
    assert "draft_vocab" not in tree.to_dict() and tree.speculation.drafted_nodes == [3, 3]
    batch = GenerateStats.from_dict(FLAT["batch_chain"])
    assert batch.batch.seed == 7 and batch.kv is None and batch.speed.decode_s is None
    assert batch.backends.matrices is None
    both = GenerateStats.from_dict(FLAT["experts_session"])
    assert both.experts["hit_rate"] == 0.5 and both.session.prefilled_tokens == 2


def test_unknown_or_missing_key_raises():
    with pytest.raises(ValueError, match="new_stat"):
        GenerateStats.from_dict({**FLAT["off"], "new_stat": 1})
    with pytest.raises(ValueError, match="kv"):
        GenerateStats.from_dict({k: v for k, v in FLAT["off"].items() if k != "kv_capacity"})
    with pytest.raises(ValueError, match="speed"):
        GenerateStats.from_dict({k: v for k, v in FLAT["off"].items() if k != "prompt_tokens"})


def _flat_keys() -> set[str]:
    """Every flat key a GenerateStats field holds."""
    keys = {"experts"}
    full = GenerateStats.from_dict({**FLAT["chain_vocab"], **TREE, **BATCH, "draft_s": 0.1, "verify_s": 0.1,
                                    "session_reused_tokens": 1, "session_prefilled_tokens": 1})
    for group in dataclasses.fields(full):
        value = getattr(full, group.name)
        if dataclasses.is_dataclass(value):
            keys |= {f.metadata.get("key", f.name) for f in dataclasses.fields(value)}
    return keys


PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


def _runs(engine, budget_engine):
    """Every mode's GenerateOutputs: MTP off, chain and tree (device loop), the chain on the host loop, a
    draft vocabulary with p_min, SnapKV, a session's second turn, generate_batch of each mode, an expert
    budget."""
    g = engine.generate
    outs = [g(PROMPT, max_new_tokens=4, speculative=spec) for spec in (None, "mtp", "mtp_tree")]
    # The host loop adds draft_s / verify_s (its other keys are the device loop's: test_device_loop).
    outs += [g(PROMPT, max_new_tokens=4, speculative="mtp", loop="host"),
             g(PROMPT, max_new_tokens=4, speculative="mtp", draft_vocab=64, draft_p_min=0.3),
             g(PROMPT * 4, max_new_tokens=4, speculative="mtp", kv_policy="snapkv", kv_budget=16, kv_window=4)]
    assert outs[-1].stats.kv.evicted > 0
    session = engine.session()
    session.generate(PROMPT, max_new_tokens=4)
    outs.append(session.generate("x = 1", max_new_tokens=4))
    for spec in (None, "mtp", "mtp_tree"):
        outs += engine.generate_batch([PROMPT, "def f(x):"], max_new_tokens=4, speculative=spec)
    outs.append(budget_engine.generate(PROMPT, max_new_tokens=4, speculative="mtp"))
    return outs


def test_round_trip_of_real_runs(monkeypatch):
    """from_dict(d).to_dict() == d for the flat dict d of a real run of every mode (the dicts recorded as
    the API converts them), and every field of every group is filled by one of them."""
    seen: list[dict] = []
    real = GenerateStats.from_dict.__func__

    def spy(cls, flat):
        seen.append(copy.deepcopy(dict(flat)))
        return real(cls, flat)

    monkeypatch.setattr(GenerateStats, "from_dict", classmethod(spy))
    with sj.load(max_context=256) as engine, sj.load(max_context=256, expert_budget="50%") as budget_engine:
        outs = _runs(engine, budget_engine)
    assert len(seen) == len(outs) + 1  # the session's first turn
    filled: set[str] = set()
    for flat in seen:
        assert real(GenerateStats, flat).to_dict() == flat
    for out in outs:
        flat = out.stats.to_dict()
        assert real(GenerateStats, flat) == out.stats
        filled |= set(flat)
    assert filled == _flat_keys()
