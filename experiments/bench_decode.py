"""Prefill and decode tokens/s: every fixture GGUF, plus a synthetic 35B-A3B-shaped 4-layer Q4_K model.

    python -m experiments.bench_decode [--prompt_tokens=128] [--decode_tokens=64] [--llama_bin=PATH]
    python -m experiments.bench_decode --models=default,tiny-qwen35-Q8_0 --repeats=5
    python -m experiments.bench_decode --models=/path/35b-slice-Q4_K_M.gguf --kernels=ggml,xla \
        --decode_tokens=16 --llama_bin=../shared/llama.cpp/bin --synthetic=false

Our figures: every model is loaded and warmed up (jit compilation excluded), then --repeats rounds
each run every model once (interleaved, experiments.timing); each figure is the median round with its
min and max (records: prefill_tok_s, decode_tok_s, with _min, _max, _runs). llama.cpp's figures are printed
beside ours when --llama_bin names a llama.cpp bin directory with `llama-bench` (same GGUF, same prompt
length, 2 threads; run once in each round, `-r 1`, interleaved with ours, so both see the same machine
load), or else when llama-cpp-python is importable (after our rounds), with the ratios ours / llama.cpp.
Each model runs once per --kernels entry (the matmul backend, `sj.load(kernels=...)`; default ggml and
xla, side by side in the same interleaved rounds) and per --repacks entry (`sj.load(repack=...)`).
A kernels entry `ggml:avx2` or `ggml:avx512` runs the ggml backend with that instruction set's multi-row
kernels (the same engine, the same bits; `ggml:avx512,ggml:avx2` puts both side by side on an AVX-512 CPU).
llama.cpp runs once per --llama_cpu_variants entry: `auto` is its own pick of CPU backend variant (the
best this CPU runs), a name such as `haswell` (its AVX2 build) loads only that variant.
Beside tok/s every row prints the weights it holds (GiB), the bytes one decoded token reads with its
layouts against the floor (the file's own bytes of the non-expert tensors + top-k experts per layer +
one embedding row), the process CPU seconds of one timed generate call (summed over threads: the
steadier figure on a shared machine), and the process's resident anonymous memory (RssAnon) right
after that configuration was loaded and decoded its warm-up tokens (--decode_tokens of them): the
first configuration's figure is the whole process's, each later one's grows by what it added (the
"+GiB" column). The machine's copy bandwidth (experiments.bandwidth) heads the table. Timings only;
nothing here is a test.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags, logging

from experiments import llama_cpp_side
from experiments.cli import fail, reports_bad_input
from experiments.timing import fmt_spread, interleaved, line_buffered, put_spread

FLAGS = flags.FLAGS
REPO = Path(__file__).resolve().parents[1]
flags.DEFINE_string("fixtures", str(REPO.parent / "shared" / "fixtures"), "Fixture directory.")
flags.DEFINE_string("only", None, "Regex: bench only the GGUFs whose file name matches.")
flags.DEFINE_list("models", None, "Preset names (configs/models.json) or GGUF paths to bench instead of the "
                  "fixtures + synthetic model.")
flags.DEFINE_integer("repeats", 3, "Timed rounds, interleaved over the models (median and min/max reported).",
                     lower_bound=1)
flags.DEFINE_integer("prompt_tokens", 128, "Prompt length for the prefill figure.")
flags.DEFINE_integer("decode_tokens", 64, "Tokens generated for the decode figure.")
flags.DEFINE_integer("max_context", 1024, "KV cache positions.")
flags.DEFINE_bool("synthetic", True, "Also bench a synthetic Qwen3.6-35B-A3B-shaped 4-layer Q4_K model.")
flags.DEFINE_string("synthetic_path", str(REPO / "results" / "synthetic-35b-a3b-4L-Q4_K.gguf"),
                    "Where the synthetic GGUF is written (reused if present).")
flags.DEFINE_integer("synthetic_prompt_tokens", 32, "Prompt length on the synthetic model.")
flags.DEFINE_integer("synthetic_decode_tokens", 8, "Decode tokens on the synthetic model.")
flags.DEFINE_string("llama_bin", None, "llama.cpp bin directory (or a binary in it) holding llama-bench "
                    "(optional; else llama-cpp-python when installed).")
flags.DEFINE_integer("threads", 2, "llama.cpp threads of the prefill / decode table.")
flags.DEFINE_list("widths", [], "Also time one trunk pass of w rows (different tokens per row, as drafts) "
                  "against one decode step for these w, beside llama-bench -p w -n 0 on the same file "
                  "(e.g. 1,2,4,8,16; w = 1 is the decode step).")
flags.DEFINE_bool("vec_dot_beside", False, "--widths: also time every pass with the multi-row kernels off (ggml's "
                  "vec_dot per element, the same bits) in the same rounds.")
flags.DEFINE_list("width_threads", ["2"], "Thread counts of the --widths table: ours runs with its process "
                  "bound to that many cores (sched_setaffinity), llama.cpp with -t.")
flags.DEFINE_string("jsonl", None, "Also append one JSON line per model here.")
flags.DEFINE_list("kernels", ["ggml", "xla"], "Matmul backends to compare, each a sj.load kernels=: "
                  "auto | ggml | xla | pallas | reference; ggml:avx2 / ggml:avx512: ggml with that instruction "
                  "set's multi-row kernels.")
flags.DEFINE_list("llama_cpu_variants", ["auto"], "llama.cpp CPU backend variants to run: auto (its own pick) "
                  "and / or variant names of its libggml-cpu-<name>.so (haswell: AVX2).")
flags.DEFINE_list("repacks", ["auto"], "Matrix layouts to compare, each a sj.load repack=: auto | none | int8.")


def rss_anon_gib() -> float | None:
    """This process's resident anonymous memory (Linux /proc), GiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _prompt(engine, n: int, fixture_dir: Path | None) -> list[int]:
    """The fixture's long prompt tokens (repeated to n), or a deterministic id sequence."""
    ids: list[int] = []
    if fixture_dir is not None and (fixture_dir / "references.json").exists():
        ref = json.loads((fixture_dir / "references.json").read_text())
        ids = max((v["tokens"][-1] for v in ref["variants"].values()), key=len)
    if not ids:
        ids = [int(i) for i in np.random.default_rng(0).integers(0, engine.config.n_vocab, n)]
    return (ids * (n // len(ids) + 1))[:n]


def load_ours(path: Path, n_prompt: int, fixture_dir: Path | None, repack: str | None = "auto",
              kernels: str = "auto", n_decode: int = 3) -> tuple[object, list[int], dict]:
    """(engine, prompt ids, {load_s, warmup_s, held_gib, backends (matrices per backend),
    read_mib_per_token, floor_mib_per_token, rss_anon_gib}): loaded and warmed up (prefill buckets and
    decode compiled by one generate call of `n_decode` tokens, after which RssAnon is read)."""
    import sharpi_jax as sj
    from sharpi_jax.model.footprint import backend_summary, decode_floor_bytes, decode_read_bytes, held_bytes

    backend, isa = _split_kernels(kernels)
    use_isa(isa)
    key = (str(path), repack, backend)
    if key in _ENGINES:  # the same engine under another instruction set
        engine, ids, info = _ENGINES[key]
        return engine, ids, {**info, "kernels": kernels, "isa": isa_name() if backend == "ggml" else None}
    t = time.perf_counter()
    engine = sj.load(path, max_context=FLAGS.max_context, kernels=backend, repack=repack)
    load_s = time.perf_counter() - t
    footprint = {"held_gib": sum(held_bytes(engine.model).values()) / 2**30,
                 "backends": backend_summary(engine.matrix_backends),
                 "read_mib_per_token": decode_read_bytes(engine.model, engine.gguf, engine.config) / 2**20,
                 "floor_mib_per_token": decode_floor_bytes(engine.gguf, engine.config) / 2**20}
    ids = _prompt(engine, n_prompt, fixture_dir)
    t = time.perf_counter()
    engine.generate(ids, max_new_tokens=max(3, n_decode), stop_on_eos=False)  # compiles prefill and decode
    info = {"load_s": load_s, "warmup_s": time.perf_counter() - t,
            "kernels": engine.matrix_format.backend + (f":{isa}" if isa else ""),
            "isa": isa_name() if backend == "ggml" else None, "rss_anon_gib": rss_anon_gib(), **footprint}
    _ENGINES[key] = (engine, ids, info)
    return engine, ids, info


_ENGINES: dict[tuple, tuple] = {}


def _split_kernels(kernels: str) -> tuple[str, str | None]:
    """'ggml:avx2' -> ('ggml', 'avx2'); 'xla' -> ('xla', None)."""
    backend, _, isa = kernels.partition(":")
    if isa and backend != "ggml":
        raise ValueError(f"--kernels={kernels}: an instruction set applies to the ggml backend only (ggml:{isa})")
    if isa and isa not in ("avx2", "avx512"):
        raise ValueError(f"--kernels={kernels}: the instruction set is avx2 or avx512, got {isa!r}")
    return backend, isa or None


def use_isa(isa: str | None) -> None:
    """The ggml backend's multi-row kernels from now on: `isa`'s, or (None) the process's own (the best this
    CPU runs, unless SHARPI_GGML_ISA picked another)."""
    from sharpi_jax.quant import ggml

    if not ggml.available():
        return
    _PROCESS_ISA.setdefault("isa", ggml.multirow_isa() or "best")
    if not ggml.set_multirow_isa(isa or _PROCESS_ISA["isa"]):
        raise ValueError(f"this CPU cannot run the {isa} multi-row kernels (ggml.multirow_isa() here: "
                         f"{ggml.multirow_isa() or 'none'})")


_PROCESS_ISA: dict[str, str] = {}


def isa_name() -> str | None:
    from sharpi_jax.quant import ggml

    return (ggml.multirow_isa() or None) if ggml.available() else None


def bench_ours(models: list[tuple[str, Path, Path | None, int, int, str | None, str]], repeats: int,
               variants: dict[str, str]) -> tuple[list[dict], dict[tuple, dict]]:
    """Every model loaded and warmed up, then `repeats` interleaved rounds (each model once per round):
    one record per model with prefill / decode tok/s and the process CPU seconds of a call as median,
    _min, _max, _runs (experiments.timing), and RssAnon after its load + warm-up with its growth over
    the previous configuration's (rss_anon_added_gib). With llama-bench (--llama_bin), each round also
    runs it once per distinct (file, prompt, decode) (`-r 1`), so that both engines see the same load:
    {(path, prompt tokens, decode tokens): llama.cpp record with the same spread keys}."""
    loaded = []
    rss_before = rss_anon_gib()
    for name, path, fixture_dir, n_prompt, n_decode, repack, kernels in models:
        engine, ids, info = load_ours(path, n_prompt, fixture_dir, repack, kernels, n_decode)
        if info["rss_anon_gib"] is not None and rss_before is not None:
            info["rss_anon_added_gib"] = info["rss_anon_gib"] - rss_before
        rss_before = info["rss_anon_gib"]
        print(f"  {name} [{info['kernels']}]: loaded in {info['load_s']:.1f}s, warm-up {info['warmup_s']:.1f}s",
              file=sys.stderr, flush=True)
        loaded.append((engine, ids, n_decode, info))

    side = []
    if llama_cpp_side.find_tool(FLAGS.llama_bin, llama_cpp_side.BENCH_TOOL) is not None:
        side = list(dict.fromkeys((str(m[1]), len(c[1]), c[2], v) for m, c in zip(models, loaded)
                                  for v in variants))

    def run(cell):
        if isinstance(cell[0], str):  # llama-bench, one repetition
            path, n_prompt, n_decode, variant = cell
            return llama_cpp_side.prefill_decode(Path(path), [0] * n_prompt, n_decode, threads=FLAGS.threads,
                                                 llama_bin=variants[variant], repetitions=1)
        engine, ids, n_decode, info = cell
        use_isa(_split_kernels(info["kernels"])[1])
        c0 = time.process_time()
        out = engine.generate(ids, max_new_tokens=n_decode, stop_on_eos=False)
        return out, time.process_time() - c0

    results = interleaved(loaded + side, run, repeats, warmup=False, what="models",
                          log=lambda m: print(m, file=sys.stderr, flush=True))
    llama = {}
    for key, recs in zip(side, results[len(loaded):]):
        bad = [r for r in recs if not r or "error" in r]
        if bad:
            llama[key] = bad[0]
            continue
        llama[key] = {"source": "llama-bench", "interleaved": True}
        for k in ("prefill_tok_s", "decode_tok_s", "cpu_s"):
            put_spread(llama[key], k, [r[k] for r in recs])
    results = results[:len(loaded)]
    rss = rss_anon_gib()  # every engine still loaded
    rows = []
    for (engine, ids, _, info), timed in zip(loaded, results):
        outs = [o for o, _ in timed]
        row = {**info, "rss_anon_gib_all_loaded": rss, "prompt_tokens": len(ids), "decode_tokens": len(outs[0].tokens),
               "repeats": repeats,
               "ids": ids}
        put_spread(row, "prefill_tok_s", [o.stats.speed.prefill_tok_s for o in outs])
        put_spread(row, "decode_tok_s", [o.stats.speed.decode_tok_s for o in outs])
        put_spread(row, "cpu_s_per_call", [c for _, c in timed])
        rows.append(row)
    use_isa(None)
    return rows, llama, [c[0] for c in loaded]


def llama_variants() -> dict[str, str]:
    """{--llama_cpu_variants entry: the bin directory that runs it}, entries this build lacks left out
    (with a warning)."""
    if not FLAGS.llama_bin:
        return {"auto": None}  # the runners then say there is no llama-bench
    out = {}
    for v in FLAGS.llama_cpu_variants:
        d = llama_cpp_side.cpu_variant_bin(FLAGS.llama_bin, v)
        if d is None:
            logging.warning("llama.cpp at %s has no CPU variant %r (no libggml-cpu-%s.so): left out",
                            FLAGS.llama_bin, v, v)
        else:
            out[v] = d
    return out


def bench_widths(models, engines, rows, variants: dict[str, str]) -> list[dict]:
    """Per thread count: --repeats rounds, each timing every configuration's w-row passes (median of 3 calls
    per w, experiments.pass_timing; with --vec_dot_beside also with the multi-row kernels off) and then
    llama-bench -p w -n 0 -r 3 once per file and --llama_cpu_variants entry; records per configuration and
    w with median / min / max over rounds of our chain pass and llama.cpp's batch ms (every configuration
    on a file shares that file's llama.cpp figures)."""
    from experiments.pass_timing import pass_timing

    widths = sorted({1, *(int(w) for w in FLAGS.widths)})
    cores = sorted(os.sched_getaffinity(0))
    files = list(dict.fromkeys(str(m[1]) for m in models))
    out = []
    for t in (int(x) for x in FLAGS.width_threads):
        ours, head1, vd = ([{w: [] for w in widths} for _ in models] for _ in range(3))
        experts = [{} for _ in models]
        llama = {f: {v: {w: [] for w in widths} for v in variants} for f in files}
        err = {}
        for rnd in range(FLAGS.repeats):
            for i, (engine, row) in enumerate(zip(engines, rows)):
                os.sched_setaffinity(0, cores[:t])
                use_isa(_split_kernels(row["kernels"])[1])
                try:
                    recs = pass_timing(engine, row["ids"], widths, 3)
                    if FLAGS.vec_dot_beside:
                        from sharpi_jax.quant import ggml

                        ggml.set_multirow(False)
                        try:
                            for r in pass_timing(engine, row["ids"], widths, 3):
                                vd[i][r["rows"]].append(r["chain_ms"])
                        finally:
                            ggml.set_multirow(True)
                finally:
                    os.sched_setaffinity(0, cores)
                    use_isa(None)
                for r in recs:
                    ours[i][r["rows"]].append(r["chain_ms"])
                    head1[i][r["rows"]].append(r["chain_head1_ms"])
                    experts[i][r["rows"]] = r.get("experts_per_pass")
            for f in files:
                for v, bin_dir in variants.items():
                    lc = llama_cpp_side.batch_pass_ms(Path(f), widths, threads=t, llama_bin=bin_dir)
                    if "error" in lc:
                        err[f] = lc["error"]
                    else:
                        for w in widths:
                            llama[f][v][w].append(float(np.median(lc[w])))
            print(f"  widths threads={t}: round {rnd + 1}/{FLAGS.repeats}", file=sys.stderr, flush=True)
        for i, (model, row) in enumerate(zip(models, rows)):
            f = str(model[1])
            for w in widths:
                rec = {"model": model[0], "kernels": row["kernels"], "threads": t, "rows": w,
                       "experts_per_pass": experts[i][w]}
                put_spread(rec, "pass_ms", ours[i][w])
                rec["pass_over_decode"] = rec["pass_ms"] / float(np.median(ours[i][1]))
                put_spread(rec, "pass_head1_ms", head1[i][w])
                rec["pass_head1_over_decode"] = rec["pass_head1_ms"] / float(np.median(ours[i][1]))
                if vd[i][w]:
                    put_spread(rec, "vec_dot_pass_ms", vd[i][w])
                    rec["vec_dot_over_decode"] = rec["vec_dot_pass_ms"] / float(np.median(vd[i][1]))
                for j, (v, lw) in enumerate(llama[f].items()):
                    if lw[w]:
                        pre = "llama" if j == 0 else f"llama_{v}"
                        put_spread(rec, f"{pre}_ms", lw[w])
                        rec[f"{pre}_over_1"] = rec[f"{pre}_ms"] / float(np.median(lw[1]))
                        rec[f"{pre}_variant"] = v
                if "llama_ms" not in rec and f in err:
                    rec["llama_error"] = err[f]
                out.append(rec)
    return out


def print_widths(recs: list[dict]) -> None:
    print("\none trunk pass of w rows (different tokens per row) vs one decode step, beside llama.cpp's batch of "
          "w tokens (llama-bench -p w -n 0) on the same file; median [min-max] ms of interleaved rounds. ours: the "
          "LM head on every row; 1 head row: the trunk and row 0's head over the decode step (the device loop's "
          "lazy pass that rejects its first draft; llama-bench -p w computes one row's logits too)")
    hdr = (f"{'model':30s} {'kernels':>7s} {'thr':>3s} {'w':>3s} {'ours ms [min-max]':>24s} {'ours/1 row':>10s} "
           f"{'1 head row':>10s} {'experts/pass':>12s} {'llama.cpp ms [min-max]':>24s} {'llama/1 row':>11s} "
           f"{'ours/llama':>10s}")
    print(hdr)
    print("-" * len(hdr))
    for r in recs:
        lc = (f"{fmt_spread(r['llama_ms_runs'], 24, 1)} {r['llama_over_1']:11.2f} {r['pass_ms'] / r['llama_ms']:10.2f}"
              if "llama_ms" in r else f"  ({r.get('llama_error', 'no llama-bench')[:50]})")
        ex = f"{r['experts_per_pass']:12.1f}" if r.get("experts_per_pass") is not None else f"{'-':>12s}"
        print(f"{r['model']:30s} {r['kernels']:>7s} {r['threads']:>3d} {r['rows']:>3d} "
              f"{fmt_spread(r['pass_ms_runs'], 24, 1)} {r['pass_over_decode']:10.2f} {r['pass_head1_over_decode']:10.2f} "
              f"{ex} {lc}")
        for k in r:
            if k.startswith("llama_") and k.endswith("_variant") and k != "llama_variant":
                pre = k[:-len("_variant")]
                print(f"{'':30s} {'':>7s} {'':>3s} {'':>3s} {'':>24s} {'':>10s} {'':>10s} {'':>12s} "
                      f"{fmt_spread(r[pre + '_ms_runs'], 24, 1)} {r[pre + '_over_1']:11.2f} "
                      f"{r['pass_ms'] / r[pre + '_ms']:10.2f}   (llama.cpp CPU variant {r[k]})")
        if "vec_dot_pass_ms" in r:
            print(f"{'':30s} {'vec_dot':>7s} {'':>3s} {'':>3s} {fmt_spread(r['vec_dot_pass_ms_runs'], 24, 1)} "
                  f"{r['vec_dot_over_decode']:10.2f}   (multi-row kernels off, same rounds)")


def bench_llama_cpp(path: Path, ids: list[int], n_decode: int, llama_bin: str | None) -> dict | None:
    """llama.cpp prefill / decode figures on the same file and prompt (`llama_cpp_side`)."""
    return llama_cpp_side.prefill_decode(path, ids, n_decode, threads=FLAGS.threads, n_ctx=FLAGS.max_context,
                                         llama_bin=llama_bin)


def _models() -> list[tuple[str, Path, Path | None, int, int, str | None, str]]:
    from experiments.presets import resolve_model

    models = []
    if FLAGS.models:
        for m in FLAGS.models:
            path = resolve_model(m)
            fixture_dir = path.parent if (path.parent / "references.json").exists() else None
            models.append((Path(m).stem if m.endswith(".gguf") else m, path, fixture_dir, FLAGS.prompt_tokens,
                           FLAGS.decode_tokens))
        return _with_layouts(models)
    fixtures = Path(FLAGS.fixtures)
    for d in sorted(p for p in fixtures.glob("tiny-*") if p.is_dir()):
        for g in sorted(d.glob("*.gguf")):
            models.append((g.stem, g, d, FLAGS.prompt_tokens, FLAGS.decode_tokens))
    if not models:
        logging.warning("no fixture GGUFs under %s", fixtures)
    if FLAGS.synthetic:
        path = Path(FLAGS.synthetic_path)
        if not path.exists():
            from sharpi_jax.config import qwen36_35b_a3b
            from sharpi_jax.testing import write_synthetic_gguf

            path.parent.mkdir(parents=True, exist_ok=True)
            print(f"writing {path} (once; reused after) ...", file=sys.stderr, flush=True)
            tmp = path.with_suffix(".partial")
            write_synthetic_gguf(tmp, qwen36_35b_a3b(n_layer=4), qtype="Q4_K", seed=0, progress=True)
            tmp.rename(path)
        models.append(("synthetic-35B-A3B-4L-Q4_K", path, None, FLAGS.synthetic_prompt_tokens,
                       FLAGS.synthetic_decode_tokens))
    if FLAGS.only:
        models = [m for m in models if re.search(FLAGS.only, m[1].name)]
    return _with_layouts(models)


def _with_layouts(models):
    """Every model once per --repacks entry (named `model[repack]` when there are several) and per
    --kernels entry (the kernels column), kernels innermost so that backends sit side by side."""
    repacks = [None if r == "none" else r for r in FLAGS.repacks]
    out = []
    for name, *rest in models:
        for r in repacks:
            for k in FLAGS.kernels:
                out.append((name if len(repacks) == 1 else f"{name}[{r or 'none'}]", *rest, r, k))
    return out


@reports_bad_input
def main(argv) -> int:
    del argv
    line_buffered()
    logging.set_verbosity(logging.WARNING)
    rows = []
    header = (f"{'model':34s} {'kernels':>7s} {'prefill tok/s [min-max]':>26s} {'decode tok/s [min-max]':>24s} "
              f"{'cpu s/call':>10s} {'held GiB':>8s} {'MiB/token (floor)':>18s} {'RssAnon GiB (+)':>15s}   "
              f"{'llama.cpp prefill':>17s} {'decode':>8s}   {'ours/llama.cpp prefill':>22s} {'decode':>7s}")
    try:  # the --kernels entries, checked before any model loads
        for k in FLAGS.kernels:
            use_isa(_split_kernels(k)[1])
        use_isa(None)
    except ValueError as e:
        return fail(e)
    models = _models()
    if not models:
        return fail("no model to bench (no fixtures found, --nosynthetic, or --only matched nothing)")
    variants = llama_variants()  # once: each entry mirrors the bin directory (and warns if it is missing)
    ours_rows, llama, engines = bench_ours(models, FLAGS.repeats, variants)
    width_recs = bench_widths(models, engines, ours_rows, variants) if FLAGS.widths else []
    from experiments.bandwidth import copy_bandwidth

    bw = copy_bandwidth()
    print(f"copy bandwidth (512 MiB, numpy, 1 thread): {bw['median']:.2f} GB/s [{bw['min']:.2f}-{bw['max']:.2f}]; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(header)
    print("-" * len(header))
    names = list(variants) or ["auto"]  # the first is the one the table's ratios use
    for (name, path, _, _, n_decode, _, _), ours in zip(models, ours_rows):
        ids = ours.pop("ids")
        key = (str(path), len(ids), n_decode, names[0])
        if key not in llama:  # once per file, whatever our layouts
            llama[key] = bench_llama_cpp(path, ids, n_decode, variants.get(names[0], FLAGS.llama_bin))
        ref = llama[key]
        lc = ""
        if ref and "error" not in ref:
            r_pre = ours["prefill_tok_s"] / ref["prefill_tok_s"]
            r_dec = ours["decode_tok_s"] / ref["decode_tok_s"]
            lc = f"{ref['prefill_tok_s']:17.1f} {ref['decode_tok_s']:8.2f}   {r_pre:22.2f} {r_dec:7.2f}"
        elif ref:
            lc = f"  ({ref['error'][:60]})"
        mem = f"{ours['read_mib_per_token']:.0f} ({ours['floor_mib_per_token']:.0f})"
        digits = lambda k: 0 if ours[k] >= 100 else 1 if ours[k] >= 10 else 2  # noqa: E731
        rss = (f"{ours['rss_anon_gib']:.2f} (+{ours['rss_anon_added_gib']:.2f})"
               if "rss_anon_added_gib" in ours else "n/a")
        print(f"{name:34s} {ours['kernels']:>7s} {fmt_spread(ours['prefill_tok_s_runs'], 26, digits('prefill_tok_s'))} "
              f"{fmt_spread(ours['decode_tok_s_runs'], 24, digits('decode_tok_s'))} {ours['cpu_s_per_call']:10.2f} "
              f"{ours['held_gib']:8.2f} {mem:>18s} {rss:>15s}   {lc}", flush=True)
        others = {v: llama.get(key[:3] + (v,)) for v in names[1:]}
        for v, other in others.items():
            if other and "error" not in other:
                print(f"{'':34s} {'':>7s} {'':>26s} {'':>24s} {'':>10s} {'':>8s} {'':>18s} {'':>15s}   "
                      f"{other['prefill_tok_s']:17.1f} {other['decode_tok_s']:8.2f}   "
                      f"{ours['prefill_tok_s'] / other['prefill_tok_s']:22.2f} "
                      f"{ours['decode_tok_s'] / other['decode_tok_s']:7.2f}   (llama.cpp CPU variant {v})")
        row = {"model": name, "path": str(path), **ours, "llama_cpp": ref, "llama_cpp_variant": names[0],
               "llama_cpp_other_variants": others, "copy_gb_s": bw["median"],
               "load_avg": os.getloadavg()[0], "file_gib": path.stat().st_size / 2**30}
        rows.append(row)
        if FLAGS.jsonl:
            with open(FLAGS.jsonl, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    if width_recs:
        print_widths(width_recs)
        if FLAGS.jsonl:
            with open(FLAGS.jsonl, "a") as fh:
                for r in width_recs:
                    fh.write(json.dumps({"widths": True, **r}) + "\n")
    rss = ours_rows[0].get("rss_anon_gib_all_loaded") if ours_rows else None
    if rss is not None:
        sizes = sorted({m[1].stat().st_size for m in models})
        print(f"\nresident anonymous memory of this process after the runs, all {len(models)} engine(s) loaded: "
              f"{rss:.2f} GiB "
              f"(GGUF file size{'s' if len(sizes) > 1 else ''}: {', '.join(f'{x / 2**30:.2f}' for x in sizes)} GiB)")
        first, size = ours_rows[0], models[0][1].stat().st_size / 2**30
        print(f"after loading the first configuration ({models[0][0]}, kernels={first['kernels']}) and decoding "
              f"{max(3, models[0][4])} tokens: {first['rss_anon_gib']:.2f} GiB = {first['rss_anon_gib'] / size:.3f} x "
              f"its file ({size:.2f} GiB; 1.05 x file + 0.3 GiB = {1.05 * size + 0.3:.2f} GiB)")
    print(f"\n(prompt {FLAGS.prompt_tokens} tokens, {FLAGS.decode_tokens} decoded; synthetic: "
          f"{FLAGS.synthetic_prompt_tokens} / {FLAGS.synthetic_decode_tokens}; ours: median [min-max] of "
          f"{FLAGS.repeats} warm interleaved rounds, ratios of medians; {os.cpu_count()} CPU cores)")
    for (path, n_prompt, n_decode, variant), ref in llama.items():
        if ref and ref.get("interleaved"):
            print(f"llama.cpp ({variant} CPU variant) on {Path(path).name}: llama-bench -r 1 ({FLAGS.threads} threads) "
                  f"in each of the "
                  f"rounds, median [min-max] prefill {fmt_spread(ref['prefill_tok_s_runs'])}, decode "
                  f"{fmt_spread(ref['decode_tok_s_runs'], digits=2)} tok/s; process CPU s per llama-bench run "
                  f"(model load, warm-up, one {n_prompt}-token prefill, one {n_decode}-token decode): "
                  f"{fmt_spread(ref['cpu_s_runs'], digits=2)}")
    return 0


if __name__ == "__main__":
    app.run(main)
