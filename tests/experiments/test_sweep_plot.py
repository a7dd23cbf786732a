"""A 2-point sweep end to end: config -> JSONL records -> the standard PNG figures."""

from __future__ import annotations

import json

import pytest

from experiments import plot, sweep


def test_two_point_sweep_and_plots(tmp_path):
    cfg = {
        "name": "two_points", "models": ["default"], "prompts": ["def fibonacci(n):\n"],
        "max_new_tokens": 12, "repeats": 1, "load": {"max_context": 256},
        "grid": {"speculative": [None, "mtp"], "draft_tokens": [2], "verify": ["batched"]},
    }
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "two_points.jsonl"
    records = sweep.run_sweep(sweep.load_config(path), out, log=lambda *_: None)
    assert len(records) == 2
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == records
    off, mtp = sorted(records, key=lambda r: r["speculative"] is not None)
    assert off["speculative"] is None and "draft_tokens" not in off  # collapsed: ignored without MTP
    assert mtp["speculative"] == "mtp" and mtp["draft_tokens"] == 2
    assert off["generated_tokens"] == mtp["generated_tokens"] == 12
    assert len(mtp["accept_per_position"]) == 2 and 0 <= mtp["acceptance_rate"] <= 1
    written = plot.plot_all(records, tmp_path / "plots")
    names = sorted(p.name for p in written)
    assert names == ["acceptance_per_position.png", "tok_s_vs_k.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_grid_points_collapse_ignored_options():
    pts = list(sweep.grid_points({"speculative": [None, "mtp"], "draft_tokens": [1, 3]}))
    assert pts == [{"speculative": None}, {"draft_tokens": 1, "speculative": "mtp"},
                   {"draft_tokens": 3, "speculative": "mtp"}]


def test_bad_config_is_a_clear_error(tmp_path):
    from sharpi_jax.errors import InputError

    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"name": "x", "models": ["default"], "grid": {"draft_tokens": 3}}))
    with pytest.raises(InputError, match="'grid' must map option names to non-empty lists"):
        sweep.load_config(p)


def test_expert_budget_sweep_calibrates_and_plots_hit_rate(tmp_path):
    """expert_budget_frac points load with that share of routed-expert bytes; `calibrate` saves routing
    counts beside the results (not beside the model) and the frequency policy uses them."""
    from sharpi_jax.assets import default_model_path

    cfg = {
        "name": "budget", "models": ["default"], "prompts": ["def fibonacci(n):\n"], "max_new_tokens": 6,
        "repeats": 1, "load": {"max_context": 128}, "calibrate": {"prompts": ["import os\nimport sys\n"]},
        "grid": {"expert_budget_frac": [0.5, 1.0], "expert_policy": ["frequency"], "speculative": ["mtp"],
                 "draft_tokens": [2]},
    }
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(cfg))
    records = sweep.run_sweep(sweep.load_config(path), tmp_path / "budget.jsonl", log=lambda *_: None)
    counts = tmp_path / "budget.default.expert-counts.json"
    beside_model = default_model_path().with_name(default_model_path().name + ".expert-counts.json")
    assert counts.exists() and not beside_model.exists()
    by_frac = {r["expert_budget_frac"]: r for r in records}
    assert set(by_frac) == {0.5, 1.0}
    half, full = by_frac[0.5], by_frac[1.0]
    assert str(counts) in str(half["experts.counts_source"])
    assert half["experts.resident_fraction"] == pytest.approx(0.5, abs=0.07)
    assert full["hit_rate"] == 1.0 and 0.0 <= half["hit_rate"] < 1.0
    assert half["generated_tokens"] == full["generated_tokens"]
    written = plot.plot_all(records, tmp_path / "plots")
    assert "hit_rate_vs_budget.png" in {p.name for p in written}
