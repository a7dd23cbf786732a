"""Explicit state, jitted steps (prefill / decode / verify / commit), sampling and the generation loop."""

from sharpi_jax.runtime.generate import GenerateOutput
from sharpi_jax.runtime.sampling import SamplingParams, sample
from sharpi_jax.runtime.state import DecodeState, Snapshots, init_state
from sharpi_jax.runtime.steps import Runtime
from sharpi_jax.runtime.strategies.plain import generate_ids

__all__ = ["DecodeState", "GenerateOutput", "Runtime", "SamplingParams", "Snapshots", "generate_ids",
           "init_state", "sample"]
