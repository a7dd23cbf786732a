"""Prefill and decode tokens/s: every fixture GGUF, plus a synthetic 35B-A3B-shaped 4-layer Q4_K model.

    python -m experiments.bench_decode [--prompt_tokens=128] [--decode_tokens=64] [--llama_bin=PATH]

Our figures are taken after a warm-up run (jit compilation excluded). llama.cpp's figures are printed
beside ours when llama-cpp-python is importable (same GGUF, same prompt, 2 threads) or when
--llama_bin names a llama.cpp bin directory with `llama-bench`, with the ratios ours / llama.cpp.
Timings only; nothing here is a test.
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

FLAGS = flags.FLAGS
REPO = Path(__file__).resolve().parents[1]
flags.DEFINE_string("fixtures", str(REPO.parent / "shared" / "fixtures"), "Fixture directory.")
flags.DEFINE_string("only", None, "Regex: bench only the GGUFs whose file name matches.")
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
flags.DEFINE_integer("threads", 2, "llama.cpp threads.")
flags.DEFINE_string("jsonl", None, "Also append one JSON line per model here.")


def _prompt(engine, n: int, fixture_dir: Path | None) -> list[int]:
    """The fixture's long prompt tokens (repeated to n), or a deterministic id sequence."""
    ids: list[int] = []
    if fixture_dir is not None and (fixture_dir / "references.json").exists():
        ref = json.loads((fixture_dir / "references.json").read_text())
        ids = max((v["tokens"][-1] for v in ref["variants"].values()), key=len)
    if not ids:
        ids = [int(i) for i in np.random.default_rng(0).integers(0, engine.config.n_vocab, n)]
    return (ids * (n // len(ids) + 1))[:n]


def bench_ours(path: Path, n_prompt: int, n_decode: int, fixture_dir: Path | None) -> dict:
    import sharpi_jax as sj

    t = time.perf_counter()
    engine = sj.load(path, max_context=FLAGS.max_context)
    load_s = time.perf_counter() - t
    ids = _prompt(engine, n_prompt, fixture_dir)
    t = time.perf_counter()
    engine.generate(ids, max_new_tokens=3, stop_on_eos=False)  # compiles the prefill buckets and decode
    compile_s = time.perf_counter() - t
    out = engine.generate(ids, max_new_tokens=n_decode, stop_on_eos=False)
    s = out.stats
    return {"load_s": load_s, "warmup_s": compile_s, "prefill_tok_s": s["prefill_tok_s"],
            "decode_tok_s": s["decode_tok_s"], "prompt_tokens": len(ids), "decode_tokens": len(out.tokens),
            "ids": ids}


def bench_llama_cpp(path: Path, ids: list[int], n_decode: int) -> dict | None:
    """llama.cpp prefill / decode figures on the same file and prompt (`llama_cpp_side`)."""
    return llama_cpp_side.prefill_decode(path, ids, n_decode, threads=FLAGS.threads, n_ctx=FLAGS.max_context,
                                         llama_bin=FLAGS.llama_bin)


def _models() -> list[tuple[str, Path, Path | None, int, int]]:
    models = []
    fixtures = Path(FLAGS.fixtures)
    for d in sorted(p for p in fixtures.glob("tiny-*") if p.is_dir()):
        for g in sorted(d.glob("*.gguf")):
            models.append((g.stem, g, d, FLAGS.prompt_tokens, FLAGS.decode_tokens))
    if not models:
        logging.warning("no fixture GGUFs under %s", fixtures)
    if FLAGS.synthetic:
        try:
            from sharpi_jax.testing import write_synthetic_gguf
        except ImportError:
            write_synthetic_gguf = None
        if write_synthetic_gguf is not None:
            path = Path(FLAGS.synthetic_path)
            if not path.exists():
                from sharpi_jax.config import qwen36_35b_a3b

                path.parent.mkdir(parents=True, exist_ok=True)
                print(f"writing {path} ...", file=sys.stderr)
                write_synthetic_gguf(path, qwen36_35b_a3b(n_layer=4), qtype="Q4_K", seed=0)
            models.append(("synthetic-35B-A3B-4L-Q4_K", path, None, FLAGS.synthetic_prompt_tokens,
                           FLAGS.synthetic_decode_tokens))
    if FLAGS.only:
        models = [m for m in models if re.search(FLAGS.only, m[1].name)]
    return models


def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)
    rows = []
    header = (f"{'model':34s} {'prefill tok/s':>14s} {'decode tok/s':>13s}   {'llama.cpp prefill':>17s} "
              f"{'decode':>8s}   {'ours/llama.cpp prefill':>22s} {'decode':>7s}")
    print(header)
    print("-" * len(header))
    for name, path, fixture_dir, n_prompt, n_decode in _models():
        ours = bench_ours(path, n_prompt, n_decode, fixture_dir)
        ids = ours.pop("ids")
        ref = bench_llama_cpp(path, ids, n_decode)
        lc = ""
        if ref and "error" not in ref:
            r_pre = ours["prefill_tok_s"] / ref["prefill_tok_s"]
            r_dec = ours["decode_tok_s"] / ref["decode_tok_s"]
            lc = f"{ref['prefill_tok_s']:17.1f} {ref['decode_tok_s']:8.1f}   {r_pre:22.2f} {r_dec:7.2f}"
        elif ref:
            lc = f"  ({ref['error'][:60]})"
        print(f"{name:34s} {ours['prefill_tok_s']:14.1f} {ours['decode_tok_s']:13.1f}   {lc}", flush=True)
        row = {"model": name, "path": str(path), **ours, "llama_cpp": ref}
        rows.append(row)
        if FLAGS.jsonl:
            with open(FLAGS.jsonl, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    print(f"\n(prompt {FLAGS.prompt_tokens} tokens, {FLAGS.decode_tokens} decoded; synthetic: "
          f"{FLAGS.synthetic_prompt_tokens} / {FLAGS.synthetic_decode_tokens}; ours after a warm-up, "
          f"{os.cpu_count()} CPU cores)")
    return 0


if __name__ == "__main__":
    app.run(main)
