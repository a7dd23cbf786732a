r"""Micro-benchmark of the ggml backend's kernels on Qwen3.6-35B-A3B shapes, beside ggml's own mul_mat.

    python -m experiments.bench_ggml                      # LM head + expert matrices + expert op
    python -m experiments.bench_ggml --parts=matmul --sizes=1,16 --repeats=3 --json_out=/tmp/ggml.jsonl

Cells (random valid blocks; speed does not depend on the values):
- "lm_head": Q6_K 248320 x 2048 (the 35B LM head), at M = 1 only by default (--lm_head_sizes).
- "expert_gate": Q4_K 512 x 2048 and "expert_down": Q6_K 2048 x 512 (one expert's matrices), each
  cycling through --copies distinct copies so a call reads cold memory, at every M in --sizes.
- "experts": the grouped routed-expert op (--n_expert experts, top-8, Q4_K gate / up, Q6_K down) at
  N in --sizes, grouped and per_token.
Engines: "ffi" (sharpi_jax.quant.ggml inside jit, XLA's intra-op pool), "host" (the same kernel through
`ggml.host_matmul`, --threads threads) and "graph" (ggml's own `ggml_mul_mat` graph through ctypes,
--threads threads; it starts its own thread pool per call, so compare it with "host" at --threads=1). Every cell runs once unrecorded, then
--repeats interleaved rounds; printed: median [min-max] wall ms per call, GB/s of weight bytes read
(expert op: bytes of the experts it reads) and process CPU ms (summed over threads), with the machine's copy bandwidth (experiments.bandwidth).
Timings on a shared machine are noisy: read the spread.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from experiments import ggml_graph
from experiments.bandwidth import copy_bandwidth
from experiments.timing import interleaved, line_buffered, put_spread, spread
from sharpi_jax.quant import ggml

Q = GGMLQuantizationType
FLAGS = flags.FLAGS
flags.DEFINE_list("parts", ["lm_head", "matmul", "experts"], "Which cells to run.")
flags.DEFINE_list("sizes", ["1", "16", "128"], "Activation rows M (expert op: tokens N).")
flags.DEFINE_list("lm_head_sizes", ["1"], "Rows M for the LM head.")
flags.DEFINE_integer("copies", 32, "Distinct copies of each expert matrix (a call reads cold memory).")
flags.DEFINE_integer("n_expert", 64, "Experts in the expert-op layer (35B-A3B has 256).")
flags.DEFINE_integer("threads", 2, "Threads of the host engine and of ggml's own graph.")
flags.DEFINE_integer("repeats", 5, "Interleaved timed rounds.", lower_bound=1)
flags.DEFINE_boolean("graph", True, "Also time ggml's own mul_mat graph.")
flags.DEFINE_string("json_out", None, "Append one JSON line per cell to this file.")


def random_blocks(rng: np.random.Generator, qt: Q, rows: int, cols: int) -> np.ndarray:
    """Random bytes in qt's block layout with a finite, small f16 super-block scale (Q4_K / Q6_K)."""
    block, size = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    d_at = {Q.Q4_K: 0, Q.Q6_K: size - 2}[qt]
    raw[..., d_at:d_at + 2] = np.array([2.0**-10], np.float16).view(np.uint8)
    if qt == Q.Q4_K:
        raw[..., 2:4] = np.array([2.0**-12], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def _timed(fn) -> tuple[float, float]:
    """(wall ms, process CPU ms: summed over threads, the steadier figure on a shared machine)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3


def _matmul_cells(rng, name, qt, rows, cols, sizes, copies):
    mats = [random_blocks(rng, qt, rows, cols) for _ in range(copies)]
    dev = [jnp.asarray(m) for m in mats]
    f = jax.jit(lambda x, w: ggml.matmul(x, w, qt))
    cells = []
    for m in sizes:
        x = jnp.asarray(rng.standard_normal((m, cols)), jnp.float32)
        state = {"i": 0}

        def ffi(x=x, state=state):
            state["i"] = (state["i"] + 1) % copies
            f(x, dev[state["i"]]).block_until_ready()

        cells.append(dict(name=name, engine="ffi", m=m, bytes=mats[0].nbytes, run=ffi))
        xh = np.asarray(x)

        def host(xh=xh, state={"i": 0}):
            state["i"] = (state["i"] + 1) % copies
            ggml.host_matmul(xh, mats[state["i"]], qt, FLAGS.threads)

        cells.append(dict(name=name, engine="host", m=m, bytes=mats[0].nbytes, run=host))
        if FLAGS.graph:
            graphs = [ggml_graph.MulMat(w, qt, m) for w in mats]
            xn = np.asarray(x)

            def graph(graphs=graphs, xn=xn, state={"i": 0}):
                state["i"] = (state["i"] + 1) % copies
                graphs[state["i"]].compute(xn, FLAGS.threads)

            cells.append(dict(name=name, engine="graph", m=m, bytes=mats[0].nbytes, run=graph))
    return cells


def _expert_cells(rng, sizes):
    e, d, f, k = FLAGS.n_expert, 2048, 512, 8
    gate, up = (random_blocks(rng, Q.Q4_K, e * f, d).reshape(e, f, -1) for _ in range(2))
    down = random_blocks(rng, Q.Q6_K, e * d, f).reshape(e, d, -1)
    qtypes = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    w = [jnp.asarray(a) for a in (gate, up, down)]
    per_expert = ggml.expert_bytes(gate, up, down)
    run = jax.jit(lambda x, ids, mode: ggml.expert_rows(x, ids, *w, qtypes, mode), static_argnums=2)
    cells = []
    for n in sizes:
        x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
        ids_np = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
        ids = jnp.asarray(ids_np)
        for mode in ggml.MODES:
            reads = int(ggml.expert_reads(ids, e, mode))
            cells.append(dict(name="experts", engine=mode, m=n, bytes=reads * per_expert,
                              run=lambda x=x, ids=ids, mode=mode: run(x, ids, mode).block_until_ready()))
    return cells


def main(argv: Sequence[str]) -> None:
    del argv
    line_buffered()
    if not ggml.available():
        sys.exit(f"bench_ggml: {ggml.unavailable_reason()}")
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in FLAGS.sizes]
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw['median']:.2f} GB/s [{bw['min']:.2f}-{bw['max']:.2f}] (numpy, 1 thread); "
          f"XLA threads: the intra-op pool; ggml graph threads: {FLAGS.threads}")
    cells = []
    if "lm_head" in FLAGS.parts:
        cells += _matmul_cells(rng, "lm_head Q6_K 248320x2048", Q.Q6_K, 248320, 2048,
                               [int(s) for s in FLAGS.lm_head_sizes], 1)
    if "matmul" in FLAGS.parts:
        cells += _matmul_cells(rng, "expert_gate Q4_K 512x2048", Q.Q4_K, 512, 2048, sizes, FLAGS.copies)
        cells += _matmul_cells(rng, "expert_down Q6_K 2048x512", Q.Q6_K, 2048, 512, sizes, FLAGS.copies)
    if "experts" in FLAGS.parts:
        cells += _expert_cells(rng, sizes)
    times = interleaved(cells, lambda c: _timed(c["run"]), FLAGS.repeats, what="cells")
    print(f"{'cell':28s} {'engine':9s} {'M':>4s} {'wall ms median [min-max]':>28s} {'GB/s':>6s} "
          f"{'CPU ms median [min-max]':>28s}")
    for c, runs in zip(cells, times):
        ts, cpu = [r[0] for r in runs], [r[1] for r in runs]
        s, sc = spread(ts), spread(cpu)
        gbs = c["bytes"] / (s["median"] / 1e3) / 1e9
        print(f"{c['name']:28s} {c['engine']:9s} {c['m']:4d} {s['median']:12.3f} [{s['min']:.3f}-{s['max']:.3f}]"
              f" {gbs:6.2f} {sc['median']:12.3f} [{sc['min']:.3f}-{sc['max']:.3f}]")
        if FLAGS.json_out:
            rec = dict(cell=c["name"], engine=c["engine"], m=c["m"], weight_bytes=c["bytes"],
                       copy_gbs=bw["median"], gbs=gbs)
            put_spread(rec, "ms", ts)
            put_spread(rec, "cpu_ms", cpu)
            with open(FLAGS.json_out, "a") as fh:
                fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    app.run(main)
