"""The first thing to run on a GPU: one command that times the GPU path and prints what matters.

    python -m experiments.gpu_check [--gguf=PATH] [--llama_bin=DIR] [--repeats=3]

On a machine without a GPU it prints one line saying so and exits 0. On a GPU:

1. the model: --gguf, else the 35B-A3B-shaped 4-layer Q4_K_M slice in $SHARPI_CACHE (written once:
   write_synthetic Q8_0 + `llama-quantize Q4_K_M` when --llama_bin names a llama.cpp bin directory, else
   write_synthetic Q4_K with the types llama-quantize's Q4_K_M gives the 4 + 1 blocks: Q6_K LM head,
   ffn_down_exps / ffn_down_shexp of blocks 2 and 4, blk.2.attn_qkv and blk.4.attn_v; see WORKSPACE,
   "No silent fallback, and the type mix of K-quant files");
2. the backend each matrix runs on under kernels="pallas" (any fallback is named);
3. prefill and decode tok/s for kernels="pallas" and kernels="xla": loaded, warmed up, then --repeats
   interleaved rounds (experiments.timing), median [min-max];
4. bytes read per decoded token (pallas layouts) against the device's measured bandwidth (a jitted
   read of a 1 GiB array): the HBM floor in ms / token and the share of it the measured decode reaches;
5. the MTP k = 3 pass: the time of one 4-row verify pass and of one decode step (experiments.pass_timing),
   and generate(speculative="mtp", draft_tokens=3) tok/s;
6. logits agreement, pallas vs reference: relative L2 and max |diff| of the prompt's logits, argmax match;
7. the residency path under kernels="pallas" with a 25% expert budget, every policy x lookahead mode
   (none / next_layer / both): decode and MTP k = 3 tok/s, hit rate, bytes moved per token (streamed,
   host-read and fetched ahead) beside the measured host-to-device bandwidth, the tokens against the
   all-resident run, and the staging memory kind;
8. kernels="pallas" with expert parallelism over every visible GPU (2 or more): logits bitwise one GPU's,
   decode and MTP k = 3 tok/s; then with a per-device 25% budget as well: the same, plus bytes moved.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags

from experiments.presets import Q4_K_M_MIX_4L
from experiments.timing import fmt_spread, interleaved, line_buffered

FLAGS = flags.FLAGS
flags.DEFINE_string("gguf", None, "Model to check (default: the 35B-A3B-shaped 4-layer Q4_K_M slice, written once).")
flags.DEFINE_string("llama_bin", None, "llama.cpp bin directory with llama-quantize: the default slice is then a "
                    "real `llama-quantize Q4_K_M` of a synthetic Q8_0 file.")
flags.DEFINE_integer("repeats", 3, "Timed interleaved rounds (median and min-max reported).", lower_bound=1)
flags.DEFINE_integer("prompt_tokens", 128, "Prompt length for prefill.")
flags.DEFINE_integer("decode_tokens", 32, "Decoded tokens per round.")
flags.DEFINE_integer("max_context", 1024, "KV positions.")
flags.DEFINE_string("expert_budget", "25%", "Expert budget of the residency run.")

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
N_LAYER = 4


def gpu_platform() -> str | None:
    """The JAX GPU platform name, or None when JAX runs without a GPU."""
    import jax

    backend = jax.default_backend()
    return backend if backend in GPU_PLATFORMS else None


def default_slice(llama_bin: str | None) -> Path:
    """The 35B-A3B-shaped 4-layer Q4_K_M slice in the cache dir, written on first use."""
    from experiments.presets import cache_dir
    from sharpi_jax.config import shape_preset
    from sharpi_jax.testing import write_synthetic_gguf

    kind = "llama-quantize" if llama_bin else "synthetic-mix"
    path = cache_dir() / "gpu-check" / f"s35-{N_LAYER}L-Q4_K_M-{kind}.gguf"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    config = shape_preset("qwen36-35b-a3b", N_LAYER)
    tmp = path.with_suffix(".partial")
    if llama_bin:
        q8 = path.with_name(f"s35-{N_LAYER}L-Q8_0.gguf")
        if not q8.exists():
            write_synthetic_gguf(q8, config, "Q8_0", progress=True, name="synthetic-qwen36-35b-a3b")
        from experiments.llama_cpp_side import find_tool

        tool = find_tool(llama_bin, "llama-quantize")
        if tool is None:
            raise SystemExit(f"gpu_check: no llama-quantize in {llama_bin}")
        env = {**os.environ, "LD_LIBRARY_PATH": f"{tool.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
        subprocess.run([str(tool), "--allow-requantize", str(q8), str(tmp), "Q4_K_M"], check=True, env=env,
                       stdout=subprocess.DEVNULL)
    else:
        write_synthetic_gguf(tmp, config, "Q4_K", progress=True, name="synthetic-qwen36-35b-a3b",
                             type_overrides=Q4_K_M_MIX_4L)
    tmp.rename(path)
    return path


def measured_bandwidth_gbs(n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Device read bandwidth, GB/s: the best of `repeats` jitted sums over an n_bytes float32 array."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    del x
    return n_bytes / best / 1e9


def _prompt(n_vocab: int, n: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(0).integers(0, n_vocab, n)]


def run_check(path: Path) -> None:
    import sharpi_jax as sj
    from experiments.pass_timing import pass_timing
    from sharpi_jax.model.footprint import backend_summary, decode_floor_bytes, decode_read_bytes, fallback_message

    say = lambda m: print(m, flush=True)  # noqa: E731
    say(f"gpu_check: {path}")
    load = lambda **kw: sj.load(path, max_context=FLAGS.max_context, **kw)  # noqa: E731
    engines = {"pallas": load(kernels="pallas"), "xla": load(kernels="xla")}
    e = engines["pallas"]
    ids = _prompt(e.config.n_vocab, FLAGS.prompt_tokens)
    say(f"backends (kernels='pallas'): {backend_summary(e.matrix_backends)}; "
        f"{fallback_message(e.matrix_backends, 'pallas') or 'no fallback'}")

    def run(name):
        return engines[name].generate(ids, max_new_tokens=FLAGS.decode_tokens, stop_on_eos=False)

    names = list(engines)
    results = interleaved(names, run, FLAGS.repeats, warm=lambda n: engines[n].generate(ids, max_new_tokens=3),
                          what="backends")
    decode = {}
    for name, outs in zip(names, results):
        pre = [o.stats.speed.prefill_tok_s for o in outs]
        decode[name] = [o.stats.speed.decode_tok_s for o in outs]
        say(f"kernels={name:7s} prefill {fmt_spread(pre)} tok/s ({len(ids)} tokens), "
            f"decode {fmt_spread(decode[name], digits=2)} tok/s ({FLAGS.decode_tokens} tokens)")

    bw = measured_bandwidth_gbs()
    read = decode_read_bytes(e.model, e.gguf, e.config)
    floor = decode_floor_bytes(e.gguf, e.config)
    floor_ms = read / (bw * 1e9) * 1e3
    dec_ms = 1e3 / float(np.median(decode["pallas"]))
    say(f"bytes per decoded token: {read / 2**20:.0f} MiB with pallas layouts (file floor {floor / 2**20:.0f} MiB); "
        f"measured bandwidth {bw:.0f} GB/s -> HBM floor {floor_ms:.2f} ms/token; pallas decode {dec_ms:.2f} ms/token "
        f"= {100 * floor_ms / dec_ms:.0f}% of the floor's speed")

    rec = {r["rows"]: r for r in pass_timing(e, ids, [1, 4], FLAGS.repeats)}
    say(f"MTP k=3: one 4-row verify pass {rec[4]['chain_ms']:.2f} ms [{rec[4]['chain_ms_min']:.2f}-"
        f"{rec[4]['chain_ms_max']:.2f}], decode step {rec[1]['decode_ms']:.2f} ms "
        f"(ratio {rec[4]['chain_ms'] / rec[1]['decode_ms']:.2f})")
    e.generate(ids, max_new_tokens=4, speculative="mtp", draft_tokens=3)  # compiles the MTP shapes
    mtp = [e.generate(ids, max_new_tokens=FLAGS.decode_tokens, speculative="mtp", draft_tokens=3, stop_on_eos=False)
           for _ in range(FLAGS.repeats)]
    say(f"MTP k=3 generate: decode {fmt_spread([o.stats.speed.decode_tok_s for o in mtp], digits=2)} tok/s, "
        f"mean accepted length {np.median([o.stats.speculation.mean_accept_len for o in mtp]):.2f} (random weights)")

    ref = load(kernels="reference")
    a, b = e.logits(ids[:32]), ref.logits(ids[:32])
    rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    say(f"logits pallas vs reference (32 tokens): rel L2 {rel:.2e}, max |diff| {float(np.abs(a - b).max()):.2e}, "
        f"argmax agree {float(np.mean(a.argmax(-1) == b.argmax(-1))):.3f}")
    del ref, engines

    _residency_check(load, ids, say)
    _expert_parallel_check(load, ids, say)


def measured_h2d_gbs(n_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Host-to-device copy bandwidth in GB/s: median of `repeats` device_puts of an n_bytes numpy array."""
    import jax

    host = np.ones(n_bytes // 4, np.float32)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        jax.device_put(host).block_until_ready()
        times.append(time.perf_counter() - t0)
    return n_bytes / float(np.median(times[1:])) / 1e9


def _budget_line(engine, ids: list[int], h2d_gbs: float, reference: list[int] | None) -> str:
    """Decode and MTP k = 3 tok/s of a budgeted engine, its hit rate and bytes moved per token (and what
    that costs at `h2d_gbs`), and whether its tokens are `reference`'s."""
    gen = dict(max_new_tokens=FLAGS.decode_tokens, stop_on_eos=False)
    engine.generate(ids, max_new_tokens=3), engine.generate(ids, max_new_tokens=4, speculative="mtp", draft_tokens=3)
    off = [engine.generate(ids, **gen) for _ in range(FLAGS.repeats)]
    mtp = [engine.generate(ids, **gen, speculative="mtp", draft_tokens=3) for _ in range(FLAGS.repeats)]
    ex = off[-1].stats.experts
    moved = ex["bytes_moved"] / max(1, ex["tokens"])
    same = "" if reference is None else f"; tokens = all-resident's: {off[0].tokens == reference == mtp[0].tokens}"
    return (f"decode {fmt_spread([o.stats.speed.decode_tok_s for o in off], digits=2)} tok/s, MTP k=3 "
            f"{fmt_spread([o.stats.speed.decode_tok_s for o in mtp], digits=2)} tok/s, hit rate {ex['hit_rate']:.2f}, "
            f"{moved / 2**20:.1f} MiB moved per token (= {moved / (h2d_gbs * 1e9) * 1e3:.2f} ms at the measured "
            f"host-to-device {h2d_gbs:.1f} GB/s){same}")


def _residency_check(load, ids: list[int], say) -> None:
    """Step 7: kernels="pallas" with an expert budget, every policy x lookahead mode (`_budget_line`)."""
    from sharpi_jax.experts.residency import POLICIES

    h2d = measured_h2d_gbs()
    gen = dict(max_new_tokens=FLAGS.decode_tokens, stop_on_eos=False)
    full = load(kernels="pallas").generate(ids, **gen).tokens
    for policy in POLICIES:
        for lookahead in ("none", "next_layer", "both"):
            e = load(kernels="pallas", expert_budget=FLAGS.expert_budget, expert_policy=policy,
                     expert_lookahead=lookahead)
            say(f"residency (kernels='pallas', expert_budget={FLAGS.expert_budget}, {policy}, lookahead {lookahead}): "
                f"{_budget_line(e, ids, h2d, full)}; staging: {e.residency.staging_kind}")
            e.close()


def _expert_parallel_check(load, ids: list[int], say) -> None:
    """Step 8: kernels="pallas" with the routed experts sharded over every visible GPU (at least 2):
    logits bitwise one device's, greedy and MTP k = 3 decode tok/s, the MTP tokens equal MTP off's."""
    import jax

    one = load(kernels="pallas")
    n = len(jax.devices())
    while n > 1 and one.config.n_expert % n:
        n -= 1
    if n < 2:
        say("expert parallel: one GPU visible (or no divisor of the expert count); skipped")
        return
    par = load(kernels="pallas", expert_parallel=n)
    same = bool(np.array_equal(one.logits(ids[:32]).view(np.int32), par.logits(ids[:32]).view(np.int32)))
    gen = dict(max_new_tokens=FLAGS.decode_tokens, stop_on_eos=False)
    par.generate(ids, max_new_tokens=3), par.generate(ids, max_new_tokens=4, speculative="mtp", draft_tokens=3)
    off = [par.generate(ids, **gen) for _ in range(FLAGS.repeats)]
    mtp = [par.generate(ids, **gen, speculative="mtp", draft_tokens=3) for _ in range(FLAGS.repeats)]
    say(f"expert parallel x{n} (kernels='pallas'): logits bitwise one GPU's: {same}; decode "
        f"{fmt_spread([o.stats.speed.decode_tok_s for o in off], digits=2)} tok/s, MTP k=3 "
        f"{fmt_spread([o.stats.speed.decode_tok_s for o in mtp], digits=2)} tok/s; MTP tokens = MTP off's: "
        f"{mtp[0].tokens == off[0].tokens}")
    par.close()
    budget = load(kernels="pallas", expert_parallel=n, expert_budget=FLAGS.expert_budget, expert_policy="lru",
                  expert_lookahead="both")
    say(f"expert parallel x{n} with a per-device expert_budget={FLAGS.expert_budget} (lru, lookahead both): "
        f"{_budget_line(budget, ids, measured_h2d_gbs(), off[0].tokens)}")


def main(argv) -> int:
    del argv
    line_buffered()
    platform = gpu_platform()
    if platform is None:
        import jax

        print(f"gpu_check: no GPU here (JAX backend {jax.default_backend()!r}); nothing to time, "
              "run it on a GPU machine")
        return 0
    path = Path(FLAGS.gguf) if FLAGS.gguf else default_slice(FLAGS.llama_bin)
    run_check(path)
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
