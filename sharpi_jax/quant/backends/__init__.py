"""The built-in kernel backends, one module each, registered here (`sharpi_jax.quant.registry`).

A new backend is one module beside these and one `register` line below (or a `register` call from
outside the package). "ggml", for instance, wants the "blocks" layout (the file's bytes, uint8
[..., rows, row_bytes]) for every type it serves, runs its products through its native kernels, ranks
above "xla" on "cpu" (`auto`) where its extension loaded, falls back to "xla" for the types it does not
serve, and supplies its grouped expert op (`expert_rows`, replacing the per-expert matmuls).
"""

from sharpi_jax.quant.backends.ggml import GgmlBackend
from sharpi_jax.quant.backends.pallas import PallasBackend
from sharpi_jax.quant.backends.reference import ReferenceBackend
from sharpi_jax.quant.backends.xla import XlaBackend
from sharpi_jax.quant.registry import register

register(GgmlBackend())
register(XlaBackend())
register(PallasBackend())
register(ReferenceBackend())
