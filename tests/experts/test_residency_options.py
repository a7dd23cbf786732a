"""Residency options of `sj.load` are checked where they enter: a wrong type or value ends in one
one-line SharpiError naming the option, never a raw ValueError / TypeError from deep inside."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharpi_jax as sj
from sharpi_jax.assets import default_model_path
from sharpi_jax.errors import InputError, SharpiError, shown
from sharpi_jax.experts import residency

RESIDENCY_OPTIONS = ("expert_budget", "expert_policy") + residency.OPTION_NAMES


def _load(**kw):
    return sj.load(default_model_path(), max_context=32, **kw)


@pytest.mark.parametrize("name,value", [
    ("expert_staging", ""), ("expert_staging", 2.5), ("expert_staging", True), ("expert_staging", 0),
    ("expert_prefetch", "pass"), ("expert_prefetch", -1), ("expert_prefetch", 1.0),
    ("expert_lookahead", "next-layer"), ("expert_lookahead", 1), ("expert_lookahead", True),
    ("expert_lookahead", ["pass"]), ("expert_lookahead", np.array(["both"])), ("expert_lookahead", ""),
    ("expert_lookahead_buffer", "24"), ("expert_lookahead_buffer", -1), ("expert_lookahead_buffer", 2.5),
    ("expert_lookahead_buffer", True), ("expert_lookahead_buffer", 4),  # 4: valid, but no predicting mode
    ("expert_stream_min_rows", "8"), ("expert_stream_min_rows", -3),
    ("expert_ring", "half"), ("expert_ring", math.nan), ("expert_ring", 1.5), ("expert_ring", True),
    ("expert_cold", "warm"), ("expert_cold", ["host"]), ("expert_cold", np.array(["host", "stream"])),
    ("expert_store", "pinned"), ("expert_store", ["pinned_host"]),
    ("expert_counts", 3), ("expert_counts", b"counts.json"), ("expert_counts", "bad\0name"),
    ("expert_counts", ""), ("device_budget", "1GiB"), ("device_budget", -1),
])
def test_wrong_option_is_named(name, value):
    kw = {} if name == "device_budget" else {"expert_budget": "50%"}
    with pytest.raises(InputError, match=name) as e:
        _load(**kw, **{name: value})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["lots", 1.5, True, "nan", [1], np.arange(3)])
def test_wrong_budget_is_named(value):
    with pytest.raises(InputError, match="expert_budget") as e:
        _load(expert_budget=value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["LRU", "", None, 3, ["lru"], np.array(["lru", "slru"])])
def test_wrong_policy_is_named_even_without_a_budget(value):
    for kw in ({}, {"expert_budget": "50%"}):
        with pytest.raises(InputError, match="expert_policy"):
            _load(expert_policy=value, **kw)


@pytest.mark.parametrize("counts", [
    {"0": [1e400] * 16}, {"0": [-1] * 16}, {"0": ["3"] * 16}, {"0": [math.nan] * 16}, {"-1": [1] * 16},
    {"layers": [1, 2]}, {True: [1] * 16}, {"0": 5},
])
def test_bad_counts_are_named(counts):
    with pytest.raises(InputError, match="expert counts") as e:
        _load(expert_budget="50%", expert_policy="frequency", expert_counts=counts)
    assert "\n" not in str(e.value)


def test_counts_file_that_is_not_a_counts_dict(tmp_path):
    for text in ("[1, 2, 3]", '"x"', "{", '{"0": [1e999]}'):
        p = tmp_path / "c.json"
        p.write_text(text)
        with pytest.raises(InputError, match="expert counts"):
            _load(expert_budget="50%", expert_counts=str(p))
    with pytest.raises(InputError, match="expert counts"):
        _load(expert_budget="50%", expert_counts=str(tmp_path))  # a directory


def test_shown_is_one_short_line():
    assert shown("a\nb") == "'a\\nb'"
    text = shown(np.arange(1000).reshape(10, 100))
    assert "\n" not in text and len(text) <= 80


_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.binary(max_size=6), st.lists(st.integers(-3, 20), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(-1, 9), max_size=2),
    st.sampled_from(["25%", "50%", "0%", "101%", "1GiB", "12 parsecs", "-5", "lru", "slru", "static", "frequency",
                     "host", "stream", "auto", "none", "pass", "both", "next_layer", "", "\n", "1e400",
                     np.int64(8), np.float32(0.5), np.array([1, 2]), 0.25, 8, 16, 4096]),
)


@pytest.mark.filterwarnings("ignore:expert_policy='frequency' without calibrated counts")
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(RESIDENCY_OPTIONS), _ANY, min_size=1, max_size=4))
def test_fuzz_residency_options(options):
    """Any mix of residency options: the engine loads, or one one-line SharpiError is raised."""
    options.setdefault("expert_budget", "50%")
    try:
        _load(**options)
    except SharpiError as e:
        assert "\n" not in str(e) and len(str(e)) < 400, str(e)


def test_lookahead_modes_reach_the_plan():
    """Each expert_lookahead mode is planned as given; static / frequency get a ring for what is fetched
    ahead (`plan.LOOKAHEAD_RING_SHARE`), unless expert_ring says otherwise; without a budget it is named."""
    from sharpi_jax.experts.residency.plan import LOOKAHEAD_RING_SHARE
    for mode in residency.options.LOOKAHEAD_MODES:
        e = _load(expert_budget="50%", expert_policy="static", expert_lookahead=mode)
        for s in e.residency.plan.layers.values():
            assert s.lookahead == mode
            assert s.n_ring == (0 if mode == "none" else int(round(LOOKAHEAD_RING_SHARE * s.n_slots)))
    e = _load(expert_budget="50%", expert_policy="static", expert_lookahead="both", expert_ring=0.25)
    assert all(s.n_ring == int(round(0.25 * s.n_slots)) for s in e.residency.plan.layers.values())
    with pytest.raises(InputError, match="expert_budget"):
        _load(expert_lookahead="next_layer")
