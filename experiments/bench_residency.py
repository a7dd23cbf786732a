r"""Expert residency: decode / prefill tokens/s, hit rate and bytes streamed per token vs budget and policy.

    python -m experiments.bench_residency --lookahead       # research model: policies x expert_lookahead, MTP off/on
    python -m experiments.bench_residency                     # 2-layer 35B-A3B-shaped model, vocab 4096
    python -m experiments.bench_residency --n_layer=4 --n_vocab=0 --budgets=0.1,0.25,0.5,0.75,1.0  # bigger
    python -m experiments.bench_residency --threshold_only    # host compute vs streaming

The default model is a synthetic 35B-A3B-shaped slice (--n_layer=2 trunk layers + MTP, real expert
shapes: 256 experts top-8, Q4_K) with zero-mean Q8_0 dense weights, so routing spreads like a real
router's (179 of 256 experts used over 128 random tokens, the top 10% taking 57% of the routing), and a
4096-token vocabulary (--n_vocab) so the 248k-token LM head does not dominate decode. Written once into
$SHARPI_CACHE/synthetic and reused. The default run (budgets 10 / 25 / 50% x policies frequency /
lru, 2 rounds of a 32-token prefill and 16 decode steps, no threshold microbenchmark) takes a few
minutes on a 2-core CPU, most of it compiling one engine per cell, and prints a line per record;
widen it with --budgets, --policies (static, slru), --repeats, --prompt_tokens / --prefill_buckets,
--threshold.

For each budget (expert_budget = `residency.budget_for_fraction`: that fraction of all routed experts
in slots, plus the top-k staging below 100%) the model is loaded once per policy; every engine is
warmed up (compilation excluded), then --repeats rounds each time every policy once (interleaved,
experiments.timing): a prefill of --prompt_tokens random ids and --decode_tokens decode steps (fed
from the same random stream) driven through the Runtime, reading the residency counters between the
phases. "frequency" (and the initial fill of lru/slru) use counts calibrated on a different random
prompt (saved beside --out). A first record with no budget (every expert resident, no residency
code) is the baseline. Records go to --out as JSONL, one line as each cell finishes (fields the
plotter reads: model, expert_budget_frac, expert_policy, hit_rate (decode phase), decode_tok_s,
prefill_tok_s, bytes_streamed_per_token (decode phase)); every float figure is the median of the
rounds with `_min` / `_max` beside it (and `_runs` for tokens/s); the figures go to --plot_dir.

--model=synthetic-qwen36-35b-a3b-4L-Q4_K (random Q4_K blocks everywhere) is a poor residency model:
the blocks have non-zero means, so every token's hidden state shares one direction and routing
collapses onto ~10 experts per layer (the run prints the spread it calibrated and warns); hit rates are
then trivially 1 for any calibrated policy.

--threshold: one MoE layer of the model with every expert cold, called on N rows (N = 2: the decode
bucket, one token), with cold="stream" (all misses staged and computed on the device) and with
cold="host" (computed in the callback from the mmap), alternating, --threshold_repeats times each after
a warm-up; the smallest N where streaming's median process CPU time is lower is the "auto" threshold
(`streaming.DEFAULT_STREAM_MIN_ROWS`). Timings only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from absl import app, flags

from experiments.cli import reports_bad_input
from experiments.timing import interleaved, line_buffered, put_spread

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Preset name or GGUF path (default: the synthetic model of --n_layer / --n_vocab).")
flags.DEFINE_integer("n_layer", 2, "Without --model: write/reuse a synthetic qwen36-35b-a3b-shaped model with this "
                     "many layers.", lower_bound=1)
flags.DEFINE_integer("n_vocab", 4096, "Without --model: the synthetic model's vocabulary (0: the real 248320; its "
                     "LM head then dominates decode).", lower_bound=0)
flags.DEFINE_string("qtype", "Q8_0", "Without --model: the synthetic model's block type (non-expert matrices).")
flags.DEFINE_string("expert_qtype", "Q4_K", "Without --model: the routed experts' block type.")
flags.DEFINE_list("budgets", ["0.1", "0.25", "0.5"], "Fractions of all routed expert bytes (1.0: every expert "
                  "resident, hit rate 1 under any policy).")
flags.DEFINE_list("policies", ["frequency", "lru"], "Placement policies: static, frequency, lru, slru (each one "
                  "more engine to compile per budget).")
flags.DEFINE_integer("prompt_tokens", 32, "Prompt length (prefill figure).")
flags.DEFINE_integer("decode_tokens", 16, "Greedy decode steps (decode figure).")
flags.DEFINE_integer("calib_tokens", 256, "Tokens of the calibration prompt (frequency counts).")
flags.DEFINE_integer("max_context", 512, "KV cache positions.")
flags.DEFINE_list("prefill_buckets", ["32"], "Prefill chunk sizes.")
flags.DEFINE_bool("baseline", True, "Also bench the model with no expert budget.")
flags.DEFINE_bool("threshold", False, "Also run the host-compute vs streaming microbenchmark (~1 minute more).")
flags.DEFINE_bool("threshold_only", False, "Only the host-compute vs streaming microbenchmark.")
flags.DEFINE_list("threshold_rows", ["2", "4", "8", "16", "32", "64"], "Bucket rows N for --threshold.")
flags.DEFINE_integer("repeats", 2, "Timed rounds per cell, interleaved over the policies of a budget (median and "
                     "min/max recorded).", lower_bound=1)
flags.DEFINE_integer("threshold_repeats", 3, "Timed calls per mode and N, alternating stream / host (median and "
                     "min/max recorded).", lower_bound=1)
flags.DEFINE_string("out", "results/residency.jsonl", "JSONL output (appended).")
flags.DEFINE_string("plot_dir", None, "Where the figures go (default: <out dir>/plots).")
flags.DEFINE_integer("seed", 0, "RNG seed of the prompts.")
flags.DEFINE_bool("lookahead", False, "The lookahead grid (experiments.residency_lookahead): --model (default "
                  "research) x budgets (default 0.25) x policies (default all) x --lookahead_modes, "
                  "MTP off and on; prints the 25%-budget verdict and next-layer recall per layer.")
flags.DEFINE_list("lookahead_modes", ["none", "next_layer", "pass", "both"], "expert_lookahead modes (--lookahead).")
flags.DEFINE_list("lookahead_buffers", ["0", "24"], "--lookahead: expert_lookahead_buffer sizes in experts (0: "
                  "none; > 0 only with next_layer / both; 24 = 3 x top-8, about a 4-row pass's predicted union).")
flags.DEFINE_integer("new_tokens", 24, "--lookahead: tokens generated per run.", lower_bound=2)
flags.DEFINE_integer("draft_tokens", 3, "--lookahead: MTP drafts per pass (k).", lower_bound=1)
flags.DEFINE_float("verdict_budget", 0.25, "--lookahead: the budget of the verdict line.")
LOOKAHEAD_BUDGETS = ("0.25",)  # the verdict's budget; --budgets=0.1,0.25,0.5,0.75 for the sweep
LOOKAHEAD_POLICIES = ("static", "frequency", "lru", "slru")


def _model_path() -> Path:
    from experiments.presets import cache_dir, resolve_model
    from sharpi_jax.config import shape_preset
    from sharpi_jax.testing import write_synthetic_gguf

    if FLAGS.model is not None:
        return resolve_model(FLAGS.model)
    vocab = f"-V{FLAGS.n_vocab}" if FLAGS.n_vocab else ""
    eq = f"-E{FLAGS.expert_qtype}" if FLAGS.expert_qtype != FLAGS.qtype else ""
    p = cache_dir() / "synthetic" / f"synthetic-qwen36-35b-a3b-{FLAGS.n_layer}L{vocab}-{FLAGS.qtype}{eq}-seed0.gguf"
    if not p.exists():
        c = shape_preset("qwen36-35b-a3b", FLAGS.n_layer)
        if FLAGS.n_vocab:
            c = c.replace(n_vocab=FLAGS.n_vocab)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".partial")
        print(f"writing {p} (once; reused after) ...", flush=True)
        write_synthetic_gguf(tmp, c, qtype=FLAGS.qtype, expert_qtype=FLAGS.expert_qtype, seed=0, progress=True,
                             name=p.stem)
        tmp.rename(p)
    return p


def _run_phases(engine, prompt: list[int], n_decode: int) -> dict:
    """Prefill + decode steps through the Runtime, with residency counters between the phases.

    Decode feeds the continuation of the random prompt stream (prompt[i] for step i, cycling), not the
    argmax: a random model's greedy output repeats one token, which would flatter every cache."""
    rt = engine.runtime
    snap = engine.expert_counters
    state = rt.new_state()
    c0 = snap()
    t0 = time.perf_counter()
    _, logits, state = rt.prefill(state, prompt)
    logits.block_until_ready()
    t1 = time.perf_counter()
    c1 = snap()
    pos = len(prompt)
    for i in range(n_decode):
        tok = prompt[(7 * i + 3) % len(prompt)]
        logits, _, state = rt.decode_step(state, tok, pos)
        pos += 1
    logits.block_until_ready()
    t2 = time.perf_counter()
    c2 = snap()
    out = {"prefill_tok_s": len(prompt) / (t1 - t0), "decode_tok_s": n_decode / (t2 - t1) if n_decode else 0.0,
           "prefill_s": t1 - t0, "decode_s": t2 - t1}
    if engine.residency is not None:
        pre, dec = engine.residency.stats(c0, c1), engine.residency.stats(c1, c2)
        out.update(hit_rate=dec["hit_rate"], prefill_hit_rate=pre["hit_rate"],
                   bytes_streamed_per_token=dec["bytes_streamed_per_token"],
                   prefill_bytes_streamed_per_token=pre["bytes_streamed_per_token"],
                   callback_ms_per_token=1e3 * dec["callback_s"] / max(1, dec["tokens"]),
                   prefill_callback_s=pre["callback_s"],
                   experts_evicted=dec["experts_evicted"] + pre["experts_evicted"],
                   host_computed_experts=dec["experts_host_computed"] + pre["experts_host_computed"],
                   hit_rate_per_layer=dec["hit_rate_per_layer"], all_hot_batches=dec["all_hot_batches"],
                   resident_bytes=pre["resident_bytes"], staging_bytes=pre["staging_bytes"],
                   budget_bytes=pre["budget_bytes"], counts_source=pre["counts_source"], cold=pre["cold"])
    return out


def bench_grid(path: Path, emit) -> list[dict]:
    import sharpi_jax as sj
    from experiments.presets import release_compiled_code
    from sharpi_jax.experts import residency

    rng = np.random.default_rng(FLAGS.seed)
    buckets = tuple(int(b) for b in FLAGS.prefill_buckets)
    opts = dict(max_context=FLAGS.max_context, prefill_buckets=buckets)
    records = []
    t = time.perf_counter()
    calib = sj.load(path, expert_budget=None, **opts)
    print(f"loaded {path.name} in {time.perf_counter() - t:.1f}s: {calib.config.summary()}", flush=True)
    V = calib.config.n_vocab
    prompt = [int(i) for i in rng.integers(0, V, FLAGS.prompt_tokens)]
    calib_ids = [int(i) for i in rng.integers(0, V, FLAGS.calib_tokens)]
    f, c = calib.gguf, calib.config
    total = residency.budget_for_fraction(f, c, 1.0)
    base = dict(model=path.stem, prompt_tokens=len(prompt), decode_tokens=FLAGS.decode_tokens)
    repeats = FLAGS.repeats

    def measure(cells: list[tuple[dict, object]]) -> None:
        """Warm every (record fields, engine) cell up, time `repeats` interleaved rounds over them, and
        emit one record per cell: every figure the median of the rounds, with _min / _max (and _runs for
        tokens/s; experiments.timing); the rest (budget, bytes) from the first round."""
        def warm(cell):
            t = time.perf_counter()
            _run_phases(cell[1], prompt[:8], 2)  # compile (prefill bucket, decode)
            cell[0]["warmup_s"] = time.perf_counter() - t

        results = interleaved(cells, lambda cell: _run_phases(cell[1], prompt, FLAGS.decode_tokens), repeats,
                              warm=warm, log=lambda m: print(m, flush=True), what="engines")
        for (fields, _), runs in zip(cells, results):
            r = dict(base, repeats=repeats, **fields, **runs[0])
            for key, first in runs[0].items():
                if isinstance(first, float):
                    put_spread(r, key, [x[key] for x in runs], runs=key.endswith("_tok_s"))
            records.append(r)
            emit(r)

    t_grid = time.perf_counter()
    if FLAGS.baseline:
        measure([(dict(expert_policy="none", expert_budget_frac=None), calib)])
    del calib
    release_compiled_code()
    counts = None
    if any(p != "static" for p in FLAGS.policies):  # static pins experts 0..n-1: no counts needed
        # Calibration: a full-budget engine counts routing on a different prompt; saved beside the results
        # (never beside the model: that may be the package's own default model).
        out = Path(FLAGS.out)
        cal = sj.load(path, expert_budget=total, expert_policy="static", **opts)
        counts = cal.calibrate_experts([calib_ids],
                                       save=out.with_name(f"{out.stem}.{path.stem}.expert-counts.json"))
        del cal
        release_compiled_code()
        used = {i: int((np.asarray(v) > 0).sum()) for i, v in counts.items()}
        print(f"calibration: distinct experts per layer over {len(calib_ids)} tokens: {used}", flush=True)
        if min(used.values()) < 4 * c.n_expert_used:
            print("warning: routing is collapsed onto a few experts (random Q4_K blocks have non-zero means, so "
                  "every token's hidden state shares one direction); use the default synthetic model (no --model: "
                  "zero-mean Q8_0 dense weights, Q4_K experts)", flush=True)
    fracs = [float(b) for b in FLAGS.budgets]
    for bi, frac in enumerate(fracs):
        # One budget at a time (memory), its policies interleaved round by round.
        budget = residency.budget_for_fraction(f, c, frac)
        cells = []
        for policy in FLAGS.policies:
            t = time.perf_counter()
            e = sj.load(path, expert_budget=budget, expert_policy=policy,
                        expert_counts=None if policy == "static" else counts, **opts)
            cells.append((dict(expert_policy=policy, expert_budget_frac=frac, expert_budget=budget,
                               load_s=time.perf_counter() - t), e))
        measure(cells)
        for r in records[-len(cells):]:
            assert r["resident_bytes"] + r["staging_bytes"] <= budget or frac >= 1.0
        del cells, e
        release_compiled_code()
        print(f"  budget {frac:g} done ({bi + 1}/{len(fracs)} budgets, {time.perf_counter() - t_grid:.0f}s)",
              flush=True)
    return records


def _print(r: dict) -> None:
    if "expert_policy" not in r:
        print(json.dumps(r), flush=True)
        return
    keys = ("expert_policy", "expert_budget_frac", "hit_rate", "prefill_hit_rate", "decode_tok_s", "prefill_tok_s",
            "bytes_streamed_per_token", "prefill_bytes_streamed_per_token", "callback_ms_per_token")
    print(json.dumps({k: (round(r[k], 4) if isinstance(r.get(k), float) else r.get(k)) for k in keys}), flush=True)


def bench_threshold(path: Path, emit) -> list[dict]:
    """One layer, every expert cold: streaming vs host compute per bucket size N."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sharpi_jax.config import RunConfig
    from sharpi_jax.gguf import GGUFFile, read_model_config
    from sharpi_jax.experts import residency
    from sharpi_jax.model.moe import route

    f = GGUFFile(path)
    c = read_model_config(f)
    E, k = c.n_expert, c.n_expert_used
    geo = residency.layer_geometry(f, c)
    bpe = max(b for _, b in geo.values())
    rng = np.random.default_rng(FLAGS.seed)
    records = []
    t_start = time.perf_counter()

    def layer_fn(cold: str, staging: int):
        # Zero slots: the budget is exactly the staging, so every expert of a batch is cold.
        res = residency.configure(f, c, residency.ExpertResidency(staging * bpe, "static", staging=staging,
                                                                  cold=cold, prefetch=0))
        graphdef, state = nnx.split(res.experts_module(0, RunConfig(expert_mode="grouped"), {}))

        def call(state, u, sel, w, valid):
            m = nnx.merge(graphdef, state)
            out = m(u, sel, w, valid)
            return out, nnx.state(m)

        return jax.jit(call), state

    for n in (int(x) for x in FLAGS.threshold_rows):
        u = jnp.asarray(rng.standard_normal((n, c.d_model)).astype(np.float32))
        sel, w = route(jnp.asarray(rng.standard_normal((n, E)).astype(np.float32)), k)
        n_valid = 1 if n == 2 else n  # N = 2 is the decode bucket: one token + an inert padding row
        valid = jnp.arange(n) < n_valid
        sel = jnp.where(valid[:, None], sel, sel[:1])
        w = jnp.where(valid[:, None], w, 0.0)
        unique = int(np.unique(np.asarray(sel)).size)
        row = {"N": n, "valid_rows": n_valid, "unique_experts": unique}
        fns = {}
        for cold in ("stream", "host"):
            # Staging sized to this batch's misses (streaming cost follows the staging size, not the misses).
            fns[cold] = list(layer_fn(cold, max(k, unique)))

        def call(cold):
            fn, st = fns[cold]
            t, tc = time.perf_counter(), time.process_time()
            out, fns[cold][1] = fn(st, u, sel, w, valid)
            out.block_until_ready()
            return time.perf_counter() - t, time.process_time() - tc, out

        # Warm-up (compile) each mode, then alternating timed calls stream, host, stream, ...
        runs = dict(zip(("stream", "host"), interleaved(["stream", "host"], call, FLAGS.threshold_repeats,
                                                         log=lambda m: None)))
        outs = {}
        for cold, rs in runs.items():
            put_spread(row, f"{cold}_ms", [1e3 * x[0] for x in rs], runs=False)
            put_spread(row, f"{cold}_cpu_ms", [1e3 * x[1] for x in rs], runs=False)
            outs[cold] = np.asarray(rs[-1][2])
        del fns
        row["bitwise_equal"] = bool(np.array_equal(outs["stream"], outs["host"]))
        # Process CPU time (median) decides (the machine is shared: wall time is noisy); both are recorded.
        row["faster"] = "stream" if row["stream_cpu_ms"] < row["host_cpu_ms"] else "host"
        records.append(dict(row, model=path.stem, bench="residency_threshold"))
        emit(records[-1])
    faster = [r["N"] for r in records if r["faster"] == "stream"]
    print(f"streaming is faster from N = {min(faster) if faster else 'never (in the range measured)'}", flush=True)
    print(f"  threshold done in {time.perf_counter() - t_start:.0f}s", flush=True)
    return records


def _lookahead(emit, out: Path) -> int:
    """--lookahead: the grid of `experiments.residency_lookahead`, its figure, verdict and summary."""
    from experiments import residency_lookahead as la
    from experiments.presets import resolve_model

    path = Path(resolve_model(FLAGS.model or "research"))
    budgets = FLAGS.budgets if FLAGS["budgets"].present else LOOKAHEAD_BUDGETS
    policies = FLAGS.policies if FLAGS["policies"].present else LOOKAHEAD_POLICIES
    t = time.perf_counter()
    records = la.run_grid(path, [float(b) for b in budgets], list(policies), list(FLAGS.lookahead_modes),
                          prompt_tokens=FLAGS.prompt_tokens, new_tokens=FLAGS.new_tokens,
                          draft_tokens=FLAGS.draft_tokens, repeats=FLAGS.repeats, max_context=FLAGS.max_context,
                          emit=lambda r: _emit_quiet(out, r), buffers=[int(b) for b in FLAGS.lookahead_buffers],
                          counts_out=out.with_name(f"{out.stem}.{path.stem}.expert-counts.json"))
    la.summary(records)
    print(f"wrote {len(records) + 1} records to {out}")
    print(f"wrote {la.plot(records, Path(FLAGS.plot_dir or out.parent / 'plots') / 'residency_lookahead.png')}")
    print(la.verdict(records, FLAGS.verdict_budget, mtp=False))
    print(la.verdict(records, FLAGS.verdict_budget))
    print(f"grid done in {time.perf_counter() - t:.0f}s")
    return 0


def _emit_quiet(out: Path, r: dict) -> None:
    with out.open("a") as fh:
        fh.write(json.dumps(r) + "\n")


@reports_bad_input
def main(argv) -> int:
    del argv
    line_buffered()
    from experiments.plot import plot_all
    path = None if FLAGS.lookahead else _model_path()
    records = []
    out = Path(FLAGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def emit(r: dict) -> None:  # one line per record as it comes (a long run keeps what it measured)
        _print(r)
        with out.open("a") as fh:
            fh.write(json.dumps(r) + "\n")

    if FLAGS.lookahead:
        return _lookahead(emit, out)
    if FLAGS.threshold or FLAGS.threshold_only:
        records += bench_threshold(path, emit)
    if not FLAGS.threshold_only:
        records += bench_grid(path, emit)
    print(f"wrote {len(records)} records to {out}")
    grid = [r for r in records if "expert_budget_frac" in r]
    if grid:
        for p in plot_all(grid, Path(FLAGS.plot_dir or out.parent / "plots")):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    app.run(main)
