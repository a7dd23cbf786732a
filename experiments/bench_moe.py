r"""Per-token vs grouped routed experts on a synthetic 35B-A3B-shaped MoE layer.

    python -m experiments.bench_moe                       # Q4_K, N = 1 2 4 8 16 64 256, ggml and xla
    python -m experiments.bench_moe --qtype=f32 --sizes=1,8,64 --repeats=5 --json_out=/tmp/moe.jsonl

For each batch size N it routes N random tokens (top-k of random router logits), runs both paths of
`sharpi_jax.experts.routed_experts` on the same layer laid out for each --kernels backend (default ggml
and xla, all four cells interleaved), checks per backend that both paths agree bit for bit, and prints
one row per backend side by side: expert weight bytes read (per-token: N*k expert reads; grouped: one per unique expert,
which must equal the unique-expert floor exactly; the grouped path's executed expert loads are
counted inside the jitted loop, not inferred) and the median wall and process-CPU time per call
(CPU time, summed over XLA's threads, is the steadier figure when the machine is shared): per size a
warm-up call of each path (compilation), then --repeats calls alternating per-token / grouped; the
--json_out records carry median, _min, _max and _runs of every timing, and the fields
`python -m experiments.plot` draws expert_reads_vs_batch.png from. The machine's copy bandwidth
(experiments.bandwidth) heads the table; the "GB/s" column is the grouped path's expert bytes over
its wall time, and at N = 1 (one token: a decode step's layer) that streaming rate is also printed as
a fraction of the copy bandwidth. Last, per backend, whether grouped beat per-token at every N.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.bandwidth import copy_bandwidth
from experiments.timing import interleaved, line_buffered, put_spread, spread
from gguf import GGMLQuantizationType as Q

from sharpi_jax.experts import dispatch
from sharpi_jax.quant import MatrixFormat, kernel_names
from sharpi_jax.testing.experts import expert_stacks, synthetic_expert_bytes

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["1", "2", "4", "8", "16", "64", "256"], "Batch sizes N (rows routed together).")
flags.DEFINE_enum("qtype", "q4_k", ["f32", "q8_0", "q4_k"], "ggml type of the expert weights.")
flags.DEFINE_list("kernels", ["ggml", "xla"], "Kernel backends the experts are laid out for and computed by, "
                  f"compared side by side ({', '.join(kernel_names())}).")
flags.DEFINE_integer("n_expert", 256, "Experts in the layer.")
flags.DEFINE_integer("top_k", 8, "Experts per token.")
flags.DEFINE_integer("d_ff", 512, "Expert FFN width.")
flags.DEFINE_integer("d_model", 2048, "Hidden width.")
flags.DEFINE_integer("repeats", 3, "Timed calls per path and size, interleaved (median printed; min/max in "
                     "--json_out).", lower_bound=1)
flags.DEFINE_enum("row_kernel", "gemm", dispatch.ROW_KERNELS, "Row-stable product of both paths.")
flags.DEFINE_integer("row_tile", 0, "Fixed grouped-gemm rows per tile (0: the default ladder sized to each bucket).")
flags.DEFINE_float("skew", 0.0, "Router logit scale of a fixed per-expert popularity bias (0: uniform).")
flags.DEFINE_boolean("check", True, "Check per-token == grouped bit for bit.")
flags.DEFINE_integer("seed", 0, "RNG seed.")
flags.DEFINE_string("json_out", None, "Append one JSON line per size to this file.")


def _route(rng: np.random.Generator, n: int, n_expert: int, k: int, bias: np.ndarray):
    logits = rng.standard_normal((n, n_expert)) + bias
    sel = np.argsort(-logits, axis=1, kind="stable")[:, :k].astype(np.int32)
    p = np.exp(np.take_along_axis(logits, sel, axis=1))
    w = (p / p.sum(axis=1, keepdims=True)).astype(np.float32)
    return sel, w


def _timed(fn):
    """(wall seconds, process CPU seconds, output) of one call. CPU time (all threads) is the steadier
    figure on a shared machine; wall time is what a caller waits."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - t0, time.process_time() - c0, out


def main(argv: Sequence[str]) -> None:
    del argv
    line_buffered()
    rng = np.random.default_rng(FLAGS.seed)
    e, k, f, d = FLAGS.n_expert, FLAGS.top_k, FLAGS.d_ff, FLAGS.d_model
    t0 = time.perf_counter()
    qtype = int(Q[FLAGS.qtype.upper()])
    raws = synthetic_expert_bytes(rng, e, f, d, qtype)
    layers = [expert_stacks(raws, qtype, MatrixFormat(name, None)) for name in FLAGS.kernels]
    bpe = sum(m.gguf_nbytes for m in layers[0]) // e
    bw = copy_bandwidth()
    print(f"layer: {e} experts x (gate, up [{f}x{d}], down [{d}x{f}]) {FLAGS.qtype}, top-{k}; "
          f"{bpe / 2**20:.3f} MiB per expert, {e * bpe / 2**30:.2f} GiB per layer "
          f"(built in {time.perf_counter() - t0:.1f}s)")
    print(f"copy bandwidth (512 MiB, numpy, 1 thread): {bw['median']:.2f} GB/s [{bw['min']:.2f}-{bw['max']:.2f}]; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"backend: {jax.default_backend()}, {jax.device_count()} device(s); kernels "
          f"{', '.join(f'{x[0].kernels} (layout {x[0].layout})' for x in layers)}; row_kernel={FLAGS.row_kernel}; "
          f"per size: a warm-up call of each path and backend, then the median of {FLAGS.repeats} interleaved "
          "rounds (min/max in --json_out)", flush=True)
    bias = FLAGS.skew * rng.standard_normal(e)
    row_tile = FLAGS.row_tile or None

    head = (f"{'N':>4} {'pairs':>5} {'uniq':>4} {'maxr':>4} {'tiles':>9} {'kernels':>7} | {'per-token MiB':>13} "
            f"{'grouped MiB':>11} {'floor MiB':>9} {'read x':>6} | {'per-token ms':>12} "
            f"{'grouped ms':>10} {'speedup':>7} {'GB/s':>6} | {'cpu ms p-t':>10} {'cpu ms gr':>9} {'cpu x':>5} | "
            f"{'bitwise':>7}")
    print(head)
    print("-" * len(head))
    last_s = 0.0
    grouped_wins = {x[0].kernels: [] for x in layers}
    at_one = []
    for n in (int(s) for s in FLAGS.sizes):
        t_size = time.perf_counter()
        if last_s > 3:  # the previous size was slow and this one is bigger: say what is running
            print(f"  (timing N={n}: a warm-up and {FLAGS.repeats} calls of each path and backend; the last size "
                  f"took {last_s:.0f}s)", file=sys.stderr, flush=True)
        sel_np, w_np = _route(rng, n, e, k, bias)
        u = jnp.asarray(rng.standard_normal((n, d), dtype=np.float32))
        sel, w = jnp.asarray(sel_np), jnp.asarray(w_np)
        stats = dispatch.dispatch_stats(sel_np, e, bpe)
        tiles = (1,) if FLAGS.row_kernel == "gemv" else dispatch.row_tiles(n, row_tile)

        def run(experts, mode):
            return lambda: dispatch.routed_experts(u, sel, w, experts, mode, row_kernel=FLAGS.row_kernel,
                                                   row_tile=row_tile, with_stats=True)

        # Warm-up (compile) each cell, then interleaved rounds: (backend, per-token), (backend, grouped), ...
        cells = [run(x, mode) for x in layers for mode in ("per_token", "grouped")]
        runs = interleaved(cells, _timed, FLAGS.repeats, log=lambda m: None)
        for b, experts in enumerate(layers):
            name = experts[0].kernels
            rpt, rgr = runs[2 * b], runs[2 * b + 1]
            (_, _, (y_pt, s_pt)), (_, _, (y_gr, s_gr)) = rpt[-1], rgr[-1]
            wall_pt, cpu_pt = [r[0] for r in rpt], [r[1] for r in rpt]
            wall_gr, cpu_gr = [r[0] for r in rgr], [r[1] for r in rgr]
            t_pt, c_pt = spread(wall_pt)["median"], spread(cpu_pt)["median"]
            t_gr, c_gr = spread(wall_gr)["median"], spread(cpu_gr)["median"]
            bytes_pt = int(s_pt["expert_loads"]) * bpe
            bytes_gr = int(s_gr["expert_loads"]) * bpe
            if bytes_gr != stats["bytes_grouped"] or bytes_pt != stats["bytes_per_token"]:
                raise AssertionError(f"N={n} {name}: executed loads {bytes_pt}/{bytes_gr} bytes != counters {stats}")
            same = bool(np.array_equal(np.asarray(y_pt), np.asarray(y_gr))) if FLAGS.check else None
            nan = bool(np.isnan(np.asarray(y_gr)).any())
            gb_s = bytes_gr / t_gr / 1e9
            grouped_wins[name].append((n, t_gr < t_pt))
            if n == 1:
                at_one.append(f"{name} {gb_s:.2f} GB/s = {gb_s / bw['median']:.0%}")
            mib = 2**20
            print(f"{n:>4} {n * k:>5} {stats['unique_experts']:>4} {stats['max_rows_per_expert']:>4} "
                  f"{','.join(map(str, tiles)):>9} {name:>7} | {bytes_pt / mib:>13.1f} {bytes_gr / mib:>11.1f} "
                  f"{stats['bytes_grouped'] / mib:>9.1f} {bytes_pt / bytes_gr:>6.2f} | {t_pt * 1e3:>12.1f} "
                  f"{t_gr * 1e3:>10.1f} {t_pt / t_gr:>7.2f} {gb_s:>6.2f} | {c_pt * 1e3:>10.1f} {c_gr * 1e3:>9.1f} "
                  f"{c_pt / max(c_gr, 1e-9):>5.2f} | {str(same) + (' NaN!' if nan else ''):>7}", flush=True)
            if FLAGS.check and not same:
                raise AssertionError(f"N={n} {name}: grouped != per_token")
            if FLAGS.json_out:
                rec = {
                    "bench": "moe_dispatch", "n": n, "top_k": k, "n_expert": e, "d_ff": f, "d_model": d,
                    "qtype": FLAGS.qtype, "kernels": name, "row_kernel": FLAGS.row_kernel,
                    "row_tiles": list(tiles),
                    "unique_experts": stats["unique_experts"], "max_rows_per_expert": stats["max_rows_per_expert"],
                    "bytes_per_token": bytes_pt, "bytes_grouped": bytes_gr, "bytes_floor": stats["bytes_grouped"],
                    # the fields experiments.plot draws expert_reads_vs_batch.png from (bytes read per routed token)
                    "N": n, "per_token_bytes_per_token": bytes_pt / n, "grouped_bytes_per_token": bytes_gr / n,
                    "bitwise_equal": same, "backend": jax.default_backend(), "repeats": FLAGS.repeats,
                    "grouped_gb_s": gb_s, "copy_gb_s": bw["median"], "load_avg": os.getloadavg()[0],
                }
                for key, vals in (("ms_per_token", wall_pt), ("ms_grouped", wall_gr), ("cpu_ms_per_token", cpu_pt),
                                  ("cpu_ms_grouped", cpu_gr)):
                    put_spread(rec, key, [1e3 * v for v in vals])
                with open(FLAGS.json_out, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(rec) + "\n")
        last_s = time.perf_counter() - t_size
    if at_one:
        print(f"\nN = 1, grouped expert bytes streamed per second (median wall) vs copy bandwidth "
              f"{bw['median']:.2f} GB/s: {'; '.join(at_one)}")
    for name, wins in grouped_wins.items():
        losses = [n for n, won in wins if not won]
        print(f"{name}: grouped beats per-token (median wall) at every N: "
              f"{'yes' if not losses else 'no (not at N = ' + ', '.join(map(str, losses)) + ')'}")


if __name__ == "__main__":
    app.run(main)
