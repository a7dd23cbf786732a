"""The built-in kernel backends, one module each, registered here (`sharpi_jax.quant.registry`).

A new backend is one module beside these and one `register` line below (or a `register` call from
outside the package). A "ggml" backend, for instance, would want the "blocks" layout (the file's
bytes, uint8 [..., rows, row_bytes]) for every type it serves, run its products through its native
kernels, rank above "xla" on "cpu" (`auto`), fall back to "xla" for the types it does not serve, and
set `expert_rows` to its grouped expert op (which then replaces the per-expert matmuls).
"""

from sharpi_jax.quant.backends.pallas import PallasBackend
from sharpi_jax.quant.backends.reference import ReferenceBackend
from sharpi_jax.quant.backends.xla import XlaBackend
from sharpi_jax.quant.registry import register

register(XlaBackend())
register(PallasBackend())
register(ReferenceBackend())
