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
