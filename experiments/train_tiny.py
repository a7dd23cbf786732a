"""Train the tiny qwen35moe + MTP model on the stdlib's Python sources and export it as GGUF.

    python -m experiments.train_tiny                 # a quick run: 300 steps, at most ~3 minutes of training
    python -m experiments.train_tiny --full          # the preset's 1600 steps: the shipped model's recipe
    python -m experiments.train_tiny [--config=configs/train/tiny.json] [--steps=N] [--out_dir=DIR]
                                     [--seed=0] [--time_budget_s=S] [--install]

Prints the loss curve (train loss, next-token CE, MTP CE, router balance, tokens/s; val CE, MTP CE
and the MTP/trunk top-1 agreement every eval_every steps), writes <out_dir>/train_log.jsonl and
<out_dir>/summary.json, exports <out_dir>/tiny-trained-F32.gguf and -Q8_0.gguf, and prints a greedy
continuation of a Python prompt by the inference engine. With --install, copies the Q8_0 file to
sharpi_jax/assets/default.gguf and the F32 file to sharpi_jax/assets/default-F32.gguf (the embedded
default model).

With no --full, --install, --steps or --time_budget_s it makes a quick run: the preset's model and
data, 300 steps over a cosine schedule of 300 steps, with a 180 s training budget (on a busy machine the
schedule is compressed to fit instead of overrunning), so the whole command finishes in about 4
minutes on a 2-core CPU; a smaller, weaker model than the shipped one. --full (implied by --install)
runs the preset as it is: 1600 steps (3.3M tokens), about 12 minutes on a 2-core CPU: the shipped
model's recipe (the shipped files were written before training ran on the inference modules, the same
function up to float rounding, so a rerun is not byte-identical to them). --time_budget_s=S compresses
the learning-rate schedule to fit S seconds.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "configs/train/tiny.json", "Training preset (model, data, train).")
flags.DEFINE_integer("steps", None, "Optimizer steps (default: the preset's).")
flags.DEFINE_string("out_dir", "results/train_tiny", "Where the GGUF files and logs go.")
flags.DEFINE_integer("seed", 0, "Init and batch-order seed.")
flags.DEFINE_float("time_budget_s", None, "Stop training after this many seconds (default: the preset's; "
                   "0 = no budget). The LR schedule is compressed to fit.")
flags.DEFINE_integer("batch_size", None, "Override the preset's batch size.")
flags.DEFINE_integer("seq_len", None, "Override the preset's sequence length.")
flags.DEFINE_integer("byte_budget", None, "Override the preset's corpus size in bytes.")
flags.DEFINE_string("prompt", "def read_config(path):\n", "Prompt of the sample printed at the end.")
flags.DEFINE_integer("sample_tokens", 64, "Tokens of the sample continuation (0 = none).")
flags.DEFINE_bool("install", False, "Copy the exported files to sharpi_jax/assets (the default model); implies "
                  "--full unless --steps / --time_budget_s are given.")
flags.DEFINE_bool("full", False, "Run the preset as it is (1600 steps, ~12 min on 2 cores; the shipped model's "
                  "recipe) instead of the quick default run.")

QUICK_STEPS = 300
QUICK_BUDGET_S = 180.0


def main(argv) -> None:
    del argv
    import numpy as np

    from sharpi_jax.training import data as data_lib
    from sharpi_jax.training import trainer

    from experiments.timing import line_buffered

    line_buffered()
    t_start = time.perf_counter()
    config, data_kw, tc = trainer.load_preset(FLAGS.config)
    overrides = {k: getattr(FLAGS, k) for k in ("steps", "batch_size", "seq_len") if getattr(FLAGS, k) is not None}
    if FLAGS.time_budget_s is not None:
        overrides["time_budget_s"] = FLAGS.time_budget_s or None
    quick = not (FLAGS.full or FLAGS.install or "steps" in overrides or "time_budget_s" in overrides)
    if quick:
        overrides.update(steps=min(QUICK_STEPS, tc.steps), time_budget_s=QUICK_BUDGET_S)
    tc = dataclasses.replace(tc, **overrides)
    if FLAGS.byte_budget is not None:
        data_kw["byte_budget"] = FLAGS.byte_budget
    print(config.summary())
    print(f"train: {tc}")
    if quick:
        print(f"quick run: {tc.steps} steps, at most {tc.time_budget_s:.0f}s of training (--full: the preset's "
              "1600 steps, ~12 min on 2 cores, the shipped model's recipe)", flush=True)

    t = time.perf_counter()
    corpus = data_lib.build_corpus(**data_kw)
    print(f"corpus: {corpus.n_files[0]}+{corpus.n_files[1]} files, {corpus.n_bytes[0]:,}+{corpus.n_bytes[1]:,} "
          f"bytes -> {len(corpus.train):,} train + {len(corpus.val):,} val tokens "
          f"({corpus.n_bytes[0] / len(corpus.train):.2f} bytes/token); BPE {len(corpus.vocab[0])} tokens "
          f"in {time.perf_counter() - t:.1f}s")

    result = trainer.train(config, corpus, tc, seed=FLAGS.seed)
    last = result.history[-1]
    print(f"trained {result.steps} steps, {result.tokens:,} tokens in {result.wall_s:.0f}s "
          f"({result.tokens / result.wall_s:,.0f} tok/s incl. compile and eval)")
    print(f"final: train ce {np.mean([h['ce'] for h in result.history[-20:]]):.4f} (mean of last 20 steps), "
          f"mtp ce {np.mean([h.get('mtp_ce', np.nan) for h in result.history[-20:]]):.4f}; "
          f"val ce {last.get('val_ce', float('nan')):.4f}, val mtp ce {last.get('val_mtp_ce', float('nan')):.4f}, "
          f"val acc {last.get('val_acc', float('nan')):.3f}, mtp/trunk top-1 agreement "
          f"{last.get('val_mtp_agree', float('nan')):.3f}")

    out_dir = Path(FLAGS.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "train_log.jsonl", "w") as f:
        for h in result.history:
            f.write(json.dumps(h) + "\n")
    paths = trainer.export(out_dir, config, corpus.vocab, result.params)
    sizes = {p.name: p.stat().st_size for p in paths}
    for name, size in sizes.items():
        print(f"wrote {out_dir / name} ({size / 2**20:.2f} MiB)")

    sample = None
    if FLAGS.sample_tokens:
        import sharpi_jax as sj

        engine = sj.load(paths[-1])
        sample = engine.generate(FLAGS.prompt, max_new_tokens=FLAGS.sample_tokens).text
        print(f"--- greedy sample ({paths[-1].name}) ---\n{FLAGS.prompt}{sample}\n---")

    summary = {"config": FLAGS.config, "train": dataclasses.asdict(tc), "seed": FLAGS.seed, "steps": result.steps,
               "tokens": result.tokens, "train_wall_s": result.wall_s, "final": last, "files": sizes,
               "corpus": {"files": corpus.n_files, "bytes": corpus.n_bytes,
                          "tokens": [len(corpus.train), len(corpus.val)]},
               "prompt": FLAGS.prompt, "sample": sample, "total_wall_s": time.perf_counter() - t_start}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))

    if FLAGS.install:
        from sharpi_jax.assets import ASSETS_DIR

        shutil.copyfile(out_dir / "tiny-trained-Q8_0.gguf", ASSETS_DIR / "default.gguf")
        shutil.copyfile(out_dir / "tiny-trained-F32.gguf", ASSETS_DIR / "default-F32.gguf")
        print(f"installed {ASSETS_DIR / 'default.gguf'} and {ASSETS_DIR / 'default-F32.gguf'}")
        from sharpi_jax.runtime.draft_vocab import vocab_paths

        stale = vocab_paths(ASSETS_DIR / "default.gguf")[0]  # ranked the old model's drafts
        if stale.exists():
            stale.unlink()
            print(f"removed {stale.name} (the old model's draft ranking); ship the new one with "
                  "`python -m experiments.draft_vocab_quality --models=default --install`")
    print(f"total {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    app.run(main)
