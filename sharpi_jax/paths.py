"""Where sharpi-jax keeps files of its own: the cache dir ($SHARPI_CACHE, default ~/.cache/sharpi-jax)
and the calibration files saved for a model (beside it, else in the cache dir)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from sharpi_jax.errors import InputError

CACHE_ENV = "SHARPI_CACHE"


def cache_dir() -> Path:
    """$SHARPI_CACHE, default ~/.cache/sharpi-jax: synthetic models, the research model, calibration files
    of models in read-only directories."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sharpi-jax")


def calibration_paths(model_path: str | os.PathLike[str], kind: str, suffix: str) -> list[Path]:
    """Where a calibration file of `kind` for a model lives: beside it, then in the cache dir
    (cache_dir()/kind, keyed by file name and size, for models in read-only directories)."""
    p = Path(model_path)
    size = p.stat().st_size if p.exists() else 0
    return [Path(str(p) + suffix), cache_dir() / kind / f"{p.name}-{size}{suffix}"]


def save_json(data: Any, targets: Sequence[Path], what: str) -> Path:
    """Writes `data` as JSON to the first writable target (atomically: a .partial file renamed)."""
    err = None
    for t in targets:
        try:
            t.parent.mkdir(parents=True, exist_ok=True)
            tmp = t.with_name(t.name + ".partial")
            tmp.write_text(json.dumps(data))
            tmp.replace(t)
            return t
        except OSError as e:
            err = e
    raise InputError(f"cannot save {what} ({list(targets)}): {err}")
