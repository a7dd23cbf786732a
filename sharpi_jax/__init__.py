"""sharpi-jax: JAX research inference for hybrid Gated-DeltaNet / MoE / MTP models (Qwen3.5/3.6 GGUF).

    import sharpi_jax as sj
    engine = sj.load("model.gguf")      # or sj.load() for the embedded default model
    out = engine.generate("def fib(n):", sj.GenerateOptions(max_new_tokens=64, speculation=sj.Chain(k=3)))

The option and result types are importable from here; the ones that need jax load on first use.
"""

from sharpi_jax.config import ModelConfig, RunConfig
from sharpi_jax.errors import (GGUFError, InputError, SharpiError, UnsupportedArchitectureError,
                               UnsupportedQuantError)

__version__ = "0.1.0"

# name -> the module that defines it (imported when the name is first used: jax starts there).
_LAZY = {
    "Engine": "sharpi_jax.api", "Session": "sharpi_jax.api",
    "GenerateOptions": "sharpi_jax.runtime.options", "Chain": "sharpi_jax.runtime.options",
    "Tree": "sharpi_jax.runtime.options",
    "SamplingParams": "sharpi_jax.runtime.sampling",
    "SnapKV": "sharpi_jax.model.snapkv",
    "ExpertResidency": "sharpi_jax.experts.residency.options",
    "GenerateOutput": "sharpi_jax.runtime.generate", "GenerateStats": "sharpi_jax.runtime.stats",
}


def load(path=None, **options):
    """Load a GGUF (default: the embedded model) into an Engine. See `sharpi_jax.api.load`."""
    from sharpi_jax.api import load as _load

    return _load(path, **options)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib  # pylint: disable=import-outside-toplevel

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sharpi_jax' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__all__ = ["Chain", "Engine", "ExpertResidency", "GGUFError", "GenerateOptions", "GenerateOutput", "GenerateStats",
           "InputError", "ModelConfig", "RunConfig", "SamplingParams", "Session", "SharpiError", "SnapKV", "Tree",
           "UnsupportedArchitectureError", "UnsupportedQuantError", "load"]
