"""Expert residency: bitwise parity with every expert resident, the memory bound, budget errors.

Each engine compiles its own steps (the slot layout is part of the graph), so the tests keep prompts
short (one 16-row prefill bucket, two chunks) and share one all-resident reference per model.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

import sharpi_jax as sj
from sharpi_jax.pallas_kernels import quant_blocks as qb
from sharpi_jax.config import tiny_qwen35moe
from sharpi_jax.errors import InputError
from sharpi_jax.experts import residency
from sharpi_jax.experts.streaming import MATRICES
from sharpi_jax.gguf import GGUFFile, read_model_config
from sharpi_jax.quant.qtensor import SOA_TYPES
from sharpi_jax.testing import write_synthetic_gguf
from tests.bitwise import assert_bitwise_equal
from tests.conftest import fixture_path

OPTS = dict(max_context=64, prefill_buckets=(16,))
PROMPT_LEN = 20  # two prefill chunks of the 16-row bucket (16 rows: streaming; decode's 2 rows: host)
N_NEW = 4


def _prompt(engine) -> list[int]:
    return [int(i) for i in np.random.default_rng(7).integers(0, engine.config.n_vocab, PROMPT_LEN)]


def _trace(engine, prompt):
    """Teacher-forced logits, the logits of every greedy step, and the greedy tokens."""
    tf = engine.logits(prompt)
    rt = engine.runtime
    state = rt.new_state()
    _, logits, state = rt.prefill(state, prompt)
    steps, tokens, pos = [np.asarray(logits)], [], len(prompt)
    for _ in range(N_NEW):
        tokens.append(int(np.argmax(steps[-1])))
        logits, _, state = rt.decode_step(state, tokens[-1], pos)
        steps.append(np.asarray(logits))
        pos += 1
    return {"teacher_forced": tf, "steps": np.stack(steps), "tokens": np.asarray(tokens)}


@functools.lru_cache(maxsize=None)
def _geometry(path: str):
    f = GGUFFile(path)
    return f, read_model_config(f)


@functools.lru_cache(maxsize=None)
def _reference(path: str):
    e = sj.load(path, **OPTS)
    return _trace(e, _prompt(e))


@functools.lru_cache(maxsize=None)
def _synthetic(tmp_root: str, qtype: str) -> str:
    if qtype == "Q4_K":  # dims of 256 so the experts really are Q4_K (128-wide rows fall back to Q8_0)
        c = tiny_qwen35moe(n_layer=2).replace(d_model=256, expert_ff=256, shared_expert_ff=256)
    else:
        c = tiny_qwen35moe(n_layer=2)
    return str(write_synthetic_gguf(f"{tmp_root}/synthetic-{qtype}.gguf", c, qtype=qtype, seed=3))


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("residency"))


def _check_engine(path: str, frac: float, policy: str, **options):
    """Bitwise parity, the memory bound and the ring's bookkeeping for one (budget, policy)."""
    ref = _reference(path)
    budget = residency.budget_for_fraction(*_geometry(path), frac)
    e = _ENGINES[(path, frac, policy)] = sj.load(path, **OPTS, expert_budget=budget, expert_policy=policy, **options)
    got = _trace(e, _prompt(e))
    assert_bitwise_equal(got, ref)
    out = e.generate(_prompt(e), max_new_tokens=N_NEW, stop_on_eos=False)
    assert out.tokens == list(ref["tokens"])
    st = out.stats.experts
    assert st["tokens"] == PROMPT_LEN + N_NEW - 1 and 0.0 <= st["hit_rate"] <= 1.0
    assert set(st["hit_rate_per_layer"]) == set(e.residency.plan.layers)
    # Memory: the slot stacks on the device (their real nbytes) + the staging never exceed the budget.
    plan = e.residency.plan
    resident = e.residency.resident_bytes(e.runtime)
    staging = e.residency.resident_bytes(e.runtime, "staging")
    assert resident == plan.slot_bytes and staging <= plan.staging_bytes
    assert resident + staging <= budget
    for (_, n, _), bufs in e.residency.streamer._staging.items():  # pylint: disable=protected-access
        assert n <= plan.staging
    _check_slots(e)
    return e, st


def _check_slots(e):
    """Every slot holds the GGUF bytes of the expert its bookkeeping says, and the LUT agrees."""
    arrays = e.runtime.expert_cache_arrays()
    for i, spec in e.residency.plan.layers.items():
        get = lambda name: np.asarray(arrays[("layers", i, "ffn", "experts", name)])  # noqa: E731
        lut, owner = get("lut"), get("slot_expert")
        for s, ex in enumerate(owner):
            assert ex >= 0 and lut[ex] == s
        assert (lut >= 0).sum() == len(owner)
        src = e.residency.streamer.sources[i]
        for m, name in enumerate(MATRICES):
            stack = arrays[("layers", i, "ffn", "experts", name)]
            assert stack.shape[0] == len(owner)
            assert_bitwise_equal(_stack_bytes(stack), np.ascontiguousarray(src.views[m][owner]))


def _stack_bytes(q):
    """A QTensor stack's GGUF bytes uint8 [n, rows, row_bytes] (GGUF blocks, SoA fields or floats)."""
    if q.layout == "blocks":
        return np.asarray(q.data["raw"])
    if q.layout == "soa":
        return np.asarray(qb.soa_to_raw(q.data, SOA_TYPES[q.ggml_type]))
    w = np.asarray(q.data["w"])
    return w.view(np.uint8).reshape(*w.shape[:-1], -1)


_ENGINES: dict = {}  # engines built by earlier tests (each costs a compile), reused where possible
FIXTURE = ("tiny-qwen35moe", "tiny-qwen35moe-Q4_K_M.gguf")  # mixed Q5_0 / Q8_0 experts


@pytest.mark.parametrize("frac,policy,options", [
    (0.1, "static", {}),                 # prefill chunks stream, decode host-computes
    (0.1, "lru", {}),                    # every miss streamed into the ring: evictions
])
def test_fixture_bitwise(frac, policy, options):
    path = str(fixture_path(*FIXTURE))
    _, st = _check_engine(path, frac, policy, **options)
    assert st["hit_rate"] < 1.0 and st["callbacks"] > 0
    if policy == "lru":
        assert st["experts_evicted"] > 0 and st["bytes_streamed"] > 0


def test_fixture_frequency_calibrated(tmp_path):
    """Counts from a calibration run are saved, reloaded by 'frequency', and place experts by count."""
    path = str(fixture_path(*FIXTURE))
    # Routing does not depend on residency: any budget calibrates (reuse an engine when one exists).
    cal = _ENGINES.get((path, 0.1, "static")) or sj.load(path, **OPTS, expert_budget=10**15, expert_policy="static")
    saved = tmp_path / "counts.json"
    counts = cal.calibrate_experts([_prompt(cal)], save=str(saved))
    data = json.loads(saved.read_text())
    assert {int(k): v for k, v in data["layers"].items()} == counts
    assert all(sum(v) == PROMPT_LEN * cal.config.n_expert_used for v in counts.values())
    e, st = _check_engine(path, 0.25, "frequency", expert_counts=str(saved))
    assert e.residency.plan.counts_source == str(saved)
    for i, spec in e.residency.plan.layers.items():  # pinned slots are the most counted experts
        c = np.asarray(counts[i])
        assert spec.n_ring == 0
        if spec.n_slots:
            assert c[list(spec.resident)].min() >= np.sort(c)[::-1][spec.n_slots - 1]


@pytest.mark.parametrize("qtype,frac,policy,options", [
    ("Q8_0", 0.1, "lru", {}),
    ("Q8_0", 0.5, "static", {"expert_mode": "per_token"}),  # per-token rows == grouped rows, bit for bit
    ("Q8_0", 1.0, "slru", {}),
    ("Q4_K", 0.1, "slru", {}),
    ("Q4_K", 0.5, "frequency", {"expert_cold": "host"}),
])
def test_synthetic_bitwise(synth_dir, qtype, frac, policy, options):
    path = _synthetic(synth_dir, qtype)
    E = read_model_config(GGUFFile(path)).n_expert
    if policy == "frequency":
        options = dict(options, expert_counts={i: list(range(E)) for i in range(2)})  # highest ids most used
    e, st = _check_engine(path, frac, policy, **options)
    if policy == "frequency":
        assert all(s.resident == tuple(range(E - 1, E - 1 - s.n_slots, -1)) for s in e.residency.plan.layers.values())
    n_layers = len(e.residency.plan.layers)
    assert e.residency.plan.slot_bytes == sum(s.n_slots * s.bytes_per_expert for s in e.residency.plan.layers.values())
    if frac >= 1.0:  # every expert resident: the all-hot path only, no callback
        assert all(s.n_slots == E for s in e.residency.plan.layers.values())
        assert st["hit_rate"] == 1.0 and st["callbacks"] == 0 and st["all_hot_batches"] > 0
    else:
        slots = sum(s.n_slots for s in e.residency.plan.layers.values())
        assert slots == int(frac * n_layers * E)
        assert st["hit_rate"] < 1.0


def test_budget_too_small_names_the_minimum():
    path = fixture_path(*FIXTURE)
    f, c = _geometry(str(path))
    plan = residency.plan_residency(f, c, 10**15, "static")
    # One layer's top-k of staging per expert block-type mix (this file mixes Q5_0 and Q5_0/Q8_0 layers).
    mixes = {s.qtypes: s.bytes_per_expert for s in plan.layers.values()}
    assert len(mixes) == 2 and plan.min_budget == c.n_expert_used * sum(mixes.values())
    with pytest.raises(InputError, match=rf"minimum is {plan.min_budget} bytes"):
        sj.load(path, **OPTS, expert_budget=plan.min_budget - 1)
    dense = residency.non_expert_bytes(f, c)
    with pytest.raises(InputError, match=rf"minimum is {dense + plan.min_budget} bytes"):
        sj.load(path, **OPTS, device_budget=dense + plan.min_budget - 1)
    with pytest.raises(InputError, match="expert_policy"):
        sj.load(path, **OPTS, expert_budget=10**9, expert_policy="mru")
    with pytest.raises(InputError, match="unknown load option"):
        sj.load(path, **OPTS, expert_budget=10**9, expert_bogus=1)
    dense_model = fixture_path("tiny-qwen35", "tiny-qwen35-Q8_0.gguf")
    with pytest.raises(InputError, match="MoE"):
        sj.load(dense_model, **OPTS, expert_budget=10**9)


def test_minimum_budget_runs(synth_dir):
    """At the minimum (no slots, only the top-k staging) every expert is cold and results still match."""
    path = _synthetic(synth_dir, "Q8_0")
    ref = _reference(path)
    minimum = residency.plan_residency(*_geometry(path), 10**15, "static").min_budget
    e = sj.load(path, **OPTS, expert_budget=minimum, expert_policy="static")
    assert e.residency.plan.slot_bytes == 0
    assert_bitwise_equal(_trace(e, _prompt(e)), ref)
    st = e.expert_stats()
    assert st["hit_rate"] == 0.0 and st["bytes_streamed"] > 0 and st["experts_host_computed"] > 0


@pytest.mark.parametrize("policy", ["frequency", "static", "lru"])
def test_device_plans_share_one_geometry_and_hold_their_own_experts(policy):
    """Expert parallelism's per-device plans (`plan.device_plans`, 2 devices of the 16-expert fixture):
    one slot geometry for both (one program runs on every device), each within the per-device budget
    against its own 8 experts, and each device's slots start with its own experts in its own count
    order (random calibrated counts: the reference is numpy's sort of that device's slice)."""
    f = GGUFFile(fixture_path("tiny-qwen35moe", "tiny-qwen35moe-Q8_0.gguf"))
    c = read_model_config(f)
    local = residency.device_config(c, 2)
    assert (local.n_expert, local.n_expert_used) == (c.n_expert // 2, min(c.n_expert_used, c.n_expert // 2))
    rng = np.random.default_rng(0)
    counts = {i: rng.integers(0, 1000, c.n_expert) for i in range(c.n_layer)}
    budget = residency.parse_expert_budget("40%", f, local)
    plans = residency.device_plans(f, c, 2, budget, policy, counts)
    assert len(plans) == 2
    geometry = lambda p: {i: (s.n_slots, s.n_ring, s.staging, s.buffer, s.n_expert) for i, s in p.layers.items()}  # noqa: E731
    assert geometry(plans[0]) == geometry(plans[1])
    for d, p in enumerate(plans):
        assert p.device_bytes <= budget == p.budget
        for i, s in p.layers.items():
            assert s.n_expert == 8 and 0 < s.n_slots < 8
            own = np.asarray(counts[i][d * 8:(d + 1) * 8])
            by_counts = residency.slot_policy(policy).ordered_by_counts
            want = np.argsort(-own, kind="stable")[:s.n_slots] if by_counts else np.arange(s.n_slots)
            assert list(s.resident) == [int(e) for e in want]
