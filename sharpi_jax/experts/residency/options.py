"""The residency load options, checked where they enter (`sj.load` -> `residency.configure`).

Each option is checked for type and range before anything is planned or read, so a wrong value ends in
one `InputError` naming the option, never a raw `ValueError` from `int()` deep in the planner. Checks
that need the model (expert_staging >= top-k, budgets >= their minimum, counts of n_expert) stay with
the planner (`plan`) and the counts reader (`counts`), which also raise `InputError`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import numpy as np

from sharpi_jax.errors import InputError, shown
from sharpi_jax.experts.residency.policies import POLICIES
from sharpi_jax.experts.streaming import COLD_MODES

OPTION_NAMES = ("expert_counts", "expert_staging", "expert_ring", "expert_cold", "expert_stream_min_rows",
                "expert_prefetch", "expert_lookahead", "expert_lookahead_buffer", "expert_store", "device_budget")
# expert_lookahead: what residency fetches ahead of need (see `lookahead`): nothing, layer L+1's predicted
# experts while layer L runs, a verify pass's union streamed and kept for the pass, or both.
LOOKAHEAD_MODES = ("none", "next_layer", "pass", "both")
# expert_lookahead_buffer (experts, with "next_layer" / "both"): the predicted experts go to one buffer
# shared by the layers, charged to the budget once (`plan`); 0 or None: into each layer's ring.
# expert_store: where cold experts come from (`slots`): "callback" (the mmap's GGUF bytes through a host
# callback, laid out on the device per call), "pinned_host" (every expert of a managed layer laid out once
# at load into host memory of JAX's "pinned_host" kind, sliced and moved to the device inside the step:
# no callback, no per-step re-layout), "auto" (pinned_host on a GPU backend, callback elsewhere).
STORE_MODES = ("auto", "pinned_host", "callback")


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _int_at_least(name: str, v: Any, low: int, what: str) -> int | None:
    if v is None:
        return None
    if not _is_int(v) or v < low:
        raise InputError(f"{name} must be {what}, got {shown(v)}")
    return int(v)


def _choice(name: str, v: Any, choices: tuple) -> None:
    if not isinstance(v, str) or v not in choices:
        raise InputError(f"{name} must be one of {choices}, got {shown(v)}")


def check_policy(policy: Any) -> str:
    """expert_policy: one of POLICIES."""
    _choice("expert_policy", policy, POLICIES)
    return policy


def check_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The residency options (`OPTION_NAMES`) with types and ranges checked -> {name: value or None};
    an unknown name or a wrong value raises InputError naming it."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise InputError(f"unknown load option(s) {shown(unknown)}; residency options are {OPTION_NAMES}")
    out = {n: options.get(n) for n in OPTION_NAMES}
    out["device_budget"] = _int_at_least("device_budget", out["device_budget"], 0,
                                         "a non-negative integer number of bytes")
    out["expert_staging"] = _int_at_least("expert_staging", out["expert_staging"], 1,
                                          "a positive integer number of experts (at least top-k)")
    out["expert_stream_min_rows"] = _int_at_least("expert_stream_min_rows", out["expert_stream_min_rows"], 0,
                                                  "a non-negative integer number of rows")
    out["expert_prefetch"] = _int_at_least("expert_prefetch", out["expert_prefetch"], 0,
                                           "a non-negative integer number of experts madvise'd ahead per layer")
    out["expert_lookahead_buffer"] = _int_at_least(
        "expert_lookahead_buffer", out["expert_lookahead_buffer"], 0,
        "a non-negative integer number of experts (the lookahead's shared prefetch buffer)")
    ring = out["expert_ring"]
    if ring is not None:
        ok = isinstance(ring, (int, float, np.integer, np.floating)) and not isinstance(ring, (bool, np.bool_))
        if not ok or not math.isfinite(float(ring)) or not 0.0 <= float(ring) <= 1.0:
            raise InputError(f"expert_ring must be a fraction in [0, 1], got {shown(ring)}")
        out["expert_ring"] = float(ring)
    if out["expert_lookahead"] is not None:
        _choice("expert_lookahead", out["expert_lookahead"], LOOKAHEAD_MODES)
    if out["expert_cold"] is not None:
        _choice("expert_cold", out["expert_cold"], COLD_MODES)
    if out["expert_store"] is not None:
        _choice("expert_store", out["expert_store"], STORE_MODES)
    counts = out["expert_counts"]
    if counts is not None and not isinstance(counts, (Mapping, str, os.PathLike)):
        raise InputError(f"expert_counts must be a dict {{layer: [counts]}} or a JSON path, got "
                         f"{type(counts).__name__}")
    if isinstance(counts, (str, os.PathLike)):
        text = os.fspath(counts)
        if not isinstance(text, str) or not text or "\0" in text:
            raise InputError(f"expert_counts path {shown(counts)} is not a valid file name")
    return out


@dataclasses.dataclass(frozen=True)
class ExpertResidency:
    """Routed experts kept on the device within a budget, the rest streamed from the mmap'd GGUF
    (`sharpi_jax.experts.residency`); `sj.load(path, residency=ExpertResidency("25%"))`.

    budget: routed-expert bytes on the device (an int, "6GiB", or a share like "25%"); or device_budget:
    bytes for the non-expert weights and the experts together. policy: which experts hold the slots
    ("static" | "frequency" | "lru" | "slru"). counts: routing counts for "static" / "frequency" (a dict
    {layer: [E]} or a JSON path; default: the file `Engine.calibrate_experts` saved beside the model).
    staging: experts streamable per layer and batch (>= top-k). ring: the share of each layer's slots
    that turns over (0..1). cold: "auto" | "stream" (to the device) | "host" (computed on the host).
    stream_min_rows: rows from which a cold expert is streamed rather than host-computed. prefetch:
    experts madvise'd ahead per layer. lookahead: "none" | "next_layer" | "pass" | "both" (experts
    fetched into slots before a call needs them). lookahead_buffer: experts in one buffer shared by the
    layers for the predicted experts (0 / None: each layer's ring). store: where streamed experts come
    from, "auto" | "pinned_host" | "callback" (`STORE_MODES`; default "auto")."""

    budget: Any = None
    policy: str = "frequency"
    device_budget: int | None = None
    counts: Any = None
    staging: int | None = None
    ring: float | None = None
    cold: str | None = None
    stream_min_rows: int | None = None
    prefetch: int | None = None
    lookahead: str | None = None
    lookahead_buffer: int | None = None
    store: str | None = None

    def __post_init__(self) -> None:
        check_policy(self.policy)
        checked = check_options(self.keywords())
        for name, value in checked.items():
            object.__setattr__(self, name.removeprefix("expert_"), value)
        b = self.budget
        if b is None and self.device_budget is None:
            raise InputError("ExpertResidency needs a budget (bytes, \"6GiB\" or \"25%\") or a device_budget")
        if b is not None and self.device_budget is not None:
            raise InputError("give expert_budget or device_budget, not both")
        if b is not None and (isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer, str))):
            raise InputError(f"expert_budget must be bytes (an integer), a size like \"6GiB\" or a share like "
                             f"\"25%\", got {shown(b)}")

    def keywords(self) -> dict[str, Any]:
        """The residency options under their `sj.load` keyword names (`OPTION_NAMES`)."""
        return {n: getattr(self, n.removeprefix("expert_")) for n in OPTION_NAMES}

    @classmethod
    def from_keywords(cls, expert_budget: Any = None, expert_policy: str = "frequency",
                      **options: Any) -> "ExpertResidency | None":
        """The `sj.load` keyword shortcuts (expert_budget, expert_policy and `OPTION_NAMES`) as the typed
        option; None when no budget is given (every expert resident)."""
        check_policy(expert_policy)
        checked = check_options(options)
        if expert_budget is None and checked["device_budget"] is None:
            if any(v is not None for v in checked.values()):
                raise InputError("expert residency options need expert_budget (or device_budget)")
            return None
        return cls(expert_budget, expert_policy, **{n.removeprefix("expert_"): v for n, v in checked.items()})
