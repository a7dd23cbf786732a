"""Write a model GGUF: metadata from a ModelConfig, a GGUF vocab, tensors streamed one at a time.

Used by the synthetic writer (random blocks) and by model export (trained float weights quantized with
`gguf.quants.quantize`). Tensor names and shapes come from `model_tensor_specs`, the table the loader
validates against, so whatever is written here loads in sharpi-jax and in llama.cpp.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from sharpi_jax.config import ModelConfig
from sharpi_jax.errors import InputError
from sharpi_jax.gguf.tensor_specs import TensorSpec, model_tensor_specs

Q = GGMLQuantizationType
Vocab = tuple[Sequence[str], Sequence[str], Sequence[int]]  # tokens, merges, token types

FILE_TYPE = {Q.F32: 0, Q.F16: 1, Q.Q4_0: 2, Q.Q4_1: 3, Q.Q8_0: 7, Q.Q5_0: 8, Q.Q5_1: 9, Q.Q2_K: 10,
             Q.Q3_K: 12, Q.Q4_K: 15, Q.Q5_K: 17, Q.Q6_K: 18, Q.IQ4_NL: 25, Q.IQ4_XS: 30, Q.BF16: 32,
             Q.MXFP4: 38}


def as_qtype(qtype: str | int | Q) -> Q:
    """A ggml type from its enum, id or name."""
    if isinstance(qtype, Q):
        return qtype
    if isinstance(qtype, str):
        try:
            return Q[qtype.upper()]
        except KeyError:
            raise InputError(f"unknown ggml type {qtype!r}") from None
    try:
        return Q(int(qtype))
    except ValueError:
        raise InputError(f"unknown ggml type id {qtype!r}") from None


def tensor_type(spec: TensorSpec, qtype: Q, expert_qtype: Q | None = None) -> Q:
    """The block type of a tensor, falling back like llama-quantize where rows don't fit the block.

    Norms, router, conv, ssm_a and dt bias stay F32 (the converter's and llama-quantize's rule).
    """
    if spec.float_only:
        return Q.F32
    want = expert_qtype if (spec.is_expert and expert_qtype is not None) else qtype
    for candidate in (want, Q.Q8_0, Q.F16):
        if spec.shape[-1] % GGML_QUANT_SIZES[candidate][0] == 0:
            return candidate
    return Q.F32


def model_tensor_plan(config: ModelConfig, qtype: Q, expert_qtype: Q | None = None,
                      tied_embeddings: bool = False) -> list[tuple[TensorSpec, Q]]:
    """The tensors a converter would write for `config`: required ones, the untied head, MTP head norm."""
    plan = []
    for spec in model_tensor_specs(config):
        wanted = spec.required or (spec.name == "output.weight" and not tied_embeddings) \
            or spec.name.endswith("shared_head_norm.weight")
        if wanted:
            plan.append((spec, tensor_type(spec, qtype, expert_qtype)))
    return plan


def _add_metadata(w: GGUFWriter, config: ModelConfig, vocab: Vocab, name: str, file_type: int | None) -> None:
    tokens, merges, token_types = vocab
    if len(tokens) != config.n_vocab:
        raise InputError(f"vocab has {len(tokens)} tokens but config.n_vocab = {config.n_vocab}")
    w.add_name(name)
    if file_type is not None:
        w.add_file_type(file_type)
    for key, value in config.to_metadata().items():
        if key == "general.architecture":
            continue  # GGUFWriter writes it from its arch argument
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
    eos = list(tokens).index("<|endoftext|>") if "<|endoftext|>" in tokens else config.n_vocab - 1
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(list(tokens))
    w.add_token_types(list(token_types))
    w.add_token_merges(list(merges))
    w.add_eos_token_id(eos)
    w.add_pad_token_id(eos)
    w.add_add_bos_token(False)
    w.add_quantization_version(2)


def write_model_gguf(path: str | os.PathLike[str], config: ModelConfig, vocab: Vocab,
                     plan: Iterable[tuple[TensorSpec, Q]], data_fn: Callable[[TensorSpec, Q], np.ndarray], *,
                     name: str = "sharpi-model", file_type: int | None = None, progress: bool = False) -> Path:
    """Write `config` + `vocab` + the planned tensors; `data_fn(spec, qtype)` returns each tensor's data
    (float32/float16 values for F32/F16, raw uint8 blocks otherwise), called once per tensor in order."""
    path = Path(path)
    plan = list(plan)
    w = GGUFWriter(path, config.arch)
    _add_metadata(w, config, vocab, name, file_type)
    for spec, t in plan:
        block, type_size = GGML_QUANT_SIZES[t]
        nbytes = int(np.prod(spec.shape, dtype=np.int64)) // block * type_size
        if t in (Q.F32, Q.F16):
            w.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32 if t == Q.F32 else np.float16), nbytes)
        else:
            byte_shape = (*spec.shape[:-1], spec.shape[-1] // block * type_size)
            w.add_tensor_info(spec.name, byte_shape, np.dtype(np.uint8), nbytes, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    items = plan
    if progress:
        from tqdm import tqdm

        items = tqdm(plan, desc=f"writing {path.name}", unit="tensor")
    for spec, t in items:
        data = data_fn(spec, t)
        expected = np.float32 if t == Q.F32 else np.float16 if t == Q.F16 else np.uint8
        if data.dtype != expected:
            raise InputError(f"tensor {spec.name!r}: data_fn returned {data.dtype}, expected {np.dtype(expected)}")
        w.write_tensor_data(np.ascontiguousarray(data))
        del data
    w.close()
    return path


def export_model_gguf(path: str | os.PathLike[str], config: ModelConfig, vocab: Vocab,
                      weights: dict[str, np.ndarray], qtype: str | Q = "F32", *,
                      name: str = "sharpi-model", progress: bool = False) -> Path:
    """Export float weights (GGUF names, numpy-order shapes) as a GGUF, quantized with gguf.quants."""
    from gguf import quants as gq

    qtype = as_qtype(qtype)
    plan = model_tensor_plan(config, qtype, tied_embeddings="output.weight" not in weights)
    missing = [s.name for s, _ in plan if s.name not in weights]
    if missing:
        raise InputError(f"export: weights missing for {missing[:5]}{'...' if len(missing) > 5 else ''}")

    def data(spec: TensorSpec, t: Q) -> np.ndarray:
        x = np.asarray(weights[spec.name], dtype=np.float32).reshape(spec.shape)
        if t == Q.F32:
            return x
        if t == Q.F16:
            return x.astype(np.float16)
        return gq.quantize(x, t)

    return write_model_gguf(path, config, vocab, plan, data, name=name, file_type=FILE_TYPE.get(qtype),
                            progress=progress)
