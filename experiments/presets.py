"""Resolve a model name from configs/models.json (or a plain path) to a GGUF file on disk.

Synthetic presets are written on first use into the cache dir ($SHARPI_CACHE, default
~/.cache/sharpi-jax) and reused after; fixtures resolve under ../shared/fixtures.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sharpi_jax.assets import default_model_path
from sharpi_jax.config import shape_preset
from sharpi_jax.errors import InputError
from sharpi_jax.paths import cache_dir
from sharpi_jax.testing import write_synthetic_gguf

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS_FILE = REPO_ROOT / "configs" / "models.json"
FIXTURES_DIR = REPO_ROOT.parent / "shared" / "fixtures"
# Held-out Python text for routing experiments: six of this repository's sources (not in the stdlib training
# corpus), frozen as copies taken at commit 5e6cbc9 (api.py, residency/plan.py, runtime/speculative.py,
# gguf/reader.py, model/gated_delta_net.py, quant/qtensor.py), so refactors of the live files leave the
# routing / residency figures reproducible. Paths relative to REPO_ROOT.
HELD_OUT_SOURCES = tuple(f"experiments/data/held_out/{name}.py.txt" for name in (
    "api", "plan", "speculative", "reader", "gated_delta_net", "qtensor"))

# Short Python prompts: the sweeps' "python" prompt set and the draft-vocabulary evaluation's opening prompts.
PYTHON_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\nclass ",
    "    def __init__(self, name, value=None):\n        self.name = name\n",
    "def read_config(path):\n    with open(path) as f:\n",
]


# What llama-quantize's Q4_K_M makes of the 35B-A3B-shaped 4-layer slice (measured; WORKSPACE, "No silent
# fallback, and the type mix of K-quant files"): these 7 tensors Q6_K, every other matrix Q4_K. As
# `write_synthetic_gguf(..., "Q4_K", type_overrides=Q4_K_M_MIX_4L)` it writes the same types.
Q4_K_M_MIX_4L = tuple((name, "Q6_K") for name in (
    "output.weight", "blk.2.attn_qkv", "blk.2.ffn_down_exps", "blk.2.ffn_down_shexp", "blk.4.attn_v",
    "blk.4.ffn_down_exps", "blk.4.ffn_down_shexp"))


def model_presets() -> dict[str, dict]:
    return {k: v for k, v in json.loads(MODELS_FILE.read_text()).items() if not k.startswith("_")}


def resolve_model(name_or_path: str | os.PathLike[str] | None) -> Path:
    """A preset name, a GGUF path, or None (the embedded default) -> an existing GGUF path."""
    if name_or_path is None:
        return default_model_path()
    p = Path(name_or_path)
    if p.suffix == ".gguf" or p.exists():
        if not p.exists():
            raise InputError(f"GGUF file {p} does not exist")
        return p
    presets = model_presets()
    name = str(name_or_path)
    if name not in presets:
        raise InputError(f"unknown model {name!r}: not a file and not a preset in {MODELS_FILE} "
                         f"(presets: {', '.join(presets)})")
    spec = presets[name]
    if spec.get("embedded"):
        return default_model_path()
    if "gguf" in spec:
        return resolve_model(spec["gguf"])
    if spec.get("trained") == "research":
        from experiments.research_model import research_model_path

        return research_model_path()
    if "fixture" in spec:
        p = FIXTURES_DIR / spec["fixture"]
        if not p.exists():
            raise InputError(f"preset {name!r} needs the reference fixture {p}, which is absent")
        return p
    if "synthetic" in spec:
        s = spec["synthetic"]
        p = cache_dir() / "synthetic" / f"{name}-seed{s.get('seed', 0)}.gguf"
        if not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_suffix(".partial")
            write_synthetic_gguf(tmp, shape_preset(s["shape"], s.get("n_layer")), qtype=s.get("qtype", "Q8_0"),
                                 expert_qtype=s.get("expert_qtype"), seed=s.get("seed", 0), progress=True,
                                 name=name)
            tmp.rename(p)
        return p
    raise InputError(f"preset {name!r} in {MODELS_FILE} has no embedded/fixture/synthetic/gguf/trained entry")


def release_compiled_code() -> None:
    """Free what dropped engines still hold: JAX's compiled executables and the runtime's per-graph
    step-function caches (`runtime.compiled.clear_caches`). An engine closed with `Engine.close()` (or a
    `with` block) already released its own; this also covers engines merely deleted. For loops that load
    many engines one after another (bench_residency, sweeps); call after `del engine`."""
    import gc

    import jax

    from sharpi_jax.runtime import compiled

    gc.collect()
    jax.clear_caches()
    compiled.clear_caches()  # the runtime's per-graph step functions (trunk, MTP head, tree drafter)
    gc.collect()

