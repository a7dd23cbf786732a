"""Aggregate decode throughput of batched generation (`Engine.generate_batch`) for B parallel sequences,
beside llama.cpp's `llama-batched-bench` on the same file and threads.

    python -m experiments.bench_batch --gguf=/work/slice/s35-Q4_K_M.gguf --batches=1,2,4,8,16 \
        --llama_bin=../shared/llama.cpp/bin [--speculative=none,mtp] [--repeats=3]

Ours: B different prompts of --prompt_tokens tokens (consecutive windows of the held-out corpus), each
decoding exactly --decode_tokens tokens (no EOS stop, as llama-batched-bench), MTP off (and the MTP
chain with --speculative=mtp); the figure is all sequences' tokens over the batch's decode time
(`out.stats.batch.decode_tok_s`), warm, the median of --repeats interleaved rounds with min and max.
llama.cpp: `llama-batched-bench -npp P -ntg N -npl B -t T` once per round (its S_TG: B * N over the
decode time), interleaved with ours. Printed: tok/s per B, each side's ratio to its B = 1, and ours /
llama.cpp; --json_out writes the records. Timings only; nothing here is a test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import app, flags

from experiments import llama_cpp_side
from experiments.timing import fmt_spread, interleaved, line_buffered, spread

FLAGS = flags.FLAGS
REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "experiments" / "data" / "perplexity" / "stdlib.txt"


def define_flags() -> None:
    flags.DEFINE_string("gguf", None, "GGUF to bench (default: the embedded default model).")
    flags.DEFINE_list("batches", ["1", "2", "4", "8", "16"], "Parallel sequences B.")
    flags.DEFINE_list("speculative", ["none"], "none and/or mtp (the MTP chain, --draft_tokens drafts).")
    flags.DEFINE_integer("draft_tokens", 3, "MTP chain drafts per pass.", lower_bound=1)
    flags.DEFINE_integer("prompt_tokens", 32, "Tokens of each prompt.", lower_bound=1)
    flags.DEFINE_integer("decode_tokens", 32, "Tokens each sequence decodes.", lower_bound=2)
    flags.DEFINE_integer("repeats", 3, "Timed rounds, interleaved (median, min, max).", lower_bound=1)
    flags.DEFINE_integer("threads", 2, "llama.cpp threads (ours: the XLA CPU client's, set by the machine).")
    flags.DEFINE_string("llama_bin", None, "llama.cpp bin directory with llama-batched-bench.")
    flags.DEFINE_string("json_out", None, "Write the records here.")


def prompts_from_corpus(tokenizer, n: int, length: int) -> list[list[int]]:
    """n different prompts of `length` tokens: consecutive windows of the held-out corpus."""
    ids = tokenizer.encode(CORPUS.read_text(encoding="utf-8"))
    if len(ids) < n * length:
        raise SystemExit(f"the corpus has {len(ids)} tokens, fewer than {n} prompts of {length}")
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def main(argv) -> int:
    del argv
    line_buffered()
    import sharpi_jax as sj

    batches = sorted({int(b) for b in FLAGS.batches})
    modes = [None if m == "none" else m for m in FLAGS.speculative]
    if any(m not in (None, "mtp") for m in modes):
        raise app.UsageError("--speculative takes none and/or mtp")
    P, N = FLAGS.prompt_tokens, FLAGS.decode_tokens
    engine = sj.load(FLAGS.gguf, max_context=P + N + FLAGS.draft_tokens + 8)
    path = Path(engine.path)
    print(f"{path.name}: {engine.config.arch}, B = {batches}, prompts of {P} tokens, {N} decoded each; "
          f"backends {engine.generate_batch(['x'], max_new_tokens=2)[0].stats.backends.counts}")
    prompts = prompts_from_corpus(engine.tokenizer, max(batches), P)
    cells = [(m, b) for m in modes for b in batches] + (["llama"] if FLAGS.llama_bin else [])

    def run(cell, n=N):
        if cell == "llama":
            return llama_cpp_side.batched_decode_tok_s(path, batches, n_prompt=P, n_decode=N, threads=FLAGS.threads,
                                                       llama_bin=FLAGS.llama_bin)
        mode, b = cell
        outs = engine.generate_batch(prompts[:b], max_new_tokens=n, stop_on_eos=False, speculative=mode,
                                     draft_tokens=FLAGS.draft_tokens)
        assert all(len(o.tokens) == n for o in outs)
        return outs[0].stats.batch.decode_tok_s

    res = interleaved(cells, run, FLAGS.repeats, warm=lambda c: None if c == "llama" else run(c, N),
                      what="batch runs")
    ours = {c: r for c, r in zip(cells, res) if c != "llama"}
    llama = res[-1] if FLAGS.llama_bin else []
    errors = [r["error"] for r in llama if "error" in r]
    if errors:
        print(f"llama.cpp: {errors[0]}", file=sys.stderr)
    records = []
    for mode in modes:
        base = spread(ours[(mode, batches[0])])["median"]
        lbase = None
        print(f"\nspeculative={mode or 'off'}: aggregate decode tok/s, median [min-max] of {FLAGS.repeats} rounds")
        print(f"{'B':>3} | {'ours tok/s':>22} | {'ours/B1':>7} | {'llama.cpp tok/s':>22} | {'llama/B1':>8} | "
              f"{'ours/llama':>10}")
        for b in batches:
            vals = ours[(mode, b)]
            med = spread(vals)["median"]
            lv = [r[b] for r in llama if b in r]
            lmed = spread(lv)["median"] if lv else None
            if lbase is None and lmed is not None:
                lbase = lmed
            rec = {"speculative": mode, "B": b, "ours_tok_s": vals, "ours_median": med, "ours_vs_B1": med / base,
                   "llama_tok_s": lv, "llama_median": lmed,
                   "llama_vs_B1": None if lmed is None or mode else lmed / lbase,
                   "ours_vs_llama": None if lmed is None or mode else med / lmed}
            records.append(rec)
            lcol = fmt_spread(lv, 22) if lv and mode is None else f"{'-':>22}"
            print(f"{b:>3} | {fmt_spread(vals, 22)} | {med / base:>7.2f} | {lcol} | "
                  f"{rec['llama_vs_B1'] or float('nan'):>8.2f} | {rec['ours_vs_llama'] or float('nan'):>10.2f}")
    if FLAGS.json_out:
        Path(FLAGS.json_out).write_text(json.dumps({"gguf": str(path), "prompt_tokens": P, "decode_tokens": N,
                                                    "records": records}, indent=1))
    engine.close()
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
