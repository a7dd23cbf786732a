"""Expert lookahead (`expert_lookahead`): every policy x mode (x lookahead buffer) generates the
all-resident tokens bit for bit (MTP off / chain / tree, greedy and seeded), its counters add up, a
verify pass keeps what was fetched for it, the shared lookahead buffer serves only the layer it was
filled for and is charged to the budget, and the prediction is layer L+1's router on layer L's output
(`runtime.routing`).

The embedded model (16 experts, top-4, an MTP head) at a 25% budget: 4 slots per layer. Each engine
compiles its own steps; the fast tier runs a few (policy, mode, buffer) cells, `-m slow` the whole product.
"""

from __future__ import annotations

import functools
import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharpi_jax as sj
from sharpi_jax.assets import default_model_path
from sharpi_jax.experts import residency
from sharpi_jax.errors import InputError
from sharpi_jax.experts.residency.options import LOOKAHEAD_MODES
from sharpi_jax.experts.residency.plan import PREDICT_MODES
from sharpi_jax.model.footprint import held_bytes
from sharpi_jax.model.moe import top_k_weights
from sharpi_jax.runtime.routing import top_k_ids, trace_routing
from sharpi_jax.runtime.state import init_state
from tests.bitwise import assert_bitwise_equal

PROMPT = "import os\nimport sys\n\n\nclass "
N_NEW = 10
OPTS = dict(max_context=128)
RUNS = {  # name -> generate kwargs
    "plain": {}, "chain": dict(speculative="mtp", draft_tokens=3), "tree": dict(speculative="mtp_tree", draft_tokens=3)}
SAMPLING = {"greedy": {}, "seeded": dict(temperature=0.8, top_k=8, seed=3)}
ALL_RUNS = tuple(itertools.product(RUNS, SAMPLING))
BUFFER = 4  # experts in the shared lookahead buffer of the buffer cells (one layer's top-k)


@functools.lru_cache(maxsize=None)
def _reference(run: str, sampling: str) -> list[int]:
    return _full().generate(PROMPT, max_new_tokens=N_NEW, **RUNS[run], **SAMPLING[sampling]).tokens


@functools.lru_cache(maxsize=None)
def _full():
    return sj.load(default_model_path(), **OPTS)


@functools.lru_cache(maxsize=None)
def _engine(policy: str, mode: str, buffer: int = 0):
    kw = {"expert_counts": {i: list(range(16)) for i in range(4)}} if policy == "frequency" else {}
    return sj.load(default_model_path(), **OPTS, expert_budget="25%", expert_policy=policy, expert_lookahead=mode,
                   expert_lookahead_buffer=buffer or None, **kw)


def _check_cell(policy: str, mode: str, runs, buffer: int = 0) -> list[dict]:
    """The (policy, mode, buffer) engine's tokens == the all-resident tokens for each run; its stats add up."""
    e = _engine(policy, mode, buffer)
    out = []
    for run, sampling in runs:
        got = e.generate(PROMPT, max_new_tokens=N_NEW, **RUNS[run], **SAMPLING[sampling])
        assert got.tokens == _reference(run, sampling), (policy, mode, run, sampling)
        st = got.stats.experts
        bpe = next(iter(e.residency.plan.layers.values())).bytes_per_expert
        assert st["hit_rate"] < 1.0 and st["lookahead"] == [mode]
        assert st["hits"] + st["misses"] == sum(p["pairs"] for p in st["per_layer"].values())
        # Every expert fetched ahead got a slot and was scored by the call it was fetched for.
        assert st["prefetch_useful"] + st["prefetch_useless"] == st["experts_prefetched"]
        assert st["bytes_prefetched"] == st["experts_prefetched"] * bpe  # one expert geometry in this model
        assert st["bytes_demand"] == st["bytes_streamed"] + st["host_bytes_read"]
        assert st["bytes_moved"] == st["bytes_demand"] + st["bytes_prefetched"]
        if mode in ("none", "pass"):
            assert st["experts_prefetched"] == 0
        else:
            assert st["experts_prefetched"] > 0 and st["prefetch_useful"] > 0
        out.append(st)
    return out


@pytest.mark.parametrize("policy,mode,buffer,runs", [
    ("static", "both", 0, (("chain", "seeded"),)),
    ("lru", "next_layer", 0, (("tree", "greedy"),)),
    ("slru", "both", 0, (("plain", "greedy"),)),
    ("lru", "both", BUFFER, (("chain", "greedy"),)),
    ("frequency", "next_layer", BUFFER, (("plain", "seeded"),)),
])
def test_lookahead_is_the_all_resident_run(policy, mode, buffer, runs):
    _check_cell(policy, mode, runs, buffer)


@pytest.mark.slow
@pytest.mark.parametrize("policy,mode,buffer", [(p, m, 0) for p, m in itertools.product(residency.POLICIES, LOOKAHEAD_MODES)]
                         + [(p, m, BUFFER) for p, m in itertools.product(residency.POLICIES, PREDICT_MODES)])
def test_lookahead_product(policy, mode, buffer):
    try:
        _check_cell(policy, mode, ALL_RUNS, buffer)
    finally:  # one engine at a time: ~6 engines' compiled steps in one process crashed XLA:CPU's compiler here
        from experiments.presets import release_compiled_code
        _engine.cache_clear()
        release_compiled_code()


def test_pass_streams_a_verify_union_that_auto_computes_on_the_host():
    """frequency at cold="auto": a 4-row verify pass host-computes its misses; "pass" streams them."""
    runs = (("chain", "greedy"),)
    (none,), (pas,) = _check_cell("frequency", "none", runs), _check_cell("frequency", "pass", runs)
    assert pas["experts_streamed"] > none["experts_streamed"]
    assert pas["experts_host_computed"] < none["experts_host_computed"]


# ----- the mechanism, on one layer's module -----

def _layer(mode: str, layer: int = 1):
    """A fresh lru engine at 50% (8 ring slots of 16, staging 4) and one of its layers' ResidentExperts."""
    e = sj.load(default_model_path(), **OPTS, expert_budget="50%", expert_policy="lru", expert_lookahead=mode)
    return e, e.model.layers[layer].ffn.experts


def _resident(m) -> set[int]:
    return {int(x) for x in np.asarray(m.slot_expert.get_value())}


def test_pass_keeps_what_was_fetched_for_the_pass():
    """Fetched ahead for a pass, unused by it: "both" keeps those slots through the pass's own
    streaming; "next_layer" (no pass protection) lets the pass evict them. The rows are the
    all-resident rows either way."""
    u = jnp.asarray(np.random.default_rng(0).standard_normal((2, 128)).astype(np.float32))
    sel = jnp.asarray([[12, 13, 14, 15], [4, 5, 6, 7]], jnp.int32)
    w = jnp.full((2, 4), 0.25, jnp.float32)
    valid = jnp.asarray([True, True])  # two valid rows: a pass
    ref = _full().model.layers[1].ffn.experts(u, sel, w, valid)
    kept = {}
    for mode in ("both", "next_layer"):
        e, m = _layer(mode)
        assert m.spec.n_slots == m.spec.n_ring == 8 and m.spec.staging == 4
        assert _resident(m) == set(range(8))
        m.prefetch(jnp.asarray([[8, 9, 10, 11], [8, 9, 10, 11]], jnp.int32), jnp.asarray([True, False]))
        assert _resident(m) == set(range(4, 12))  # least recently used out: slots 0-3 (experts 0-3)
        out = m(u, sel, w, valid)  # streams 12-15; 4-7 are used, 8-11 were fetched for this pass
        assert_bitwise_equal(np.asarray(out), np.asarray(ref))
        kept[mode] = {8, 9, 10, 11} <= _resident(m)
        ctr = dict(zip(residency.CTR, np.asarray(m.ctr.get_value()).tolist()))
        assert (ctr["ahead_streamed"], ctr["ahead_useful"], ctr["ahead_useless"]) == (4, 0, 4)
    assert kept == {"both": True, "next_layer": False}


class _Recorder(nnx.Module):
    """A provider that records the predictions the trunk hands it (eager runs only)."""

    predicts = True

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log

    def prefetch(self, sel, valid):
        self.log.append(np.asarray(sel))

    def __call__(self, u, sel, w, valid):
        return self.inner(u, sel, w, valid)


def test_prediction_is_the_next_layers_router_on_this_layers_output():
    """The experts handed to layer L+1's prefetch are the top-k of layer L+1's router applied early
    (`trace_routing`'s `early`, the research figure's definition), row by row, for every L+1 >= 1."""
    e = sj.load(default_model_path(), **OPTS)
    model = e.model
    c = model.config
    ids = e.tokenizer.encode(PROMPT)[:8]
    want = top_k_ids(trace_routing(model, ids).early, c.n_expert_used)  # [L, T, k]
    logs = {i: [] for i in range(c.n_layer)}
    for i, blk in enumerate(model.layers):
        blk.ffn.experts = _Recorder(blk.ffn.experts, logs[i])
    T = len(ids)
    model.prefill(init_state(c, T), jnp.asarray(ids, jnp.int32), jnp.int32(0), jnp.int32(T))
    assert logs[0] == []  # no layer before the first
    for i in range(1, c.n_layer):
        (got,) = logs[i]
        np.testing.assert_array_equal(got, want[i])
    # the same top-k as the MoE's own routing function (ties by lower id)
    probs = np.random.default_rng(1).random((3, c.n_expert)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(top_k_weights(jnp.asarray(probs), c.n_expert_used)[0]),
                                  top_k_ids(probs, c.n_expert_used))


# ----- the shared lookahead buffer -----

def test_buffer_is_charged_to_the_budget_once():
    """A lookahead buffer of P experts holds the same expert bytes as the plan without it (the budget):
    its P experts come out of the slots of the layers it serves (all but the first), it is one buffer
    for all layers, and the bytes the engine holds are the plan's."""
    plain = _engine("lru", "next_layer")
    e = sj.load(default_model_path(), **OPTS, expert_budget="25%", expert_policy="lru", expert_lookahead="next_layer",
                expert_lookahead_buffer=BUFFER)  # built, not run: no compilation
    p0, p = plain.residency.plan, e.residency.plan
    bpe = next(iter(p.layers.values())).bytes_per_expert
    assert p.budget == p0.budget and p.buffer == BUFFER and p.buffer_bytes == BUFFER * bpe
    assert p.device_bytes <= p.budget and p.device_bytes == p0.device_bytes  # whole experts: exactly traded
    assert p.layers[0].n_slots == p0.layers[0].n_slots  # the first layer is never predicted
    assert sum(p0.layers[i].n_slots - p.layers[i].n_slots for i in p.layers) == BUFFER
    # What the device holds: the plan's bytes (slot stacks + staging + ONE buffer), the buffer's labels,
    # and the small state (LUTs, ring state, counters) within 1% (as `info --plan` is checked).
    labels = 4 * (BUFFER + 2)  # int32: the expert of each entry, the layer, fresh
    assert e.residency.resident_bytes(e.runtime, "buffer") == BUFFER * bpe + labels
    assert e.residency.resident_bytes(e.runtime, "all") == p.device_bytes + labels
    assert 0 < held_bytes(e.model)["experts"] - p.device_bytes <= 0.01 * p.device_bytes


def test_buffer_needs_a_predicting_mode_and_room():
    for mode in ("none", "pass", None):
        with pytest.raises(InputError, match="expert_lookahead_buffer") as err:
            sj.load(default_model_path(), **OPTS, expert_budget="25%", expert_lookahead=mode, expert_lookahead_buffer=4)
        assert "\n" not in str(err.value)
    least = _engine("lru", "next_layer").residency.plan.min_budget  # the staging only: no slot to give up
    with pytest.raises(InputError, match="expert_lookahead_buffer"):
        sj.load(default_model_path(), **OPTS, expert_budget=least, expert_lookahead="both", expert_lookahead_buffer=1)


def _buffer_layers(mode: str = "next_layer"):
    """A fresh lru engine at 50% with a lookahead buffer of 4, and its layers' ResidentExperts."""
    e = sj.load(default_model_path(), **OPTS, expert_budget="50%", expert_policy="lru", expert_lookahead=mode,
                expert_lookahead_buffer=BUFFER)
    return e, [blk.ffn.experts for blk in e.model.layers]


def _ctr(m) -> dict:
    return dict(zip(residency.CTR, np.asarray(m.ctr.get_value()).tolist()))


def test_buffer_serves_the_layer_it_was_filled_for_only():
    """Layer 1's predictions fetched into the shared buffer: layer 2's call (same expert ids, its own
    weights) must not read them; layer 1's call reads them as hits, without streaming; every row is the
    all-resident row bit for bit; layer 1's ring is not touched by the fetch."""
    u = jnp.asarray(np.random.default_rng(0).standard_normal((2, 128)).astype(np.float32))
    fetched = [12, 13, 14, 15]
    sel = jnp.asarray([fetched, fetched], jnp.int32)
    w = jnp.asarray([[0.4, 0.3, 0.2, 0.1], [0.0] * 4], jnp.float32)
    valid = jnp.asarray([True, False])  # one valid row (decode; padding routed like row 0, zero weights)
    full = _full().model.layers
    e, ms = _buffer_layers()
    assert ms[1].ahead is ms[2].ahead  # one buffer for the layers
    before = {i: _resident(ms[i]) for i in (1, 2)}
    assert not set(fetched) & (before[1] | before[2])
    ms[1].prefetch(jnp.asarray([fetched, fetched], jnp.int32), valid)
    assert _resident(ms[1]) == before[1]  # into the buffer, not the ring
    assert np.asarray(ms[1].ahead["expert"].get_value()).tolist() == fetched
    out2 = ms[2](u, sel, w, valid)  # layer 2: experts 12-15 are not in its slots, whatever the buffer holds
    assert_bitwise_equal(np.asarray(out2)[:1], np.asarray(full[2].ffn.experts(u, sel, w, valid))[:1])  # the valid row
    c2 = _ctr(ms[2])
    assert (c2["hits"], c2["misses"], c2["ahead_useful"] + c2["ahead_useless"]) == (0, 4, 0)
    # layer 2 streamed its misses into its own ring (staging); the buffer is still layer 1's
    out1 = ms[1](u, sel, w, valid)
    assert_bitwise_equal(np.asarray(out1)[:1], np.asarray(full[1].ffn.experts(u, sel, w, valid))[:1])
    c1 = _ctr(ms[1])
    assert (c1["hits"], c1["misses"], c1["slow_batches"], c1["streamed"]) == (4, 0, 0, 0)
    assert (c1["ahead_streamed"], c1["ahead_useful"], c1["ahead_useless"]) == (4, 4, 0)
    # A fetch for layer 2 relabels the buffer: layer 1 no longer reads it (its experts 12-15 miss again).
    ms[2].prefetch(jnp.asarray([[0, 1, 2, 3], [0, 1, 2, 3]], jnp.int32), valid)
    ms[1](u, sel, w, valid)
    assert _ctr(ms[1])["misses"] == 4
