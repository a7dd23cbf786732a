"""What the generation loops return (`Generation`, `GenerateOutput`) and the timing stats they all report
(`timing_stats`); the loops themselves: `strategies`."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from sharpi_jax.runtime.stats import GenerateStats


class Generation(NamedTuple):
    """What every generation loop returns: the generated token ids (not the prompt) and the run's stats."""

    tokens: list[int]
    stats: dict[str, Any]


@dataclasses.dataclass
class GenerateOutput:
    """tokens/text: the generated part only (not the prompt; text leaves a final end-of-generation token
    out); stats: timings and counts, grouped (`stats.GenerateStats`; `stats.to_dict()`: the flat dict)."""

    tokens: list[int]
    text: str
    stats: GenerateStats


def timing_stats(n_prompt: int, n_out: int, t0: float, t1: float, t2: float, stop: str) -> dict[str, Any]:
    """The stats every generation loop reports: prefill from t0 to t1, decode from t1 to t2."""
    prefill_s, decode_s = t1 - t0, t2 - t1
    return {
        "prompt_tokens": n_prompt,
        "generated_tokens": n_out,
        "prefill_s": prefill_s,
        "prefill_tok_s": n_prompt / prefill_s if prefill_s > 0 else float("inf"),
        "decode_s": decode_s,
        "decode_tok_s": n_out / decode_s if decode_s > 0 and n_out else 0.0,
        "stop_reason": stop,
    }
