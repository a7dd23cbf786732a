"""The quantized-tensor layer under every model matrix: `QTensor` (ggml type, logical shape, layout,
arrays, backend), the kernel-backend registry (`registry`; one module per backend in `backends`) and
one `matmul` dispatched through it. See `qtensor`, `registry` and `matmul`."""

from sharpi_jax.quant import backends  # noqa: F401  (registers the built-in backends)
from sharpi_jax.quant.matmul import MatrixFormat, matmul, reference_matmul, weight_layout
from sharpi_jax.quant.qtensor import LAYOUTS, QTensor, abstract, gguf_nbytes, pack, pack_rows, zeros
from sharpi_jax.quant.registry import (Backend, ExpertOptions, get, kernel_names, names, register, resolve_kernels,
                                       unregister)

__all__ = ["Backend", "ExpertOptions", "LAYOUTS", "MatrixFormat", "QTensor", "abstract", "get", "gguf_nbytes",
           "kernel_names", "matmul", "names", "pack", "pack_rows", "reference_matmul", "register", "resolve_kernels",
           "unregister", "weight_layout", "zeros"]
