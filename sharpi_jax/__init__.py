"""sharpi-jax: JAX research inference for hybrid Gated-DeltaNet / MoE / MTP models (Qwen3.5/3.6 GGUF).

    import sharpi_jax as sj
    engine = sj.load("model.gguf")      # or sj.load() for the embedded default model
    out = engine.generate("def fib(n):", max_new_tokens=64, speculative="mtp", draft_tokens=3)
"""

from sharpi_jax.config import ModelConfig, RunConfig
from sharpi_jax.errors import (GGUFError, InputError, SharpiError, UnsupportedArchitectureError,
                               UnsupportedQuantError)

__version__ = "0.1.0"


def load(path=None, **options):
    """Load a GGUF (default: the embedded model) into an Engine. See `sharpi_jax.api.load`."""
    from sharpi_jax.api import load as _load

    return _load(path, **options)


__all__ = ["GGUFError", "InputError", "ModelConfig", "RunConfig", "SharpiError", "UnsupportedArchitectureError",
           "UnsupportedQuantError", "load"]
