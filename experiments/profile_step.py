"""Where one decode step (or one w-row verify pass, or one prefill chunk) spends its time: a JAX profiler
trace of warm steps, each XLA op's self time (its own duration less the ops nested in it, e.g. a while
loop's body), grouped as ggml products (by the product: activation rows x weight rows), ggml routed
experts, and the rest of XLA's ops by kind; beside the step's wall time, so the time in no op (dispatch,
gaps between ops, waiting for the op's threads) shows as the remainder; and the process's minor page
faults and system CPU per step (a buffer XLA allocates afresh each step is faulted in page by page). Ops
that XLA runs concurrently overlap, so their self times may add up to more than the wall time. Finds what
costs more than its bytes.

    python -m experiments.profile_step --model=/work/twin/twin-research-40L-Q4_K_M.gguf --rows=1

`--generate=N` profiles whole device-loop generations of N tokens instead (engine.generate, loop="device";
MTP off or the chain with --draft_tokens / --draft_vocab / --verify_head): everything a pass costs in the
loop (its draft, its commit, the snapshot writes), per decode step or per verify pass, so MTP off and a
chain compare op by op:

    python -m experiments.profile_step --model=TWIN --generate=24 --speculative=mtp --draft_vocab=2048

The trace's op events come from XLA's CPU thunk executor (one per executed op, named by the HLO
instruction); an ffi_call is named by its target through the compiled module's HLO text.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import resource
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.cli import fail, reports_bad_input
from experiments.pass_timing import loop_pass, row_tokens
from experiments.presets import resolve_model
from experiments.timing import spread
from sharpi_jax.runtime.state import repeat_as_snapshots
from sharpi_jax.runtime.steps import prefill_plan

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "default", "Preset name (configs/models.json), 'default' or a GGUF path.")
flags.DEFINE_integer("prompt_tokens", 32, "Prompt prefilled before the profiled steps.")
flags.DEFINE_integer("rows", 1, "1: profile decode steps; w >= 2: trunk verify passes of w rows (chain), "
                     "as the MTP loop runs them (commit_verify).")
flags.DEFINE_integer("prefill", 0, "N > 0: profile prefills of N prompt tokens (one bucketed chunk, the "
                     "chunked GDN form) instead of steps; --rows is then ignored.")
flags.DEFINE_integer("steps", 5, "Profiled steps (after 3 warm ones); with --generate, profiled generations "
                     "(after one warm one).")
flags.DEFINE_integer("generate", 0, "N > 0: profile whole device-loop generations of N tokens from the "
                     "prompt, per decode step or verify pass, instead of single steps.")
flags.DEFINE_enum("speculative", "off", ["off", "mtp"], "With --generate: MTP off or the MTP chain.")
flags.DEFINE_integer("draft_tokens", 1, "With --generate --speculative=mtp: the chain's drafts per pass.")
flags.DEFINE_integer("draft_vocab", 0, "With --generate --speculative=mtp: the draft vocabulary (0: full).")
flags.DEFINE_enum("verify_head", "auto", ["auto", "lazy", "full"], "RunConfig.verify_head of the engine.")
flags.DEFINE_integer("max_context", 256, "KV cache positions.")
flags.DEFINE_integer("top", 25, "Rows of the op table.")
flags.DEFINE_string("json_out", None, "Also write the table as JSON here.")

_SHAPE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^)]*\)|[a-z0-9]+\[[\d,]*\]\S*)\s+custom-call\((.*)$")


def ffi_names(hlo_text: str) -> dict[str, str]:
    """ffi_call op name -> 'ggml matmul [M x N]' / 'ggml experts [...]' / 'gdn step [H x dv x dk]' / 'gdn rows
    [T x H x dv x dk]' from the compiled module's HLO text (a result tuple: its first array's shape)."""
    out = {}
    for line in hlo_text.splitlines():
        m = _SHAPE.match(line)
        if not m:
            continue
        name, shape, rest = m.groups()
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        target = target.group(1) if target else "?"
        first = re.search(r"\[([\d,]*)\]", shape)
        dims = " x ".join(d for d in (first.group(1) if first else "").split(",") if d)
        if "matmul" in target:
            out[name] = f"ggml matmul [{dims}]"
        elif "expert" in target:
            out[name] = f"ggml experts [{dims}]"
        elif "gdn" in target:
            out[name] = f"{target.removeprefix('sharpi_').replace('_', ' ')} [{dims}]"
        else:
            out[name] = f"custom {target}"
    return out


def op_kind(name: str, ffi: dict[str, str]) -> str:
    """An HLO op's group: the ffi product it is, or its kind without the instance number."""
    if name in ffi:
        return ffi[name]
    return re.sub(r"[.\d]+$", "", name) or name


def self_times(events: list[dict]) -> list[tuple[str, float]]:
    """(op name, self time in us) of each op event: its duration less the events nested in it on the
    same thread."""
    by_tid = collections.defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    out = []
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, time of the events nested in it, duration]
        for e in evs:
            while stack and stack[-1][0] <= e["ts"] + 1e-3:
                _, name, child, dur = stack.pop()
                out.append((name, dur - child))
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], 0.0, e["dur"]])
        while stack:
            _, name, child, dur = stack.pop()
            out.append((name, dur - child))
    return out


def op_times(trace_dir: str, in_module, ffi: dict[str, str]) -> list[tuple[str, tuple[int, float]]]:
    """The profiler trace written to trace_dir, as (op group, (calls, self time in us)), largest first: the
    op events of the HLO modules whose name in_module(name) accepts, grouped by `op_kind`."""
    events = json.load(gzip.open(sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})
           and "dur" in e and in_module(e["args"].get("hlo_module", ""))]
    per_kind = collections.defaultdict(lambda: [0, 0.0])
    for name, t in self_times(ops):
        k = op_kind(name, ffi)
        per_kind[k][0] += 1
        per_kind[k][1] += t
    return sorted(((k, (c, t)) for k, (c, t) in per_kind.items()), key=lambda kv: -kv[1][1])


@reports_bad_input
def main(argv) -> int:
    del argv
    import sharpi_jax as sj

    if FLAGS.rows < 1 or FLAGS.steps < 1 or FLAGS.prompt_tokens < 1 or FLAGS.prefill < 0:
        return fail("--rows, --steps and --prompt_tokens must be at least 1, --prefill at least 0")
    if FLAGS.prompt_tokens + FLAGS.rows > FLAGS.max_context:
        return fail(f"--prompt_tokens + --rows ({FLAGS.prompt_tokens + FLAGS.rows}) exceed --max_context "
                    f"({FLAGS.max_context})")
    if FLAGS.generate < 0 or FLAGS.generate == 1:
        return fail("--generate must be 0 (single steps) or at least 2 tokens")
    if FLAGS.generate and FLAGS.prompt_tokens + FLAGS.generate > FLAGS.max_context:
        return fail(f"--prompt_tokens + --generate ({FLAGS.prompt_tokens + FLAGS.generate}) exceed --max_context "
                    f"({FLAGS.max_context})")
    if FLAGS.generate:
        # The loop's ffi_calls are named from its compiled HLO, which only XLA's dump gives for a loop
        # jitted inside the engine: set before the backend starts (the first computation, in load).
        dump = tempfile.mkdtemp(prefix="profile_step_hlo_")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} "
                                   "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=^jit_run$").strip()
    try:
        path = resolve_model(FLAGS.model)
        engine = sj.load(path, max_context=FLAGS.max_context, verify_head=FLAGS.verify_head)
    except (ValueError, OSError) as e:
        return fail(e)
    if FLAGS.generate:
        try:
            return profile_generation(engine, path, dump)
        finally:
            shutil.rmtree(dump, ignore_errors=True)
    rt = engine.runtime
    ids = list(range(100, 100 + FLAGS.prompt_tokens))
    _, _, state = rt.prefill(rt.new_state(), ids)
    P, w = len(ids), FLAGS.rows
    if FLAGS.prefill:
        n = FLAGS.prefill
        if P + n > FLAGS.max_context:
            return fail(f"--prompt_tokens + --prefill ({P + n}) exceed --max_context ({FLAGS.max_context})")
        plan = prefill_plan(n, rt.prefill_buckets)
        if len(plan) != 1:
            return fail(f"--prefill={n} is {len(plan)} chunks (buckets {rt.prefill_buckets}); pick a bucket size")
        B = plan[0][0]
        toks = np.zeros(B, np.int32)
        toks[:n] = [(100 + 7 * i) % 1000 + 10 for i in range(n)]
        fn = rt._fns.prefill
        args = (rt.params, rt.cache, state, toks, np.int32(P), np.int32(n))
        def step(s):  # the same rows at the same positions each time, from the previous call's state
            out, rt.cache = fn(rt.params, rt.cache, s, toks, np.int32(P), np.int32(n))
            return out.state
        module = "prefill"
        w = n
    elif w == 1:
        fn = rt._fns.decode
        step = lambda s: rt.decode_step(s, ids[-1], P)[2]  # noqa: E731
        args = (rt.params, rt.cache, state, np.int32(ids[-1]), np.int32(P))
        module = "decode"
    else:
        toks = jnp.asarray(row_tokens(ids, w))
        state = (state, repeat_as_snapshots(state, w))
        step = loop_pass(rt, toks, P)  # the MTP loop's trunk pass
        fn = rt._fns.commit_verify
        args = (rt.params, rt.cache, state[0], state[1], np.int32(0), toks, np.int32(P), np.int32(w))
        module = "commit_verify"
    ffi = ffi_names(fn.lower(*args).compile().as_text())  # before the steps donate `state`
    for _ in range(3):
        state = step(state)
    jax.block_until_ready(state)
    walls = []
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(FLAGS.steps):
            t0 = time.perf_counter()
            state = step(state)
            jax.block_until_ready(state)
            walls.append(1e3 * (time.perf_counter() - t0))
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        jax.profiler.stop_trace()
        rows = op_times(tmp, lambda m: module in m, ffi)
    n = FLAGS.steps
    sp = spread(walls)
    wall = sp["median"]
    total = sum(t for _, (_, t) in rows) / n / 1e3
    what = (f"prefill of {w} rows" if FLAGS.prefill else "decode step" if w == 1 else f"verify pass of {w} rows")
    print(f"{path.name}: {what}, median wall {wall:.2f} ms "
          f"[{sp['min']:.2f}-{sp['max']:.2f}] over {n} steps (profiled)")
    faults = (r1.ru_minflt - r0.ru_minflt) / n
    print(f"process per step: {faults:.0f} minor page faults (fresh pages of new buffers), "
          f"{1e3 * (r1.ru_stime - r0.ru_stime) / n:.1f} ms system CPU, {1e3 * (r1.ru_utime - r0.ru_utime) / n:.1f} ms user CPU")
    print(f"ops executed per step: {sum(c for _, (c, _) in rows) / n:.0f}; their self time "
          f"{total:.2f} ms; wall less that: {wall - total:.2f} ms")
    print(f"{'ms/step':>8} {'%wall':>6} {'calls':>6}  op")
    table = []
    for k, (c, t) in rows[:FLAGS.top]:
        ms = t / n / 1e3
        table.append({"op": k, "ms": ms, "calls": c / n})
        print(f"{ms:8.2f} {100 * ms / wall:6.1f} {c / n:6.0f}  {k}")
    rest = sum(v[1] for _, v in rows[FLAGS.top:]) / n / 1e3
    print(f"{rest:8.2f} {100 * rest / wall:6.1f} {'':>6}  ({len(rows) - FLAGS.top} more kinds)"
          if len(rows) > FLAGS.top else "")
    if FLAGS.json_out:
        Path(FLAGS.json_out).write_text(json.dumps({"model": str(path), "rows": w, "prefill": bool(FLAGS.prefill),
                                                    "wall_ms": walls, "ops_ms": total, "minor_faults": faults, "table": table},
                                                   indent=1))
    return 0


def profile_generation(engine, path: Path, dump: str) -> int:
    """--generate: the self time of every op of the device loop over whole generations, per step / pass."""
    ids = list(range(100, 100 + FLAGS.prompt_tokens))
    n = FLAGS.generate
    kw = dict(loop="device", max_new_tokens=n, stop_on_eos=False)
    if FLAGS.speculative == "mtp":
        kw.update(speculative="mtp", draft_tokens=FLAGS.draft_tokens, verify="batched",
                  draft_vocab=FLAGS.draft_vocab or None)
    try:
        engine.generate(ids, **kw)  # compiles; the next ones run warm
    except ValueError as e:
        return fail(e)
    ffi: dict[str, str] = {}
    for f in glob.glob(f"{dump}/*jit_run*after_optimizations.txt"):
        ffi.update(ffi_names(Path(f).read_text()))
    if not ffi:
        return fail(f"XLA wrote no HLO of the loop to {dump} (XLA_FLAGS must take effect before JAX starts)")
    walls, passes = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(FLAGS.steps):
            t0 = time.perf_counter()
            out = engine.generate(ids, **kw)
            walls.append(1e3 * (time.perf_counter() - t0))
            spec = out.stats.speculation
            # MTP off: the prefill gives the first token, the loop's steps the others
            passes += spec.verify_passes if spec else len(out.tokens) - 1
        jax.profiler.stop_trace()
        rows = op_times(tmp, lambda m: m == "jit_run", ffi)
    unit, units = ("verify pass", "verify passes") if FLAGS.speculative == "mtp" else ("decode step", "decode steps")
    total = sum(t for _, (_, t) in rows) / passes / 1e3
    sp = spread(walls)
    what = ("MTP off" if FLAGS.speculative == "off" else
            f"MTP chain k={FLAGS.draft_tokens}, draft_vocab {FLAGS.draft_vocab or 'full'}, verify head "
            f"{engine.runtime.verify_head_desc()}")
    print(f"{path.name}: device-loop generations of {n} tokens, {what}: median wall {sp['median']:.1f} ms "
          f"[{sp['min']:.1f}-{sp['max']:.1f}] over {FLAGS.steps} (profiled); {passes / FLAGS.steps:.1f} "
          f"{units} each, {(n - 1) * FLAGS.steps / passes:.2f} tokens per {unit} (the prefill's token aside)")
    print(f"the loop's ops per {unit}: self time {total:.2f} ms")
    print(f"{'ms/' + unit.split()[-1]:>8} {'calls':>6}  op")
    table = []
    for k, (c, t) in rows[:FLAGS.top]:
        ms = t / passes / 1e3
        table.append({"op": k, "ms": ms, "calls": c / passes})
        print(f"{ms:8.2f} {c / passes:6.1f}  {k}")
    rest = sum(v[1] for _, v in rows[FLAGS.top:]) / passes / 1e3
    if len(rows) > FLAGS.top:
        print(f"{rest:8.2f} {'':>6}  ({len(rows) - FLAGS.top} more kinds)")
    if FLAGS.json_out:
        Path(FLAGS.json_out).write_text(json.dumps({
            "model": str(path), "generate": n, "speculative": FLAGS.speculative, "draft_tokens": FLAGS.draft_tokens,
            "draft_vocab": FLAGS.draft_vocab, "verify_head": engine.runtime.verify_head_desc(), "wall_ms": walls,
            "passes": passes / FLAGS.steps, "unit": unit, "ops_ms": total, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    app.run(main)
