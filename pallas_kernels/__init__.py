"""Pallas kernels for sharpi-jax, each in its own folder with a pure-jnp reference beside it.

Kernels never import model code (`sharpi_jax`): they take plain arrays and static shapes.

- `grouped_matmul`: a grouped (ragged) matmul over expert groups, float32 or GGUF-quantized weights
  (Q8_0, Q4_K, Q5_K, Q6_K) dequantized inside the kernel.
- `weighted_reduce`: the top-k weighted reduce of expert outputs, in rank order, plus a shared term.
- `quant_blocks`: ggml block formats as jnp (bitwise equal to `gguf.quants`), in GGUF's raw byte
  layout and in the struct-of-arrays layouts the kernels read.

`KERNEL_TYPES`: the ggml types (lower-case names) the kernels read; what a Pallas backend serves.
"""

from .quant_blocks import KERNEL_TYPES

__all__ = ["KERNEL_TYPES"]
