"""The timing discipline shared by sweeps and benchmarks (experiments.timing) and the sweep's record
aggregation: warm-up first and unrecorded, rounds interleaved A B C A B C, median with min / max."""

from __future__ import annotations

import pytest

from experiments import sweep, timing


def test_interleaved_warms_up_then_cycles_through_the_cells():
    calls = []
    lines = []
    results = timing.interleaved(["A", "B", "C"], lambda c: calls.append(c) or f"{c}{len(calls)}", 2,
                                 log=lines.append)
    assert calls == ["A", "B", "C"] + ["A", "B", "C"] * 2  # warm-up, then round 1, round 2
    assert results == [["A4", "A7"], ["B5", "B8"], ["C6", "C9"]]  # warm-up results are never returned
    assert [ln.split(":")[0].strip() for ln in lines] == ["warm-up", "round 1/2", "round 2/2"]


def test_interleaved_with_a_separate_warm_up_and_none():
    calls = []
    timing.interleaved([1, 2], lambda c: calls.append(("run", c)), 1, warm=lambda c: calls.append(("warm", c)),
                       log=lambda m: None)
    assert calls == [("warm", 1), ("warm", 2), ("run", 1), ("run", 2)]
    calls.clear()
    timing.interleaved([1, 2], lambda c: calls.append(c), 3, warmup=False, log=lambda m: None)
    assert calls == [1, 2] * 3
    with pytest.raises(ValueError):
        timing.interleaved([1], lambda c: c, 0)


def test_spread_fields():
    rec = timing.put_spread({}, "tok_s", [3.0, 1.0, 2.0, 10.0])
    assert rec == {"tok_s": 2.5, "tok_s_min": 1.0, "tok_s_max": 10.0, "tok_s_runs": [3.0, 1.0, 2.0, 10.0]}
    assert timing.put_spread({}, "s", [2.0], runs=False) == {"s": 2.0, "s_min": 2.0, "s_max": 2.0}
    assert timing.fmt_spread([1.0, 2.0, 4.0]) == "2.0 [1.0-4.0]"


def test_sweep_aggregate_keeps_deterministic_fields_and_spreads_the_rest():
    runs = [{"decode_tok_s": 100.0, "decode_s": 0.5, "generated_tokens": 12, "accepted": 7, "stop_reason": "eos",
             "experts.hit_rate": 0.5, "experts.policy": "lru", "flag": True},
            {"decode_tok_s": 300.0, "decode_s": 0.25, "generated_tokens": 12, "accepted": 7, "stop_reason": "eos",
             "experts.hit_rate": 0.75, "experts.policy": "lru", "flag": True},
            {"decode_tok_s": 200.0, "decode_s": 0.3, "generated_tokens": 12, "accepted": 7, "stop_reason": "eos",
             "experts.hit_rate": 0.5, "experts.policy": "lru", "flag": True}]
    rec = sweep.aggregate(runs)
    assert (rec["decode_tok_s"], rec["decode_tok_s_min"], rec["decode_tok_s_max"]) == (200.0, 100.0, 300.0)
    assert rec["decode_tok_s_runs"] == [100.0, 300.0, 200.0]
    assert (rec["decode_s"], rec["decode_s_min"], rec["decode_s_max"]) == (0.3, 0.25, 0.5)
    assert "decode_s_runs" not in rec
    assert (rec["experts.hit_rate"], rec["experts.hit_rate_min"], rec["experts.hit_rate_max"]) == (0.5, 0.5, 0.75)
    assert rec["generated_tokens"] == 12 and "generated_tokens_min" not in rec and rec["stop_reason"] == "eos"
    assert rec["flag"] is True and rec["experts.policy"] == "lru"
