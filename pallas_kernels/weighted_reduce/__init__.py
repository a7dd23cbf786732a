"""Top-k weighted reduce of expert outputs in rank order, plus a shared term.

- `reference`: the pure-jnp definition (also what the XLA dispatch paths call).
- `kernel`: the Pallas kernel (Triton on GPU, `interpret=True` on CPU).
"""

from .kernel import weighted_reduce
from .reference import weighted_reduce_reference

__all__ = ["weighted_reduce", "weighted_reduce_reference"]
