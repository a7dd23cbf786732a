"""The GGUF layer: mmap'd reader, ggml block dequantization, tokenizer, model-tensor table."""

from sharpi_jax.gguf.reader import GGUFFile, TensorInfo, open_gguf
from sharpi_jax.gguf.tensor_specs import (EXPERT_MATRICES, TensorSpec, expert_qtypes, expert_raw, model_tensor_specs,
                                         validate_tensors)


def read_model_config(f: GGUFFile, validate: bool = True):
    """The ModelConfig of an open GGUF, checked against the file's own tensors."""
    from sharpi_jax.config import ModelConfig

    config = ModelConfig.from_metadata(f.metadata, source=f.source)
    config = config.replace(tied_embeddings="output.weight" not in f.tensors)
    if validate:
        validate_tensors(config, {t.name: t.shape for t in f}, f.source)
    return config


__all__ = ["EXPERT_MATRICES", "GGUFFile", "TensorInfo", "TensorSpec", "expert_qtypes", "expert_raw",
           "model_tensor_specs", "open_gguf", "read_model_config", "validate_tensors"]
