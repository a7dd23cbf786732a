"""Prompts run B at a time through `Engine.generate_batch`, for the tools that loop over prompts
(`draft_vocab_quality`; `sweep` times one cell per `groups` group).

With the ggml kernels (the CPU default) each prompt's tokens and pass stats are those of generating it
alone (`tests/runtime/test_batch.py`), so a tool's figures do not depend on B; its time does: one device
loop per group instead of one per prompt.
"""

from __future__ import annotations

from typing import Any, Sequence


def groups(n: int, batch: int) -> list[range]:
    """Indices 0..n-1 in consecutive groups of `batch` (the last may be smaller)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    return [range(i, min(i + batch, n)) for i in range(0, n, batch)]


def generate_grouped(engine, prompts: Sequence[Any], batch: int, **options: Any) -> list:
    """`engine.generate(p, **options)` for each prompt, in order, run as `generate_batch` calls of up to
    `batch` prompts (batch 1: one `generate` per prompt)."""
    if batch == 1:
        return [engine.generate(p, **options) for p in prompts]
    out = []
    for g in groups(len(prompts), batch):
        out += engine.generate_batch([prompts[i] for i in g], **options)
    return out
