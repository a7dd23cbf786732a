"""Expert parallelism: per-device routed-expert bytes and tok/s for N devices on the "expert" axis.

    python -m experiments.bench_expert_parallel [--model=default] [--devices=1,2,4] [--repeats=3]
    python -m experiments.bench_expert_parallel --model=/path/35b-Q4_K_M.gguf --devices=1,2,4,8

One engine per N (`sj.load(path, expert_parallel=N)`); on CPU the process asks XLA for max(N) host
devices before jax starts (`parallel.force_host_devices`), so N = 1 runs on a 1-device mesh of the same
process. Each row prints the trunk's routed-expert bytes each device holds (1/N of the total; the MTP
block's experts are sharded alike), the dense bytes each device holds (replicated), prefill / decode
tok/s (warm, median [min-max] of --repeats interleaved rounds, experiments.timing), and whether every
N generated the same tokens (it must: the logits are bitwise those of one device). Forced host devices
share the same CPU cores, so CPU figures show the shape of scaling (collective and dispatch overhead),
not a speed-up; on GPUs or across hosts (`jax.distributed.initialize()` first, see docs/residency.md,
"Several hosts") each device brings its own memory and compute. Timings only; nothing here is a test.
"""

from __future__ import annotations

import json

from absl import app, flags, logging

from experiments.cli import fail, reports_bad_input

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "default", "Preset name (configs/models.json) or GGUF path of a MoE model.")
flags.DEFINE_list("devices", ["1", "2", "4"], "Devices on the expert axis, one engine each.")
flags.DEFINE_integer("prompt_tokens", 32, "Prompt length for the prefill figure.")
flags.DEFINE_integer("decode_tokens", 16, "Tokens decoded for the decode figure.")
flags.DEFINE_integer("repeats", 3, "Timed interleaved rounds (median and min/max reported).", lower_bound=1)
flags.DEFINE_integer("max_context", 256, "KV cache positions.")
flags.DEFINE_string("json_out", None, "Append one JSON record per N to this file.")

MIB = 2**20


def _prompt(engine, n: int) -> list[int]:
    ids = engine.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    return (ids * (n // len(ids) + 1))[:n]


@reports_bad_input
def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)
    from experiments.timing import fmt_spread, interleaved, line_buffered, put_spread
    from sharpi_jax.experts import parallel

    line_buffered()
    try:
        ns = [int(n) for n in FLAGS.devices]
    except ValueError:
        return fail(f"--devices must be integers, got {FLAGS.devices}")
    parallel.force_host_devices(max(ns))  # before jax starts: only the host (CPU) platform
    import jax

    import sharpi_jax as sj
    from experiments.presets import resolve_model

    path = resolve_model(None if FLAGS.model == "default" else FLAGS.model)
    engines = [sj.load(path, max_context=FLAGS.max_context, expert_parallel=n) for n in ns]
    ids = _prompt(engines[0], FLAGS.prompt_tokens)
    print(f"{path.name}: {engines[0].config.n_expert} experts per layer, {jax.device_count()} "
          f"{jax.default_backend()} devices")
    outs = interleaved(engines, lambda e: e.generate(ids, max_new_tokens=FLAGS.decode_tokens, stop_on_eos=False),
                       FLAGS.repeats, what="engines")
    same = all(o.tokens == outs[0][0].tokens for runs in outs for o in runs)
    print(f"{'N':>3} {'experts MiB/device':>19} {'dense MiB/device':>17} {'prefill tok/s':>22} {'decode tok/s':>22}")
    records = []
    for n, engine, runs in zip(ns, engines, outs):
        devices = list(engine.mesh.devices.flat)
        experts = parallel.device_bytes(engine.model, parallel.is_routed_expert)
        dense = parallel.device_bytes(engine.model, lambda p: not parallel.is_routed_expert(p))
        rec = {"model": path.name, "expert_parallel": n, "devices": [str(d) for d in devices],
               "expert_bytes_per_device": [experts.get(d, 0) for d in devices],
               "dense_bytes_per_device": [dense.get(d, 0) for d in devices],
               "prompt_tokens": len(ids), "decode_tokens": len(runs[0].tokens), "repeats": FLAGS.repeats,
               "same_tokens_all_n": same}
        put_spread(rec, "prefill_tok_s", [o.stats.speed.prefill_tok_s for o in runs])
        put_spread(rec, "decode_tok_s", [o.stats.speed.decode_tok_s for o in runs])
        records.append(rec)
        print(f"{n:>3} {max(rec['expert_bytes_per_device']) / MIB:>19.3f} "
              f"{max(rec['dense_bytes_per_device']) / MIB:>17.3f} {fmt_spread(rec['prefill_tok_s_runs'], 22)} "
              f"{fmt_spread(rec['decode_tok_s_runs'], 22)}")
    print(f"same tokens for every N: {'yes' if same else 'NO'} (prompt {len(ids)} tokens, "
          f"{FLAGS.decode_tokens} decoded; median [min-max] of {FLAGS.repeats} warm interleaved rounds)")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    app.run(main)
