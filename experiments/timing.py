"""Warm, interleaved repeats and their spread: the timing discipline every sweep and benchmark shares.

A grid of configurations A, B, C is timed as: one unrecorded warm-up run of each (jit compilation and
first-touch costs never land in a figure), then `repeats` rounds A B C, A B C, ... so that a change in
machine load (a shared 2-core machine is never quiet) hits every configuration alike instead of
favouring whichever ran in a quiet spell. Each figure is then reported as the median over the rounds
with its min and max beside it (`<key>`, `<key>_min`, `<key>_max`, and `<key>_runs`, the per-round values
in round order), so that a reader can tell an effect from noise.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, Sequence


def line_buffered() -> None:
    """Flush stdout at every line, so progress shows when the output is piped (`| tee log`)."""
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except (AttributeError, ValueError):
        pass


def spread(values: Sequence[float]) -> dict[str, float]:
    """{"median", "min", "max"} of the values (an empty sequence gives NaNs)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        nan = float("nan")
        return {"median": nan, "min": nan, "max": nan}
    return {"median": float(statistics.median(vals)), "min": min(vals), "max": max(vals)}


def put_spread(record: dict[str, Any], key: str, values: Sequence[float], runs: bool = True) -> dict[str, Any]:
    """record[key] = median, record[key_min], record[key_max] (and record[key_runs] = the values)."""
    s = spread(values)
    record[key], record[f"{key}_min"], record[f"{key}_max"] = s["median"], s["min"], s["max"]
    if runs:
        record[f"{key}_runs"] = [float(v) for v in values]
    return record


def fmt_spread(values: Sequence[float], width: int = 0, digits: int = 1) -> str:
    """'median [min-max]', right-aligned to width."""
    s = spread(values)
    txt = f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"
    return f"{txt:>{width}}"


def interleaved(cells: Sequence[Any], run: Callable[[Any], Any], repeats: int, *, warmup: bool = True,
                warm: Callable[[Any], Any] | None = None, log: Callable[[str], None] | None = None,
                what: str = "runs") -> list[list[Any]]:
    """Run every cell once unrecorded (warm-up, with `warm` when given: e.g. a shorter run that still
    compiles every shape), then `repeats` rounds each running every cell once, in order. Returns
    results[cell][round]. `log` (default: stderr) gets a line after the warm-up and after each round,
    with the elapsed time, and one every ~10 s within a long warm-up."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    say = log if log is not None else (lambda m: print(m, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    n = len(cells)
    if warmup:
        last = t0
        for i, cell in enumerate(cells):
            (warm or run)(cell)
            now = time.perf_counter()
            if now - last > 10 and i + 1 < n:  # compiling many shapes: say how far it got
                say(f"  warm-up {i + 1}/{n} {what}, {now - t0:.0f}s elapsed")
                last = now
        say(f"  warm-up: {n} {what} in {time.perf_counter() - t0:.1f}s (compilation excluded from the figures)")
    results: list[list[Any]] = [[] for _ in cells]
    for r in range(repeats):
        for i, cell in enumerate(cells):
            results[i].append(run(cell))
        say(f"  round {r + 1}/{repeats}: {n} {what}, {time.perf_counter() - t0:.1f}s elapsed")
    return results
