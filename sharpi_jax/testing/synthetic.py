"""Synthetic GGUF writer: a valid model of any ModelConfig with random weights, for tests and benchmarks.

The tensor list comes from `model_tensor_specs(config)` (the same table the loader validates against),
so a synthetic file has exactly the names and shapes llama.cpp's loader expects.
Tensors are generated and written one at a time (streaming), so writing a 35B-A3B-shaped file needs
memory for its largest tensor only. Quantized tensors are random *valid blocks* (random quant fields,
sane scale fields), which is much faster than quantizing random floats and exercises every bit of
the block format. Synthetic models are for speed and memory work, never for correctness.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from sharpi_jax.config import ModelConfig
from sharpi_jax.errors import InputError
from sharpi_jax.gguf.tensor_specs import TensorSpec
from sharpi_jax.gguf.writer import FILE_TYPE, as_qtype, model_tensor_plan, write_model_gguf

Q = GGMLQuantizationType

# Per block type: offsets of its scale fields and the scale value that gives weights of std ~ s.
# (f16 fields: "d"-like multipliers; the "min"-like fields are set relative to d so values centre.)
# Layouts follow ggml-common.h; see gguf/quants.py for the same offsets.
_F16_SCALE_FIELDS: dict[Q, tuple[tuple[int, float], ...]] = {
    # type: ((byte offset of an f16 field, multiplier of s), ...)
    Q.Q4_0: ((0, 1 / 4),),
    Q.Q4_1: ((0, 1 / 8), (2, -1.0)),
    Q.Q5_0: ((0, 1 / 8),),
    Q.Q5_1: ((0, 1 / 16), (2, -1.0)),
    Q.Q8_0: ((0, 1 / 64),),
    Q.Q2_K: ((80, 1 / 16), (82, 1 / 16)),
    Q.Q3_K: ((108, 1 / 64),),
    Q.Q4_K: ((0, 1 / 256), (2, 1 / 64)),
    Q.Q5_K: ((0, 1 / 512), (2, 1 / 64)),
    Q.Q6_K: ((208, 1 / 2048),),
    Q.IQ4_NL: ((0, 1 / 64),),
    Q.IQ4_XS: ((0, 1 / 2048),),
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
SYNTHETIC_TYPES = frozenset(FLOAT_TYPES) | frozenset(_F16_SCALE_FIELDS) | {Q.MXFP4}


def random_blocks(rng: np.random.Generator, qtype: Q, shape: Sequence[int], scale: float) -> np.ndarray:
    """Random valid blocks of `qtype` for a tensor of numpy shape `shape`, as uint8 [..., row bytes]."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise InputError(f"row length {shape[-1]} is not a multiple of the {qtype.name} block size {block}")
    n_blocks = int(np.prod(shape, dtype=np.int64)) // block
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype == Q.MXFP4:
        # E8M0 shared exponent: 2^(e-127) x e2m1 values (|v| <= 6) -> keep weights around `scale`.
        e = 127 + int(np.round(np.log2(scale / 3)))
        raw[:, 0] = rng.integers(e - 1, e + 2, size=n_blocks, dtype=np.uint8)
    else:
        for offset, mult in _F16_SCALE_FIELDS[qtype]:
            base = abs(scale * mult)
            d = (base * rng.uniform(0.5, 1.5, size=n_blocks)).astype(np.float16)
            raw[:, offset:offset + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block * type_size)


def _override(spec: TensorSpec, t: Q, overrides: Sequence[tuple[str, str | int | Q]]) -> Q:
    """`t`, or the first override whose name part is in the tensor's name (quantized tensors only, and
    only where the rows fit the new type's block)."""
    if t in FLOAT_TYPES:
        return t
    for pattern, new in overrides:
        new = as_qtype(new)
        if f".{pattern}." in f".{spec.name}." and spec.shape[-1] % GGML_QUANT_SIZES[new][0] == 0:
            if new not in SYNTHETIC_TYPES:
                raise InputError(f"synthetic writer cannot generate ggml type {new.name}")
            return new
    return t


def _float_values(rng: np.random.Generator, spec: TensorSpec, c: ModelConfig, scale: float) -> np.ndarray:
    """Plausible float32 values for a tensor llama.cpp keeps in F32 (norms, gates, conv, ssm_a...)."""
    name, shape = spec.name, spec.shape
    if name.endswith("ssm_a"):
        return -np.exp(rng.uniform(-1.0, 1.0, size=shape)).astype(np.float32)  # -exp(A_log)
    if name.endswith("ssm_dt.bias"):
        return rng.uniform(-1.0, 0.5, size=shape).astype(np.float32)
    if name.endswith("ssm_norm.weight"):
        return rng.uniform(0.8, 1.2, size=shape).astype(np.float32)  # used as stored, no +1
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)  # stored as 1 + w
    if name.endswith("ssm_conv1d.weight"):
        return (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(c.ssm_conv_kernel)))
    return np.float32(scale) * rng.standard_normal(shape, dtype=np.float32)


def byte_level_vocab(n_vocab: int, merges_corpus: str | None = None) -> tuple[list[str], list[str], list[int]]:
    """A GPT-2 byte-level vocab of exactly `n_vocab` tokens (bytes, merges, <|endoftext|>, padding)."""
    from sharpi_jax.gguf import tokenizer as tok

    corpus = merges_corpus if merges_corpus is not None else _DEFAULT_CORPUS
    return tok.train_byte_level_bpe([corpus], vocab_size=n_vocab)


_DEFAULT_CORPUS = (
    "def main(argv):\n    import os\n    import sys\n    for name in sorted(os.listdir(argv[1])):\n"
    "        if name.endswith('.py'):\n            print(name)\n    return 0\n\n\n"
    "class Config:\n    def __init__(self, name, value=None):\n        self.name = name\n"
    "        self.value = value\n\n    def __repr__(self):\n        return f'Config({self.name!r})'\n"
) * 4


def write_synthetic_gguf(
    path: str | os.PathLike[str],
    config: ModelConfig,
    qtype: str | int | Q = "Q8_0",
    seed: int = 0,
    *,
    expert_qtype: str | int | Q | None = None,
    weight_scale: float = 0.02,
    vocab: tuple[list[str], list[str], list[int]] | None = None,
    name: str = "sharpi-synthetic",
    tied_embeddings: bool = False,
    progress: bool = False,
    type_overrides: Sequence[tuple[str, str | int | Q]] = (),
) -> Path:
    """Write a valid GGUF of `config` (any arch, any shape, with its MTP block) with random weights.

    qtype: block type of the 2-D+ weight matrices (rows that don't fit its block fall back to Q8_0,
    F16 or F32, as llama-quantize does); expert_qtype: type of routed experts (default: qtype).
    type_overrides: (name part, type) pairs, first match wins, for quantized tensors whose rows fit that
    type's block (a llama-quantize mix such as Q4_K_M); a name part is whole dot-separated fields of
    the tensor name ("attn_v", "blk.2.ffn_down_exps", "output.weight" but not "blk.3.attn_output.weight").
    Norms, router, conv, ssm_a and dt bias are F32 as in converter output. Returns the path.
    """
    qtype, expert_qtype = as_qtype(qtype), as_qtype(expert_qtype if expert_qtype is not None else qtype)
    for t in (qtype, expert_qtype):
        if t not in SYNTHETIC_TYPES:
            raise InputError(f"synthetic writer cannot generate ggml type {t.name} "
                             f"(supported: {', '.join(sorted(x.name for x in SYNTHETIC_TYPES))})")
    path = Path(path)
    rng = np.random.default_rng(seed)
    vocab = vocab if vocab is not None else byte_level_vocab(config.n_vocab)
    plan = model_tensor_plan(config, qtype, expert_qtype, tied_embeddings=tied_embeddings)
    plan = [(spec, _override(spec, t, type_overrides)) for spec, t in plan]

    def data(spec: TensorSpec, t: Q) -> np.ndarray:
        # Scale by fan-in so activations stay O(1) through deep random stacks.
        scale = weight_scale if spec.float_only else min(weight_scale, 1.0 / np.sqrt(spec.shape[-1]))
        if t == Q.F32:
            return _float_values(rng, spec, config, scale)
        if t == Q.F16:
            return (np.float32(scale) * rng.standard_normal(spec.shape, dtype=np.float32)).astype(np.float16)
        if t == Q.BF16:
            f = np.float32(scale) * rng.standard_normal(spec.shape, dtype=np.float32)
            return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(*spec.shape[:-1], -1)
        return random_blocks(rng, t, spec.shape, scale)

    return write_model_gguf(path, config, vocab, plan, data, name=name, file_type=FILE_TYPE.get(qtype),
                            progress=progress)
