"""Run a grid of generation experiments from a JSON config; one JSONL record per (model, point, prompt).

    python -m experiments.sweep --config=configs/sweeps/mtp_draft_tokens.json [--out=results/x.jsonl]

Config keys: `name`, `models` (preset names from configs/models.json or GGUF paths), `prompts` (a list
of strings, or "fixtures" for the reference prompts, or "python" for built-in Python snippets),
`max_new_tokens`, `repeats`, `load` (options for sj.load shared by all points), `calibrate` (optional,
{"prompts": ...}: routing counts for expert_policy="frequency", taken on these prompts and saved beside
the results), and `grid`: a dict of option -> list of values. Options that `sj.load` takes
(max_context, expert_budget, expert_budget_frac, expert_policy, expert_mode, ...) reload the model;
the rest go to `engine.generate`. expert_budget is bytes or a string ("8GiB", "25%");
expert_budget_frac is a share of all routed-expert bytes (0.25). Points that differ only in options a
mode ignores (draft_tokens without speculation) are run once. `batch` (or --batch): B > 1 runs a point's
prompts B at a time as one `engine.generate_batch` (one device loop; each sequence's tokens and pass
stats are those of generating it alone), so a cell is a group of prompts; not with an expert budget, KV
eviction, loop="host" or verify="sequential" (refused when the sweep starts).

Timing (experiments.timing): every cell (model, point, prompt) first runs once unrecorded (compilation
excluded), then `repeats` rounds (--repeats, else the config's, else 3) run every cell once each, in
the same order (A B C, A B C, ...), so machine load drifts hit all cells alike. Models under 2 GiB
hold all their load groups at once and interleave over every point ("interleave": "auto" | "all" |
"load" in the config; "load" interleaves within one load group at a time, for big models).

Each record: the sweep name, model, point options, prompt index, `repeats`, and the generation stats
flattened (decode_tok_s, prefill_tok_s, acceptance, expert reads, ...). Every timing field is the
median over the rounds with `<field>_min` / `<field>_max` beside it, and `<field>_runs` (the per-round
values) for the tokens/s fields; other numbers that vary between rounds (an lru hit rate) get the same
treatment. With batch > 1 a record also holds `batch` (its group's size) and `batch_decode_tok_s`, and
its `decode_tok_s` is its group's: all the group's tokens over the group's decode seconds. `python -m
experiments.plot` draws the standard figures from them, with the spread as error bars.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any, Iterator

from absl import app, flags

from experiments import batches
from experiments.cli import reports_bad_input
from experiments.presets import PYTHON_PROMPTS
from experiments.timing import fmt_spread, interleaved, line_buffered, put_spread

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "Sweep config (JSON).", required=True)
flags.DEFINE_string("out", None, "Output JSONL (default: results/<name>.jsonl).")
flags.DEFINE_bool("quiet", False, "No progress lines.")
flags.DEFINE_integer("repeats", None, "Timed rounds per cell, interleaved (default: the config's `repeats`, else 3).",
                     lower_bound=1)
flags.DEFINE_integer("batch", None, "Prompts per generate_batch call (default: the config's `batch`, else 1: one "
                     "generate per prompt).", lower_bound=1)

LOAD_OPTIONS = frozenset({"max_context", "expert_budget", "expert_budget_frac", "expert_policy", "expert_mode",
                          "prefill_buckets", "row_kernel", "gdn_chunk"})
# Options that only matter with speculation: collapsed for speculative = None.
SPECULATIVE_ONLY = ("draft_tokens", "verify", "tree_nodes", "max_snapshot_bytes")
TREE_ONLY = ("tree_nodes", "max_snapshot_bytes")  # collapsed for speculative = "mtp" (the chain)
DEFAULT_REPEATS = 3


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
    b = cfg.get("batch", 1)
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise InputError(f"sweep config {path}: 'batch' must be an integer >= 1, got {b!r}")
    return cfg


# What one generate_batch call cannot run (Engine.generate_batch refuses them): checked before any load.
BATCH_REFUSED_LOAD = ("expert_budget", "expert_budget_frac", "expert_parallel", "kv_policy")


def check_batch(cfg: dict[str, Any], points: list[dict[str, Any]], batch: int) -> None:
    """With batch > 1, an InputError naming the first option a batch cannot run (an expert budget,
    expert parallelism, KV eviction, the host loop, sequential verify), before anything is loaded."""
    if batch == 1:
        return
    from sharpi_jax import GenerateOptions
    from sharpi_jax.errors import InputError

    for opts in [cfg.get("load", {})] + points:
        bad = [k for k in BATCH_REFUSED_LOAD if opts.get(k) is not None]
        run = GenerateOptions.from_keywords(**{k: opts[k] for k in ("speculative", "verify", "loop") if k in opts})
        if not run.device_loop:  # the rule generate_batch refuses by
            bad.append("loop='host'" if run.loop != "device" else "verify='sequential'")
        if bad:
            raise InputError(f"sweep {cfg['name']}: batch={batch} runs generate_batch, which cannot run {bad[0]} "
                             f"(in {json.dumps(opts, sort_keys=True)}); use batch=1 for such points")


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
        if point.get("speculative") == "mtp":
            for k in TREE_ONLY:
                point.pop(k, None)
        if point.get("speculative") == "mtp_tree" and point.get("tree_nodes", 8) < point.get("draft_tokens", 3):
            continue  # a tree smaller than its depth: not a valid point
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


def _is_timing(key: str) -> bool:
    return key.endswith("_s")  # seconds and tokens/s: decode_tok_s, prefill_s, draft_s, experts.callback_s, ...


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from the flattened stats of a cell's timed repeats: every timing field (`*_s`, which
    includes `*_tok_s`) becomes the median with `_min` / `_max` beside it (and `_runs`, the per-round
    values, for `*_tok_s`); any other number that varies between repeats (an lru hit rate) likewise;
    everything else (tokens, acceptance: deterministic) is taken as is from the first repeat."""
    rec = dict(runs[0])
    for key, first in runs[0].items():
        if isinstance(first, bool) or not isinstance(first, (int, float)):
            continue
        vals = [r.get(key) for r in runs]
        if any(not isinstance(v, (int, float)) for v in vals):
            continue
        if _is_timing(key) or len(set(vals)) > 1:
            put_spread(rec, key, vals, runs=key.endswith("_tok_s"))
    return rec


def _interleave_mode(cfg: dict[str, Any], path: Path) -> str:
    """"all": every load group of a model is loaded at once and the rounds cycle over all its points;
    "load": one load group at a time (big models whose engines do not fit in memory together).
    "auto" (default): "all" for files under 2 GiB."""
    mode = cfg.get("interleave", "auto")
    if mode not in ("auto", "all", "load"):
        from sharpi_jax.errors import InputError

        raise InputError(f"sweep config {cfg['name']}: 'interleave' must be 'auto', 'all' or 'load', got {mode!r}")
    if mode == "auto":
        mode = "all" if path.stat().st_size < 2 << 30 else "load"
    return mode


def run_sweep(cfg: dict[str, Any], out_path: Path, log=print, repeats: int | None = None,
              batch: int | None = None) -> list[dict[str, Any]]:
    """Run every (model, load options, point, prompt group of `batch`, default the config's, else 1): one
    unrecorded warm-up run each, then `repeats` (default: the config's, else 3) interleaved rounds over
    all of them; write one record per (model, point, prompt) with the median and min/max of every timing
    (`aggregate`) to out_path; return them."""
    import sharpi_jax as sj
    from experiments.presets import release_compiled_code, resolve_model

    prompts = resolve_prompts(cfg.get("prompts"))
    repeats = int(repeats if repeats is not None else cfg.get("repeats", DEFAULT_REPEATS))
    if repeats < 1:
        from sharpi_jax.errors import InputError

        raise InputError(f"repeats must be >= 1, got {repeats}")
    max_new = int(cfg.get("max_new_tokens", 32))
    points = list(grid_points(cfg["grid"]))
    batch = int(batch if batch is not None else cfg.get("batch", 1))
    check_batch(cfg, points, batch)
    groups = [tuple(g) for g in batches.groups(len(prompts), batch)]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    records = []
    t0 = time.perf_counter()
    with out_path.open("a") as out:
        for model_name in cfg["models"]:
            path = resolve_model(model_name)
            counts_path = _calibrate(cfg, model_name, path, out_path, log)
            by_load: dict[str, list[dict]] = {}
            for p in points:
                load_opts = {k: v for k, v in p.items() if k in LOAD_OPTIONS}
                by_load.setdefault(json.dumps(load_opts, sort_keys=True), []).append(p)
            mode = _interleave_mode(cfg, path)
            held = [list(by_load)] if mode == "all" else [[k] for k in by_load]
            for load_keys in held:
                engines = {}
                for load_key in load_keys:
                    load_opts = {**cfg.get("load", {}), **json.loads(load_key)}
                    frac = load_opts.pop("expert_budget_frac", None)
                    if frac is not None:  # a share of all routed-expert bytes (residency.parse_expert_budget)
                        load_opts["expert_budget"] = f"{100 * float(frac)}%"
                    if counts_path is not None and load_opts.get("expert_budget") is not None:
                        load_opts.setdefault("expert_counts", str(counts_path))
                    engines[load_key] = sj.load(path, **load_opts)
                cells = [(load_key, point, group) for load_key in load_keys for point in by_load[load_key]
                         for group in groups]
                log(f"{model_name}: {len(cells)} cells ({len(load_keys)} load groups x points x {len(groups)} "
                    f"{'prompts' if batch == 1 else f'groups of {batch} prompts'}), warm-up + {repeats} "
                    "interleaved rounds")

                def run(cell) -> list[dict[str, Any]]:
                    """The flattened stats of each prompt of the cell's group."""
                    load_key, point, group = cell
                    gen_opts = {k: v for k, v in point.items() if k not in LOAD_OPTIONS}
                    eng = engines[load_key]
                    if batch == 1:
                        return [_flatten(eng.generate(prompts[group[0]], max_new_tokens=max_new,
                                                      **gen_opts).stats.to_dict())]
                    outs = eng.generate_batch([prompts[i] for i in group], max_new_tokens=max_new, **gen_opts)
                    # The group's decode is shared: its tokens/s is the batch's (all sequences' tokens).
                    return [{**_flatten(o.stats.to_dict()), "decode_tok_s": o.stats.batch.decode_tok_s}
                            for o in outs]

                results = interleaved(cells, run, repeats, log=log, what="cells")
                per_prompt = [(point, pi, [r[j] for r in runs])
                              for (_, point, group), runs in zip(cells, results) for j, pi in enumerate(group)]
                for point, pi, runs in per_prompt:
                    rec = {"sweep": cfg["name"], "model": model_name, **point, "prompt": pi, "repeats": repeats,
                           "time": time.time(), **aggregate(runs)}
                    if "experts.hit_rate" in rec:  # the residency figure's y (experiments.plot)
                        for suffix in ("", "_min", "_max"):
                            if f"experts.hit_rate{suffix}" in rec:
                                rec[f"hit_rate{suffix}"] = rec[f"experts.hit_rate{suffix}"]
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                    records.append(rec)
                    log(f"{model_name} {point} prompt {pi}: {fmt_spread(rec['decode_tok_s_runs'])} decode tok/s "
                        "(median [min-max])")
                del engines
                release_compiled_code()
    log(f"{len(records)} records in {time.perf_counter() - t0:.0f}s")
    return records


@reports_bad_input
def main(argv) -> int:
    del argv
    line_buffered()
    cfg = load_config(FLAGS.config)
    out = Path(FLAGS.out or Path("results") / f"{cfg['name']}.jsonl")
    records = run_sweep(cfg, out, log=(lambda *_: None) if FLAGS.quiet else (lambda m: print(m, flush=True)),
                        repeats=FLAGS.repeats, batch=FLAGS.batch)
    print(f"wrote {len(records)} records to {out}")
    return 0


if __name__ == "__main__":
    app.run(main)
