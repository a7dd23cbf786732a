"""Test and benchmark helpers: synthetic GGUF models of any shape."""

from sharpi_jax.testing.synthetic import random_blocks, write_synthetic_gguf

__all__ = ["random_blocks", "write_synthetic_gguf"]
