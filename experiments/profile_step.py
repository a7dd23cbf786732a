"""Where one decode step (or one w-row verify pass, or one prefill chunk) spends its time: a JAX profiler
trace of warm steps, each XLA op's self time (its own duration less the ops nested in it, e.g. a while
loop's body), grouped as ggml products (by the product: activation rows x weight rows), ggml routed
experts, and the rest of XLA's ops by kind; beside the step's wall time, so the time in no op (dispatch,
gaps between ops, waiting for the op's threads) shows as the remainder; and the process's minor page
faults and system CPU per step (a buffer XLA allocates afresh each step is faulted in page by page). Ops
that XLA runs concurrently overlap, so their self times may add up to more than the wall time. Finds what
costs more than its bytes.

    python -m experiments.profile_step --model=/work/twin/twin-research-40L-Q4_K_M.gguf --rows=1

The trace's op events come from XLA's CPU thunk executor (one per executed op, named by the HLO
instruction); an ffi_call is named by its target through the compiled module's HLO text.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import resource
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
flags.DEFINE_integer("steps", 5, "Profiled steps (after 3 warm ones).")
flags.DEFINE_integer("max_context", 256, "KV cache positions.")
flags.DEFINE_integer("top", 25, "Rows of the op table.")
flags.DEFINE_string("json_out", None, "Also write the table as JSON here.")

_SHAPE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*([a-z0-9]+)\[([\d,]*)\][^ ]*\s+custom-call\((.*)$")


def ffi_names(hlo_text: str) -> dict[str, str]:
    """ffi_call op name -> 'matmul N x M' / 'experts ...' from the compiled module's HLO text."""
    out = {}
    for line in hlo_text.splitlines():
        m = _SHAPE.match(line)
        if not m:
            continue
        name, _, dims, rest = m.groups()
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        target = target.group(1) if target else "?"
        dims = [int(d) for d in dims.split(",") if d]
        if "matmul" in target:
            out[name] = f"ggml matmul [{' x '.join(map(str, dims))}]"
        elif "expert" in target:
            out[name] = f"ggml experts [{' x '.join(map(str, dims))}]"
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


@reports_bad_input
def main(argv) -> int:
    del argv
    import sharpi_jax as sj

    if FLAGS.rows < 1 or FLAGS.steps < 1 or FLAGS.prompt_tokens < 1 or FLAGS.prefill < 0:
        return fail("--rows, --steps and --prompt_tokens must be at least 1, --prefill at least 0")
    if FLAGS.prompt_tokens + FLAGS.rows > FLAGS.max_context:
        return fail(f"--prompt_tokens + --rows ({FLAGS.prompt_tokens + FLAGS.rows}) exceed --max_context "
                    f"({FLAGS.max_context})")
    try:
        path = resolve_model(FLAGS.model)
        engine = sj.load(path, max_context=FLAGS.max_context)
    except (ValueError, OSError) as e:
        return fail(e)
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
        trace = sorted(glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True))[-1]
        events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})
           and "dur" in e and module in e["args"].get("hlo_module", "")]
    per_kind = collections.defaultdict(lambda: [0, 0.0])
    for name, t in self_times(ops):
        k = op_kind(name, ffi)
        per_kind[k][0] += 1
        per_kind[k][1] += t
    n = FLAGS.steps
    sp = spread(walls)
    wall = sp["median"]
    total = sum(v[1] for v in per_kind.values()) / n / 1e3
    rows = sorted(per_kind.items(), key=lambda kv: -kv[1][1])
    what = (f"prefill of {w} rows" if FLAGS.prefill else "decode step" if w == 1 else f"verify pass of {w} rows")
    print(f"{path.name}: {what}, median wall {wall:.2f} ms "
          f"[{sp['min']:.2f}-{sp['max']:.2f}] over {n} steps (profiled)")
    faults = (r1.ru_minflt - r0.ru_minflt) / n
    print(f"process per step: {faults:.0f} minor page faults (fresh pages of new buffers), "
          f"{1e3 * (r1.ru_stime - r0.ru_stime) / n:.1f} ms system CPU, {1e3 * (r1.ru_utime - r0.ru_utime) / n:.1f} ms user CPU")
    print(f"ops executed per step: {sum(v[0] for v in per_kind.values()) / n:.0f}; their self time "
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


if __name__ == "__main__":
    app.run(main)
