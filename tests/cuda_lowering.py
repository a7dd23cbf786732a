"""Lowering jitted code for CUDA on a machine without a GPU (what the GPU would compile), for tests."""

from __future__ import annotations

import jax
import numpy as np
import pytest


def lower_for_cuda(lower) -> str:
    """The StableHLO text of `lower()` (a callable returning `jitted.trace(...).lower(lowering_platforms=
    ("cuda",))`); skips the test when this jaxlib cannot lower for CUDA without a GPU."""
    try:
        return lower().as_text()
    except Exception as err:  # pragma: no cover - depends on the jaxlib build
        if "cuda" in str(err).lower() and "platform" in str(err).lower():
            pytest.skip(f"this jaxlib cannot lower for CUDA without a GPU: {err}")
        raise


def decode_step_cuda_text(engine, monkeypatch) -> str:
    """An engine's whole jitted decode step lowered for CUDA; tracing as if on a GPU switches the Pallas
    kernels out of interpret mode."""
    rt = engine.runtime
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    return lower_for_cuda(lambda: rt._fns.decode.trace(rt.params, rt.cache, rt.new_state(), np.int32(1),
                                                       np.int32(0)).lower(lowering_platforms=("cuda",)))
