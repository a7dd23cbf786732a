"""Synthetic GGUF writer: a valid model of any ModelConfig with random weights, for tests and benchmarks.

The tensor list comes from `model_tensor_specs(config)` (the same table the loader validates against),
so a synthetic file has exactly the names and shapes llama.cpp's loader expects (spec section 2).
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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from sharpi_jax.config import ModelConfig
from sharpi_jax.errors import InputError
from sharpi_jax.gguf.tensor_specs import TensorSpec, model_tensor_specs

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


def _as_qtype(qtype: str | int | Q) -> Q:
    if isinstance(qtype, Q):
        return qtype
    if isinstance(qtype, str):
        try:
            return Q[qtype.upper()]
        except KeyError:
            raise InputError(f"unknown ggml type {qtype!r}") from None
    return Q(int(qtype))


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


def _tensor_type(spec: TensorSpec, qtype: Q, expert_qtype: Q) -> Q:
    """The block type of a tensor, falling back like llama-quantize where rows don't fit the block."""
    if spec.float_only:
        return Q.F32
    want = expert_qtype if spec.is_expert else qtype
    row = spec.shape[-1]
    for candidate in (want, Q.Q8_0, Q.F16):
        block = GGML_QUANT_SIZES[candidate][0]
        if row % block == 0:
            return candidate
    return Q.F32


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
) -> Path:
    """Write a valid GGUF of `config` (any arch, any shape, with its MTP block) with random weights.

    qtype: block type of the 2-D+ weight matrices (rows that don't fit its block fall back to Q8_0,
    F16 or F32, as llama-quantize does); expert_qtype: type of routed experts (default: qtype).
    Norms, router, conv, ssm_a and dt bias are F32 as in converter output. Returns the path.
    """
    qtype, expert_qtype = _as_qtype(qtype), _as_qtype(expert_qtype if expert_qtype is not None else qtype)
    for t in (qtype, expert_qtype):
        if t not in SYNTHETIC_TYPES:
            raise InputError(f"synthetic writer cannot generate ggml type {t.name} "
                             f"(supported: {', '.join(sorted(x.name for x in SYNTHETIC_TYPES))})")
    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, merges, token_types = vocab if vocab is not None else byte_level_vocab(config.n_vocab)
    if len(tokens) != config.n_vocab:
        raise InputError(f"vocab has {len(tokens)} tokens but config.n_vocab = {config.n_vocab}")
    eos = tokens.index("<|endoftext|>") if "<|endoftext|>" in tokens else config.n_vocab - 1

    w = GGUFWriter(path, config.arch)
    w.add_name(name)
    for key, value in config.to_metadata().items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_string(key, str(value))
    w.add_full_attention_interval(4)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_eos_token_id(eos)
    w.add_pad_token_id(eos)
    w.add_add_bos_token(False)
    w.add_quantization_version(2)

    plan = []
    for spec in model_tensor_specs(config):
        if not spec.required and not (spec.name == "output.weight" and not tied_embeddings) \
                and not spec.name.endswith("shared_head_norm.weight"):
            continue
        t = _tensor_type(spec, qtype, expert_qtype)
        block, type_size = GGML_QUANT_SIZES[t]
        nbytes = int(np.prod(spec.shape, dtype=np.int64)) // block * type_size
        plan.append((spec, t, nbytes))
        if t in FLOAT_TYPES:
            np_dtype = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.uint8}[t]
            if t == Q.BF16:
                w.add_tensor_info(spec.name, (*spec.shape[:-1], spec.shape[-1] * 2), np.uint8, nbytes, t)
            else:
                w.add_tensor_info(spec.name, spec.shape, np.dtype(np_dtype), nbytes)
        else:
            byte_shape = (*spec.shape[:-1], spec.shape[-1] // block * type_size)
            w.add_tensor_info(spec.name, byte_shape, np.dtype(np.uint8), nbytes, t)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    iterator = plan
    if progress:
        from tqdm import tqdm

        iterator = tqdm(plan, desc=f"writing {path.name}", unit="tensor")
    for spec, t, _ in iterator:
        # Scale by fan-in so activations stay O(1) through deep random stacks.
        scale = weight_scale if spec.float_only else min(weight_scale, 1.0 / np.sqrt(spec.shape[-1]))
        if t == Q.F32:
            data = _float_values(rng, spec, config, scale)
        elif t == Q.F16:
            data = (np.float32(scale) * rng.standard_normal(spec.shape, dtype=np.float32)).astype(np.float16)
        elif t == Q.BF16:
            f = np.float32(scale) * rng.standard_normal(spec.shape, dtype=np.float32)
            data = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(*spec.shape[:-1], -1)
        else:
            data = random_blocks(rng, t, spec.shape, scale)
        w.write_tensor_data(data)
        del data
    w.close()
    return path
