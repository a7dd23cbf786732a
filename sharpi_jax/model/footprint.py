"""Weight memory and bytes read per decoded token: what a loaded model holds, against the file's floor.

`held_bytes(model)` sums the device arrays by kind (matrices per QTensor layout, embedding, routed
experts, vectors). `decode_read_bytes(model)` is what one decoded token reads with this model's
layouts: every non-expert matrix whole, one embedding row, and top-k experts per MoE layer (the
grouped dispatch reads each selected expert once). `decode_floor_bytes(f, config)` is the same count
in the file's own encoding: the least any engine reading these weights must move per token.
"""

from __future__ import annotations

from collections import Counter

import jax
import numpy as np
from flax import nnx

from sharpi_jax.config import ModelConfig
from sharpi_jax.gguf.reader import GGUFFile
from sharpi_jax.quant import QTensor


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
