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
from sharpi_jax.testing import write_synthetic_gguf

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS_FILE = REPO_ROOT / "configs" / "models.json"
FIXTURES_DIR = REPO_ROOT.parent / "shared" / "fixtures"


def cache_dir() -> Path:
    return Path(os.environ.get("SHARPI_CACHE", Path.home() / ".cache" / "sharpi-jax"))


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
    raise InputError(f"preset {name!r} in {MODELS_FILE} has no embedded/fixture/synthetic/gguf entry")
