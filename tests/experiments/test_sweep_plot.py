"""Sweeps end to end: config -> JSONL records with median and min/max -> the standard figures with error
bars (in-process, and the plot command on the records)."""

from __future__ import annotations

import json

import pytest

from experiments import plot, sweep
from tests.experiments.entry_point import ok, run_entry_point


def test_two_point_sweep_and_plots(tmp_path):
    cfg = {
        "name": "two_points", "models": ["default"], "prompts": ["def fibonacci(n):\n", "import os\n"],
        "max_new_tokens": 12, "repeats": 2, "load": {"max_context": 256},
        "grid": {"speculative": [None, "mtp"], "draft_tokens": [2], "verify": ["batched"], "loop": ["host"]},
    }
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "two_points.jsonl"
    records = sweep.run_sweep(sweep.load_config(path), out, log=lambda *_: None)
    assert len(records) == 4  # one per (point, prompt), each over 2 timed rounds
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == records
    off, mtp = sorted((r for r in records if r["prompt"] == 0), key=lambda r: r["speculative"] is not None)
    assert off["speculative"] is None and "draft_tokens" not in off  # collapsed: ignored without MTP
    assert mtp["speculative"] == "mtp" and mtp["draft_tokens"] == 2
    assert off["generated_tokens"] == mtp["generated_tokens"] == 12
    assert len(mtp["accept_per_position"]) == 2 and 0 <= mtp["acceptance_rate"] <= 1
    for r in records:  # median with min / max of every timing, and the per-round tok/s
        assert r["repeats"] == 2
        for key in ("decode_tok_s", "prefill_tok_s", "decode_s", "prefill_s"):
            assert r[f"{key}_min"] <= r[key] <= r[f"{key}_max"], key
        for key in ("decode_tok_s", "prefill_tok_s"):
            runs = r[f"{key}_runs"]
            assert len(runs) == 2 and (min(runs), max(runs)) == (r[f"{key}_min"], r[f"{key}_max"])
            assert r[key] == pytest.approx(sum(runs) / 2)  # the median of two
        assert "decode_tok_s_runs" in r and "decode_s_runs" not in r
    for key in ("draft_s", "verify_s"):
        assert mtp[f"{key}_min"] <= mtp[key] <= mtp[f"{key}_max"]

    import matplotlib.pyplot as plt
    from matplotlib.container import ErrorbarContainer

    figs = plot.figures(records)
    assert sorted(figs) == ["acceptance_per_position.png", "tok_s_vs_k.png"]
    ax = figs["tok_s_vs_k.png"].axes[0]
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 1 and bars[0].has_yerr  # the batched-verify line, with min-max error bars
    (x,), (y,) = bars[0].lines[0].get_data()
    mtp_recs = [r for r in records if r["speculative"] == "mtp"]
    per_round = [sum(r["decode_tok_s_runs"][i] for r in mtp_recs) / 2 for i in range(2)]
    assert x == 2 and min(per_round) <= y <= max(per_round)
    segments = bars[0].lines[2][0].get_segments()  # the vertical bar: min to max over the rounds
    (x0, lo), (x1, hi) = segments[0]
    assert x0 == x1 == 2 and (lo, hi) == pytest.approx((min(per_round), max(per_round)))
    assert any(line.get_linestyle() == "--" for line in ax.lines)  # MTP off, with its min-max band
    assert len(ax.patches) >= 1 or len(ax.collections) >= 2
    for fig in figs.values():
        plt.close(fig)

    written = plot.plot_all(records, tmp_path / "plots")
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    # The same figures from the command line.
    res = ok(run_entry_point("plot", f"--results={out}", f"--out_dir={tmp_path / 'cli'}", cache=tmp_path / "cache"))
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == ["acceptance_per_position.png", "tok_s_vs_k.png"]
    assert res.stdout.count("wrote ") == 2


def test_plot_without_spread_fields_still_draws(tmp_path):
    """Records written before spreads existed (one timing each) plot as before, without error bars."""
    records = [{"model": "m", "speculative": None, "decode_tok_s": 100.0},
               {"model": "m", "speculative": "mtp", "draft_tokens": 1, "verify": "batched", "decode_tok_s": 90.0,
                "accept_per_position": [0.5]},
               {"model": "m", "speculative": "mtp", "draft_tokens": 2, "verify": "batched", "decode_tok_s": 80.0,
                "accept_per_position": [0.5, 0.2]}]
    import matplotlib.pyplot as plt
    from matplotlib.container import ErrorbarContainer

    figs = plot.figures(records)
    ax = figs["tok_s_vs_k.png"].axes[0]
    (bars,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert list(bars.lines[0].get_ydata()) == [90.0, 80.0]
    for fig in figs.values():
        plt.close(fig)


def test_tree_figure_and_grid(tmp_path):
    """mtp_tree records draw tree_vs_nodes.png (a line per depth, the chain as a cross); tree grids drop
    trees smaller than their depth and tree options of the chain."""
    records = [{"model": "m", "speculative": None, "decode_tok_s": 100.0},
               {"model": "m", "speculative": "mtp", "draft_tokens": 2, "verify": "batched", "decode_tok_s": 90.0,
                "mean_accept_len": 1.5}]
    records += [{"model": "m", "speculative": "mtp_tree", "draft_tokens": 2, "tree_nodes": n, "verify": "batched",
                 "decode_tok_s": 80.0 + n, "mean_accept_len": 1.5 + n / 10} for n in (4, 8)]
    import matplotlib.pyplot as plt

    figs = plot.figures(records)
    ax_len, _ = figs["tree_vs_nodes.png"].axes
    ys = sorted({round(float(y), 6) for line in ax_len.lines for y in line.get_ydata()})
    assert ys == [1.5, 1.9, 2.3]  # the chain's cross and the two tree points
    for fig in figs.values():
        plt.close(fig)
    pts = list(sweep.grid_points({"speculative": ["mtp", "mtp_tree"], "draft_tokens": [3], "tree_nodes": [2, 8]}))
    assert pts == [{"draft_tokens": 3, "speculative": "mtp"},
                   {"draft_tokens": 3, "speculative": "mtp_tree", "tree_nodes": 8}]


def test_batched_sweep_records_each_prompt_as_generated_alone(tmp_path):
    """batch=2 over 3 prompts of different lengths: groups (0, 1) and (2,), one generate_batch each; each
    record holds its own prompt's figures, which equal a one-sequence `generate` of that prompt (the
    reference), and its group's shared decode tok/s. `batches.generate_grouped` (draft_vocab_quality's
    loop) likewise gives each prompt's own output, in order."""
    import sharpi_jax as sj
    from experiments import batches

    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass Config:\n    x = 1\n", "x = ["]
    cfg = {"name": "batched", "models": ["default"], "prompts": prompts, "max_new_tokens": 6, "repeats": 1,
           "batch": 2, "load": {"max_context": 64}, "grid": {"speculative": [None, "mtp"], "draft_tokens": [2]}}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(cfg))
    records = sweep.run_sweep(sweep.load_config(path), tmp_path / "b.jsonl", log=lambda *_: None)
    assert [(r["speculative"], r["prompt"], r["batch"]) for r in records] == \
        [(None, 0, 2), (None, 1, 2), (None, 2, 1), ("mtp", 0, 2), ("mtp", 1, 2), ("mtp", 2, 1)]
    with sj.load(max_context=64) as e:
        for r in records:
            alone = e.generate(prompts[r["prompt"]], max_new_tokens=6, speculative=r["speculative"],
                               draft_tokens=2).stats.to_dict()
            keys = ["prompt_tokens", "generated_tokens", "stop_reason"] + \
                (["drafted", "accepted", "verify_passes", "accept_per_position"] if r["speculative"] else [])
            assert {k: r[k] for k in keys} == {k: alone[k] for k in keys}, r["prompt"]
            assert r["decode_tok_s"] == r["batch_decode_tok_s"] > 0
        alone = [e.generate(p, max_new_tokens=6, speculative="mtp", draft_tokens=2) for p in prompts]
        grouped = batches.generate_grouped(e, prompts, 2, max_new_tokens=6, speculative="mtp", draft_tokens=2)
        assert [o.stats.batch.size for o in grouped] == [2, 2, 1]
        for a, g in zip(alone, grouped, strict=True):
            assert a.stats.speculation.drafted > 0
            assert (g.tokens, g.stats.speculation) == (a.tokens, a.stats.speculation)
    assert len({r["prompt_tokens"] for r in records}) == 3  # the prompts are told apart by their length
    assert [list(g) for g in batches.groups(5, 2)] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("opts, bad", [({"expert_budget_frac": [0.5]}, "expert_budget_frac"),
                                       ({"loop": ["host"]}, "loop='host'"),
                                       ({"speculative": ["mtp"], "verify": ["sequential"]}, "verify='sequential'")])
def test_batched_sweep_refuses_what_a_batch_cannot_run(tmp_path, opts, bad):
    from sharpi_jax.errors import InputError

    cfg = {"name": "b", "models": ["default"], "grid": opts, "batch": 2}
    with pytest.raises(InputError, match=f"batch=2 runs generate_batch, which cannot run {bad} "):
        sweep.run_sweep(cfg, tmp_path / "b.jsonl", log=lambda *_: None)
    assert not (tmp_path / "b.jsonl").exists()  # refused before anything ran
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({**cfg, "batch": 0}))
    with pytest.raises(InputError, match="'batch' must be an integer >= 1, got 0"):
        sweep.load_config(p)


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
