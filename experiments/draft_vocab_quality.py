"""Draft-vocabulary acceptance: the chain's acceptance with draft_vocab=N beside the full head's, for the
fallback ranking and for a ranking calibrated on a disjoint corpus, on two held-out prompt sets.

    python -m experiments.draft_vocab_quality [--models=default,tiny-qwen35moe-Q8_0 --sizes=512
        --draft_tokens=3 --new_tokens=48 --oracle --out=results/draft_vocab_quality.json]
    python -m experiments.draft_vocab_quality --models=default --install   # ship the embedded model's

Held-out standard-library files: the stdlib sources the embedded model's training corpus
(`configs/train/tiny.json`'s byte budget, `training.data.corpus_selection`) did not reach, in its hash
order. The first --eval_files of them are one evaluation set ("stdlib": a middle window of each, the
embedded model's own distribution); the rest (or the next --calibration_files) are the calibration
corpus (--calibration_windows windows spread over each file, `engine.calibrate_draft_vocab`, run on a
private copy of the model since it writes beside the file). The other evaluation set ("repo": out of
domain) is `presets.PYTHON_PROMPTS` plus windows of the six frozen held-out sources of this repository
(`presets.HELD_OUT_SOURCES`). --oracle adds a ranking calibrated on the evaluation prompts themselves:
an upper bound for any frequency ranking, not a fair figure. `--install` writes the embedded model's
calibrated ranking into `sharpi_jax/assets/`, where `generate(draft_vocab=N)` finds it.

Acceptance is deterministic (greedy). Every run's tokens are checked equal to the full head's (a draft
vocabulary is lossless). Per size and set: accepted / drafted and the relative gap (full - N) / full.
The evaluation prompts run --batch at a time through `generate_batch` (`experiments.batches`): the same
tokens and figures as one prompt at a time, in one device loop per group.
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

from experiments import batches
from experiments.presets import HELD_OUT_SOURCES, PYTHON_PROMPTS, REPO_ROOT, resolve_model

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["default", "tiny-qwen35moe-Q8_0"], "Preset names or GGUF paths (with an MTP block).")
flags.DEFINE_list("sizes", ["512"], "Draft vocabulary sizes N.")
flags.DEFINE_integer("draft_tokens", 3, "Chain length k.")
flags.DEFINE_integer("new_tokens", 48, "Tokens generated per evaluation prompt.")
flags.DEFINE_integer("eval_files", 40, "Held-out stdlib files in the stdlib evaluation set (one window each).")
flags.DEFINE_integer("eval_windows", 6, "Windows of each held-out repository source in the repo set.")
flags.DEFINE_integer("eval_tokens", 48, "Tokens per evaluation window (the prompt).")
flags.DEFINE_integer("calibration_files", 0, "Held-out stdlib files in the calibration corpus (0: every one "
                     "after the evaluation files).")
flags.DEFINE_integer("calibration_windows", 6, "Windows per calibration file, spread over it.")
flags.DEFINE_integer("calibration_tokens", 128, "Tokens per calibration window.")
flags.DEFINE_integer("generate_tokens", 64, "Greedy continuation per calibration window (calibrate_draft_vocab).")
flags.DEFINE_integer("max_context", 512, "KV positions.")
flags.DEFINE_bool("oracle", False, "Also rank by a calibration on the evaluation prompts themselves (an upper bound).")
flags.DEFINE_bool("install", False, "Write the embedded model's calibrated ranking into sharpi_jax/assets/.")
flags.DEFINE_string("out", "results/draft_vocab_quality.json", "JSON output (overwritten).")
flags.DEFINE_integer("batch", 8, "Evaluation prompts per generate_batch call (1: one generate per prompt; the "
                     "figures are the same, the time is not).", lower_bound=1)

TRAIN_PRESET = REPO_ROOT / "configs" / "train" / "tiny.json"


def windows(ids: list[int], n: int, length: int) -> list[list[int]]:
    """n windows of `length` ids spread evenly over ids (fewer when ids is short)."""
    if len(ids) <= length:
        return [ids] if ids else []
    starts = sorted({round(i * (len(ids) - length) / max(n - 1, 1)) for i in range(n)})
    return [ids[s:s + length] for s in starts]


def held_out_stdlib() -> tuple[list[str], str]:
    """Texts of the stdlib files past the training corpus's byte budget, in hash order, and the stdlib dir."""
    from sharpi_jax.training.data import corpus_selection, stdlib_dir

    budget = json.loads(TRAIN_PRESET.read_text())["data"]["byte_budget"]
    trained = {p for p, _ in corpus_selection(budget)}
    return [t for p, t in corpus_selection(1 << 62) if p not in trained], str(stdlib_dir())


def prompt_sets(tokenizer) -> tuple[dict[str, list[list[int]]], list[list[int]], str]:
    """({"repo": prompts, "stdlib": prompts}, calibration windows, where the stdlib lies)."""
    texts, where = held_out_stdlib()
    n_calib = FLAGS.calibration_files or len(texts) - FLAGS.eval_files
    if n_calib < 1 or len(texts) < FLAGS.eval_files + n_calib:
        raise SystemExit(f"only {len(texts)} held-out stdlib files under {where}: lower --eval_files / "
                         "--calibration_files")
    repo = [tokenizer.encode(p) for p in PYTHON_PROMPTS]
    for rel in HELD_OUT_SOURCES:
        repo += windows(tokenizer.encode((REPO_ROOT / rel).read_text()), FLAGS.eval_windows, FLAGS.eval_tokens)
    stdlib = []
    for t in texts[:FLAGS.eval_files]:
        w = windows(tokenizer.encode(t), 3, FLAGS.eval_tokens)
        stdlib.append(w[len(w) // 2])  # a middle window: past the imports
    calib = [w for t in texts[FLAGS.eval_files:FLAGS.eval_files + n_calib]
             for w in windows(tokenizer.encode(t), FLAGS.calibration_windows, FLAGS.calibration_tokens)]
    return {"repo": repo, "stdlib": stdlib}, calib, where


def acceptance(engine, prompts: list[list[int]], draft_vocab: int | None) -> dict:
    accepted = drafted = passes = 0
    tokens = []
    for out in batches.generate_grouped(engine, prompts, FLAGS.batch, max_new_tokens=FLAGS.new_tokens,
                                        speculative="mtp", draft_tokens=FLAGS.draft_tokens, draft_vocab=draft_vocab):
        accepted += out.stats.speculation.accepted
        drafted += out.stats.speculation.drafted
        passes += out.stats.speculation.verify_passes
        tokens.append(list(out.tokens))
    return {"accepted": accepted, "drafted": drafted, "passes": passes,
            "acceptance_rate": accepted / drafted if drafted else 0.0, "tokens": tokens}


def measure(name: str, tmp: Path) -> dict:
    import sharpi_jax as sj
    from sharpi_jax.runtime import draft_vocab

    src = resolve_model(name)
    path = tmp / src.name
    shutil.copy(src, path)  # calibration writes beside the file: never beside the original
    engine = sj.load(path, max_context=FLAGS.max_context)
    if engine.mtp is None:
        raise SystemExit(f"{name}: the model has no MTP block")
    sets, calib, where = prompt_sets(engine.tokenizer)
    sizes = [int(s) for s in FLAGS.sizes]
    rec = {"model": name, "file": str(src), "draft_tokens": FLAGS.draft_tokens, "new_tokens": FLAGS.new_tokens,
           "batch": FLAGS.batch,
           "sets": {k: len(v) for k, v in sets.items()}, "results": {}}
    print(f"\n{name}: k = {FLAGS.draft_tokens}, {FLAGS.new_tokens} tokens per prompt; evaluation sets: "
          + ", ".join(f"{k} {len(v)} prompts" for k, v in sets.items()), flush=True)
    runs = {s: {"full": acceptance(engine, p, None)} for s, p in sets.items()}
    for s, p in sets.items():
        for n in sizes:
            runs[s][f"{n} fallback"] = acceptance(engine, p, n)
    t0 = time.perf_counter()
    counts = engine.calibrate_draft_vocab(calib, generate_tokens=FLAGS.generate_tokens)
    rec["calibration"] = {"corpus": where, "windows": len(calib), "window_tokens": FLAGS.calibration_tokens,
                          "generate_tokens": FLAGS.generate_tokens, "drafts_counted": int(sum(counts.values())),
                          "distinct_ids": len(counts), "seconds": round(time.perf_counter() - t0, 1)}
    print(f"  calibration: {len(calib)} held-out stdlib windows of <= {FLAGS.calibration_tokens} tokens "
          f"(+{FLAGS.generate_tokens} generated each) from {where}: {rec['calibration']['drafts_counted']:,} "
          f"correct drafts counted over {len(counts)} ids ({rec['calibration']['seconds']:.0f} s)", flush=True)
    for s, p in sets.items():
        for n in sizes:
            runs[s][f"{n} calibrated"] = acceptance(engine, p, n)
    if FLAGS.install and name == "default":
        from sharpi_jax.assets import DEFAULT_MODEL

        target = draft_vocab.vocab_paths(DEFAULT_MODEL)[0]
        data = json.loads(draft_vocab.vocab_paths(path)[0].read_text())  # what calibrate_draft_vocab saved
        data["source"] = (f"experiments.draft_vocab_quality: {len(calib)} windows of <= {FLAGS.calibration_tokens} "
                          f"tokens (+{FLAGS.generate_tokens} generated) from the held-out stdlib files of Python "
                          f"{platform.python_version()}")
        target.write_text(json.dumps(data))
        rec["installed"] = str(target)
        print(f"  installed {target}")
    if FLAGS.oracle:
        engine.calibrate_draft_vocab([q for p in sets.values() for q in p], generate_tokens=FLAGS.new_tokens)
        for s, p in sets.items():
            for n in sizes:
                runs[s][f"{n} oracle"] = acceptance(engine, p, n)
    print(f"  {'set':<7} {'draft head':<16} {'accepted/drafted':>17} {'rate':>7} {'vs full':>8} {'rel. gap':>9} "
          f"{'same tokens':>11}")
    for s, rows in runs.items():
        full = rows["full"]
        for kind, r in rows.items():
            same = r["tokens"] == full["tokens"]
            rate = full["acceptance_rate"]
            gap = (rate - r["acceptance_rate"]) / rate if rate else None  # None: the full head accepted nothing
            print(f"  {s:<7} {kind:<16} {r['accepted']:>8}/{r['drafted']:<8} {r['acceptance_rate']:>7.1%} "
                  f"{r['acceptance_rate'] - rate:>+8.1%} {'n/a' if gap is None else f'{gap:+.1%}':>9} "
                  f"{'yes' if same else 'NO':>11}")
            rec["results"].setdefault(s, {})[kind] = {**{k: v for k, v in r.items() if k != "tokens"},
                                                      "relative_gap": gap, "same_tokens": same}
            if not same:
                raise SystemExit(f"{name}: {kind} changed the output of the {s} set: a draft vocabulary is lossless")
    return rec


def main(argv):
    del argv
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in FLAGS.models:
            records.append(measure(name, Path(tmp)))
    out = Path(FLAGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"argv": sys.argv, "records": records}, indent=1))
    print(f"\nrel. gap = (full - N) / full acceptance, the same prompts and tokens. Written {out}")


if __name__ == "__main__":
    app.run(main)
