"""Weight memory and bytes read per decoded token: what a loaded model holds, against the file's floor.

`held_bytes(model)` sums the device arrays by kind (matrices per QTensor layout, embedding, routed
experts, vectors). `decode_read_bytes(model)` is what one decoded token reads with this model's
layouts: every non-expert matrix whole, one embedding row, and top-k experts per MoE layer (the
grouped dispatch reads each selected expert once). `decode_floor_bytes(f, config)` is the same count
in the file's own encoding: the least any engine reading these weights must move per token.
`matrix_backends(model, backend)` is the backend each matrix runs on (and why, where the selected
backend does not serve it); `backend_summary` counts them.
"""

from __future__ import annotations

from collections import Counter

import jax
import numpy as np
from flax import nnx

from sharpi_jax.config import ModelConfig
from sharpi_jax.gguf.reader import GGUFFile
from sharpi_jax.quant import QTensor
from sharpi_jax.quant import registry


def _nbytes(tree) -> int:
    return int(sum(np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


def held_bytes(model: nnx.Module) -> dict[str, int]:
    """Device bytes of `model`'s params by kind: "matrix:<layout>", "embedding", "experts", "vectors"."""
    out: Counter = Counter()
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value() if hasattr(var, "get_value") else var
        if "experts" in path:
            out["experts"] += _nbytes(value)
        elif isinstance(value, QTensor):
            out["embedding"] += value.nbytes
        elif isinstance(value, tuple) and value and isinstance(value[0], QTensor):
            for p in value:
                out[f"matrix:{p.layout}"] += p.nbytes
        else:
            out["vectors"] += _nbytes(value)
    return dict(out)


def _expert_bytes_per_expert(f: GGUFFile, layer: int) -> int:
    total = 0
    for name, t in f.tensors.items():
        if name.startswith(f"blk.{layer}.") and "_exps." in name:
            total += t.nbytes // t.shape[0]
    return total


def decode_floor_bytes(f: GGUFFile, c: ModelConfig) -> int:
    """Bytes of the file's own encoding one trunk decode step reads (MTP block excluded)."""
    total = 0
    trunk = {f"blk.{i}." for i in range(c.n_layer)}
    for name, t in f.tensors.items():
        if name == "token_embd.weight":
            total += t.nbytes // t.shape[0]  # one row
        elif "_exps." in name:
            continue
        elif name.startswith("blk.") and name[:name.index(".", 4) + 1] not in trunk:
            continue  # the MTP block
        else:
            total += t.nbytes
    if "output.weight" not in f.tensors:  # tied head: the whole table is read by the head
        total += f.tensor("token_embd.weight").nbytes
    if c.is_moe:
        total += sum(c.n_expert_used * _expert_bytes_per_expert(f, i) for i in range(c.n_layer))
    return total


def decode_read_bytes(model: nnx.Module, f: GGUFFile, c: ModelConfig) -> int:
    """Bytes one trunk decode step reads with `model`'s layouts (experts: top-k per layer)."""
    held = held_bytes(model)
    matrices = sum(v for k, v in held.items() if k.startswith("matrix:"))
    embed = model.embed.table.get_value()
    row = embed.nbytes // embed.shape[0]
    experts = sum(c.n_expert_used * _expert_bytes_per_expert(f, i) for i in range(c.n_layer)) if c.is_moe else 0
    return matrices + held.get("vectors", 0) + row + experts


def _path_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def matrix_backends(model: nnx.Module, backend: str) -> dict[str, dict]:
    """Every matrix a step multiplies by, with the backend it runs on (the one that laid its QTensor out,
    `QTensor.kernels`) when `backend` (resolved) is selected: {name: {"type", "shape", "backend", "why"}}.
    Names are param paths (a fused projection of several ggml types is several matrices, suffixed [i]);
    a routed-expert stack is one entry per layer and matrix kind, with one expert's shape. "why" says
    why a matrix is not on `backend` (`Backend.why_not`; an expert stack whose own type is served falls
    back with its layer's other stacks: one grouped op computes all three); None when it is."""
    selected = registry.get(backend)
    out: dict[str, dict] = {}
    stacks: dict[tuple, dict[str, QTensor]] = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value() if hasattr(var, "get_value") else var
        if "experts" in path:
            if isinstance(value, QTensor) and len(value.shape) == 3:
                stacks.setdefault(path[:-1], {})[str(path[-1])] = value
            continue
        if not (isinstance(value, tuple) and value and isinstance(value[0], QTensor)):
            continue  # (a bare QTensor is the embedding table: a row gather, not a product)
        for i, q in enumerate(value):
            name = _path_name(path) + (f"[{i}]" if len(value) > 1 else "")
            why = selected.why_not(q.qtype, q.shape) if q.kernels != backend else None
            out[name] = {"type": q.ggml_type.name, "shape": tuple(q.shape), "backend": q.kernels, "why": why}
    for parent, mats in stacks.items():
        reasons = {w: selected.why_not(q.qtype, q.shape) for w, q in mats.items()}
        bad = ", ".join(f"ffn_{w}_exps" for w, r in reasons.items() if r)
        for w, q in mats.items():
            why = None if q.kernels == backend else (reasons[w] or f"its layer's {bad} fall back (one grouped op)")
            out[f"{_path_name(parent)}.{w}"] = {"type": q.ggml_type.name, "shape": tuple(q.shape[1:]),
                                               "backend": q.kernels, "why": why}
    return out


def backend_summary(backends: dict[str, dict]) -> dict[str, int]:
    """Matrices per backend, e.g. {"pallas": 61, "reference": 2}."""
    return dict(Counter(v["backend"] for v in backends.values()))


def fallback_message(backends: dict[str, dict], selected: str) -> str | None:
    """One line naming every matrix not on the `selected` backend, with its type and why; None if none."""
    off = {k: v for k, v in backends.items() if v["backend"] != selected}
    if not off:
        return None
    items = ", ".join(f"{k} ({v['type']} {v['shape'][0]}x{v['shape'][1]} on {v['backend']}: {v['why']})"
                      for k, v in off.items())
    return f"kernels={selected!r}: {len(off)} of {len(backends)} matrices fall back: {items}"
