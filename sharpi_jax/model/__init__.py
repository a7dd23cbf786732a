"""Flax nnx modules of the hybrid GDN / gated-attention / MoE trunk, and the GGUF weight loader."""

from sharpi_jax.model.transformer import Block, TokenEmbedding, Transformer
from sharpi_jax.model.weights import load_block, load_model

__all__ = ["Block", "TokenEmbedding", "Transformer", "load_block", "load_model"]
