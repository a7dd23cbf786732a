"""The research model: trained routing shaped like the real family where placement cares.

    python -m experiments.research_model              # build once (a few minutes on 2 cores), print the path
    python -m experiments.research_model --rebuild    # train again
    python -m experiments.research_model --time_budget_s=S [--config=PRESET] [--train_flags=--steps=N,...]

64 routed experts, top-8, a shared expert and an MTP block on the tiny model's trunk (4 layers GGGA,
hidden 128), trained by `experiments.train_tiny --config=configs/train/research.json` on the same corpus
(with its load-balance aux loss) for the preset's 600 steps whatever the machine's speed (~7 min on 2 cores),
so every machine builds the same model up to float rounding (a wall-clock budget, --time_budget_s=S,
compresses the LR schedule to fit and stops early: how far it gets depends on the machine and its load),
exported as GGUF and quantized to Q8_0 by the project's writer. Cached under
$SHARPI_CACHE/research/<hash of the recipe>/ (default ~/.cache/sharpi-jax): a later call returns the cached file.
Also the model preset "research" (`experiments.presets.resolve_model("research")`, e.g.
`bench_residency --model=research`). Too large to ship (5.3 MiB at Q8_0).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from absl import app, flags

from experiments.presets import REPO_ROOT, cache_dir

PRESET = REPO_ROOT / "configs" / "train" / "research.json"
TIME_BUDGET_S = 0.0  # none: the preset's steps (builds before 2026-12-02 stopped at 360 s)
SEED = 0
GGUF_NAME = "tiny-trained-Q8_0.gguf"  # what train_tiny exports


def research_dir(preset: Path = PRESET, time_budget_s: float = TIME_BUDGET_S, seed: int = SEED,
                 train_flags: Sequence[str] = ()) -> Path:
    """The cache folder of one recipe (preset contents, time budget, seed, extra train_tiny flags)."""
    recipe = f"|{time_budget_s}|{seed}".encode() + (f"|{' '.join(train_flags)}".encode() if train_flags else b"")
    return cache_dir() / "research" / hashlib.sha256(Path(preset).read_bytes() + recipe).hexdigest()[:12]


def research_model_path(build: bool = True, rebuild: bool = False, time_budget_s: float = TIME_BUDGET_S,
                        preset: Path = PRESET, train_flags: Sequence[str] = ()) -> Path:
    """The research model's Q8_0 GGUF, trained and cached on first use (build=False: only if cached).
    train_flags: extra `experiments.train_tiny` flags (e.g. "--steps=2" for a smoke test)."""
    out = research_dir(preset, time_budget_s, SEED, train_flags)
    path = out / GGUF_NAME
    if path.exists() and not rebuild:
        return path
    if not build:
        raise FileNotFoundError(f"{path} is not built: run python -m experiments.research_model")
    partial = out.with_name(out.name + ".partial")
    cmd = [sys.executable, "-m", "experiments.train_tiny", f"--config={preset}", f"--out_dir={partial}",
           f"--time_budget_s={time_budget_s}", f"--seed={SEED}", "--sample_tokens=32", *train_flags]
    print("building the research model:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    partial.rename(out)
    return path


FLAGS = flags.FLAGS
flags.DEFINE_bool("rebuild", False, "Train again even if the model is cached.")
flags.DEFINE_float("time_budget_s", TIME_BUDGET_S, "Training wall-clock budget in seconds, 0: none, the preset's "
                   "steps (the default: the same model on every machine). Part of the cache key.")
flags.DEFINE_string("config", str(PRESET), "Training preset (part of the cache key).")
flags.DEFINE_list("train_flags", [], "Extra experiments.train_tiny flags, e.g. --train_flags=--steps=2,--seq_len=32 "
                  "(part of the cache key).")


def main(argv) -> None:
    del argv
    print(research_model_path(rebuild=FLAGS.rebuild, time_budget_s=FLAGS.time_budget_s, preset=Path(FLAGS.config),
                              train_flags=FLAGS.train_flags))


if __name__ == "__main__":
    app.run(main)
