"""Calibrated routing counts for the "frequency" policy: taking them, saving and finding them.

Counts are per MoE layer and expert: how many (row, rank) routing pairs chose the expert over the
calibration prompts. They are saved as JSON next to the model (`<model>.gguf.expert-counts.json`), or
in the cache dir ($SHARPI_CACHE, default ~/.cache/sharpi-jax) when the model's directory is
read-only, and found there automatically at load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from sharpi_jax.config import ModelConfig
from sharpi_jax.errors import InputError, shown
from sharpi_jax.paths import calibration_paths, save_json

COUNTS_SUFFIX = ".expert-counts.json"
COUNTS_FORMAT = "sharpi-expert-counts/1"


def counts_paths(model_path: str | os.PathLike[str]) -> list[Path]:
    """Where calibrated counts for a model are looked for: beside it, then in the cache dir."""
    return calibration_paths(model_path, "expert-counts", COUNTS_SUFFIX)


def load_counts(source: Any, model_path: str | os.PathLike[str], c: ModelConfig
                ) -> tuple[dict[int, list[int]] | None, str | None]:
    """Counts {layer: [E]} from a dict, a JSON path, or (None) the default files; (None, None) if absent."""
    if isinstance(source, Mapping):
        data, where = dict(source), "<dict>"
    else:
        paths = [Path(source)] if source is not None else counts_paths(model_path)
        try:
            found = [p for p in paths if p.is_file()]
        except (OSError, ValueError):  # a name the OS refuses
            found = []
        if not found:
            if source is not None:
                raise InputError(f"expert counts file {shown(str(source))} does not exist (or is not a file)")
            return None, None
        where = str(found[0])
        try:
            data = json.loads(found[0].read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"expert counts file {shown(where, 200)}: {shown(str(e))}") from None
    try:
        layers = data.get("layers", data)
        out = {_layer(i): [_count(x) for x in v] for i, v in layers.items()}
    except (TypeError, ValueError, AttributeError, OverflowError):
        raise InputError(f"expert counts {shown(where, 200)}: expected {{'layers': {{layer: [n_expert "
                         "counts]}} with non-negative integer counts") from None
    bad = [i for i, v in out.items() if len(v) != c.n_expert]
    if bad:
        raise InputError(f"expert counts {shown(where, 200)}: layer {bad[0]} has {len(out[bad[0]])} counts, "
                         f"the model has {c.n_expert} experts")
    return out, where


def _layer(key: Any) -> int:
    """A layer index from a JSON key or int (not a bool, not negative)."""
    if isinstance(key, bool):
        raise TypeError(key)
    i = int(key)
    if i < 0:
        raise ValueError(key)
    return i


def _count(x: Any) -> int:
    """One routing count: a non-negative integer below 2**62 (an int, or an integral float from JSON)."""
    if isinstance(x, (bool, str, bytes)) or int(x) != x or not 0 <= int(x) < 2**62:
        raise ValueError(x)
    return int(x)


def save_counts(counts: Mapping[int, Sequence[int]], model_path: str | os.PathLike[str], c: ModelConfig,
                tokens: int, path: str | os.PathLike[str] | None = None) -> Path:
    """Write counts JSON beside the model (or to the cache dir when that is not writable)."""
    data = {"format": COUNTS_FORMAT, "model": Path(model_path).name, "n_expert": c.n_expert,
            "top_k": c.n_expert_used, "tokens": int(tokens),
            "layers": {str(i): [int(x) for x in v] for i, v in sorted(counts.items())}}
    return save_json(data, [Path(path)] if path is not None else counts_paths(model_path), "expert counts")


def routing_delta(before: Mapping[int, np.ndarray], after: Mapping[int, np.ndarray]) -> dict[int, list[int]]:
    """{layer: [E]} routing counts taken between two snapshots of the per-expert counters (the "counts"
    of `Residency.counters`): what `Engine.calibrate_experts` saves for the "frequency" policy."""
    return {i: [int(x) for x in np.asarray(after[i]) - np.asarray(before[i])] for i in sorted(after)}
