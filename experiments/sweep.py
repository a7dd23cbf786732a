"""Run a grid of generation experiments from a JSON config and write one JSONL record per run.

    python -m experiments.sweep --config=configs/sweeps/mtp_draft_tokens.json [--out=results/x.jsonl]

Config keys: `name`, `models` (preset names from configs/models.json or GGUF paths), `prompts` (a list
of strings, or "fixtures" for the reference prompts, or "python" for built-in Python snippets),
`max_new_tokens`, `repeats`, `load` (options for sj.load shared by all points), `calibrate` (optional,
{"prompts": ...}: routing counts for expert_policy="frequency", taken on these prompts and saved beside
the results), and `grid`: a dict of option -> list of values. Options that `sj.load` takes
(max_context, expert_budget, expert_budget_frac, expert_policy, expert_mode, ...) reload the model;
the rest go to `engine.generate`. expert_budget is bytes or a string ("8GiB", "25%");
expert_budget_frac is a share of all routed-expert bytes (0.25). Points that differ only in options a
mode ignores (draft_tokens without speculation) are run once.

Each record: the sweep name, model, point options, prompt index, repeat, and the generation stats
flattened (decode_tok_s, prefill_tok_s, acceptance, expert reads, ...). `python -m experiments.plot`
draws the standard figures from them.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "Sweep config (JSON).", required=True)
flags.DEFINE_string("out", None, "Output JSONL (default: results/<name>.jsonl).")
flags.DEFINE_bool("quiet", False, "No per-run lines.")

LOAD_OPTIONS = frozenset({"max_context", "expert_budget", "expert_budget_frac", "expert_policy", "expert_mode",
                          "prefill_buckets", "row_kernel", "gdn_chunk"})
# Options that only matter with speculation: collapsed for speculative = None.
SPECULATIVE_ONLY = ("draft_tokens", "verify")

PYTHON_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\nclass ",
    "    def __init__(self, name, value=None):\n        self.name = name\n",
    "def read_config(path):\n    with open(path) as f:\n",
]


def load_config(path: str | Path) -> dict[str, Any]:
    from sharpi_jax.errors import InputError

    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"sweep config {path}: {e}") from None
    for key in ("name", "models", "grid"):
        if key not in cfg:
            raise InputError(f"sweep config {path}: missing key {key!r}")
    if not isinstance(cfg["grid"], dict) or not all(isinstance(v, list) and v for v in cfg["grid"].values()):
        raise InputError(f"sweep config {path}: 'grid' must map option names to non-empty lists")
    return cfg


def resolve_prompts(spec: Any) -> list[str]:
    if spec is None or spec == "python":
        return list(PYTHON_PROMPTS)
    if spec == "fixtures":
        from experiments.presets import FIXTURES_DIR

        refs = FIXTURES_DIR / "tiny-qwen35moe" / "references.json"
        return json.loads(refs.read_text())["prompts"] if refs.exists() else list(PYTHON_PROMPTS)
    return [str(p) for p in spec]


def grid_points(grid: dict[str, list]) -> Iterator[dict[str, Any]]:
    """Cartesian product of the grid, with options that a point ignores collapsed (deduplicated)."""
    keys = sorted(grid)
    seen = set()
    for values in itertools.product(*(grid[k] for k in keys)):
        point = dict(zip(keys, values))
        if point.get("speculative", "unset") is None:
            for k in SPECULATIVE_ONLY:
                point.pop(k, None)
        key = json.dumps(point, sort_keys=True)
        if key not in seen:
            seen.add(key)
            yield point


def _flatten(stats: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in stats.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


def _calibrate(cfg: dict[str, Any], model_name: str, path: Path, out_path: Path, log) -> Path | None:
    """With a `calibrate` entry ({"prompts": ..., like `prompts`}), the routing counts of `model_name`
    over those prompts, saved beside the results (never beside the model) for expert_policy="frequency"."""
    spec = cfg.get("calibrate")
    if not spec:
        return None
    import sharpi_jax as sj
    from sharpi_jax.gguf import GGUFFile, read_model_config

    with GGUFFile(path) as f:
        if not read_model_config(f).is_moe:
            return None  # a dense model has no routed experts to place

    counts_path = out_path.with_name(f"{out_path.stem}.{Path(str(model_name)).stem}.expert-counts.json")
    engine = sj.load(path, max_context=int(spec.get("max_context", cfg.get("load", {}).get("max_context", 4096))),
                     expert_budget="100%")
    prompts = resolve_prompts(spec.get("prompts"))
    engine.calibrate_experts(prompts, save=counts_path)
    log(f"{model_name}: routing counts over {len(prompts)} calibration prompts -> {counts_path}")
    return counts_path


def run_sweep(cfg: dict[str, Any], out_path: Path, log=print) -> list[dict[str, Any]]:
    """Run every (model, load options, point, prompt, repeat); append records to out_path; return them."""
    import sharpi_jax as sj
    from experiments.presets import resolve_model

    prompts = resolve_prompts(cfg.get("prompts"))
    repeats = int(cfg.get("repeats", 1))
    max_new = int(cfg.get("max_new_tokens", 32))
    points = list(grid_points(cfg["grid"]))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    records = []
    with out_path.open("a") as out:
        for model_name in cfg["models"]:
            path = resolve_model(model_name)
            counts_path = _calibrate(cfg, model_name, path, out_path, log)
            by_load: dict[str, list[dict]] = {}
            for p in points:
                load_opts = {k: v for k, v in p.items() if k in LOAD_OPTIONS}
                by_load.setdefault(json.dumps(load_opts, sort_keys=True), []).append(p)
            for load_key, group in by_load.items():
                load_opts = {**cfg.get("load", {}), **json.loads(load_key)}
                frac = load_opts.pop("expert_budget_frac", None)
                if frac is not None:  # a share of all routed-expert bytes (residency.parse_expert_budget)
                    load_opts["expert_budget"] = f"{100 * float(frac)}%"
                if counts_path is not None and load_opts.get("expert_budget") is not None:
                    load_opts.setdefault("expert_counts", str(counts_path))
                engine = sj.load(path, **load_opts)
                for point in group:
                    gen_opts = {k: v for k, v in point.items() if k not in LOAD_OPTIONS}
                    for pi, prompt in enumerate(prompts):
                        for r in range(repeats + 1):  # run 0 warms up the compiled shapes
                            res = engine.generate(prompt, max_new_tokens=max_new, **gen_opts)
                            if r == 0:
                                continue
                            rec = {"sweep": cfg["name"], "model": model_name, **point, "prompt": pi,
                                   "repeat": r - 1, "time": time.time(), **_flatten(res.stats)}
                            if "experts.hit_rate" in rec:  # the residency figure's y (experiments.plot)
                                rec["hit_rate"] = rec["experts.hit_rate"]
                            out.write(json.dumps(rec) + "\n")
                            out.flush()
                            records.append(rec)
                            log(f"{model_name} {point} prompt {pi}: "
                                f"{res.stats.get('decode_tok_s', 0):.1f} tok/s")
    return records


def main(argv) -> int:
    del argv
    from sharpi_jax.errors import SharpiError

    try:
        cfg = load_config(FLAGS.config)
        out = Path(FLAGS.out or Path("results") / f"{cfg['name']}.jsonl")
        records = run_sweep(cfg, out, log=(lambda *_: None) if FLAGS.quiet else print)
    except SharpiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(records)} records to {out}")
    return 0


if __name__ == "__main__":
    app.run(main)
