"""The quantized-tensor layer under every model matrix: `QTensor` (ggml type, logical shape, layout,
arrays) and one `matmul` with kernel backends. See `qtensor` and `matmul`."""

from sharpi_jax.quant.matmul import (BACKENDS, KERNELS, REPACKS, MatrixFormat, matmul, reference_matmul, resolve_kernels,
                                     weight_layout)
from sharpi_jax.quant.qtensor import LAYOUTS, QTensor, abstract, gguf_nbytes, pack, pack_rows

__all__ = ["BACKENDS", "KERNELS", "REPACKS", "LAYOUTS", "MatrixFormat", "QTensor", "abstract", "gguf_nbytes", "matmul", "pack", "pack_rows",
           "reference_matmul", "resolve_kernels", "weight_layout"]
