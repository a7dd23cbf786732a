"""Expert residency: hot routed experts in device slots, cold ones streamed from the mmap.

`sj.load(path, expert_budget=..., expert_policy=...)` bounds the routed-expert bytes on the device;
the tokens are the all-resident tokens bit for bit, whatever the budget and policy. By concern:

- `plan`: the budget, its minimum, and which experts start in which slots of each MoE layer;
- `policies`: static / frequency / lru / slru, one `SlotPolicy` interface (plan and ring bookkeeping);
- `slots`: `ResidentExperts`, a layer's slot stack + LUT + ring state, the provider its MoE calls;
- `counts`: calibrated routing counts for "frequency" (`Engine.calibrate_experts` takes them,
  `routing_delta`; saved beside the model);
- `stats`: counters and what a run cost (hit rate, bytes streamed, host work);
- `options`: the load options' types and ranges, checked before anything is planned;
- `lookahead`: fetching ahead of need (`expert_lookahead`): layer L+1's predicted experts (into its
  ring, or a buffer shared by the layers: `expert_lookahead_buffer`), a verify pass's union kept for
  the pass;
- this module: `configure` (the load options) and `Residency` (a plan bound to an open GGUF).

Cold experts are served by `sharpi_jax.experts.streaming` (one host callback per layer and batch).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from sharpi_jax.config import ModelConfig, RunConfig
from sharpi_jax.errors import InputError
from sharpi_jax.experts.provider import ExpertFormat
from sharpi_jax.experts.residency import stats as _stats
from sharpi_jax.experts.residency.counts import (COUNTS_FORMAT, COUNTS_SUFFIX, counts_paths, load_counts,
                                                 routing_delta, save_counts)
from sharpi_jax.experts.residency.options import OPTION_NAMES, ExpertResidency
from sharpi_jax.experts.residency.plan import (LayerSpec, ResidencyPlan, budget_for_fraction, layer_geometry,
                                               minimum_budget, non_expert_bytes, parse_expert_budget, plan_residency)
from sharpi_jax.experts.residency.policies import POLICIES, SlotPolicy, slot_policy
from sharpi_jax.experts.residency.slots import (CTR, ExpertCache, ResidentExperts, lookahead_buffer,
                                                staging_buffer)
from sharpi_jax.experts.streaming import MATRICES, Streamer
from sharpi_jax.gguf.reader import GGUFFile
from sharpi_jax.quant import MatrixFormat


class Residency:
    """A plan bound to an open GGUF: builds the layers' modules, loads their slots, reads stats."""

    def __init__(self, f: GGUFFile, config: ModelConfig, plan: ResidencyPlan,
                 counts: Mapping[int, Sequence[int]] | None = None, prefetch_experts: int = 16):
        self.gguf, self.config, self.plan = f, config, plan
        pinned = {i: s.resident[: s.n_pin] for i, s in plan.layers.items()}
        self.streamer = Streamer(f, sorted(plan.layers), config.d_model, config.expert_ff, pinned=pinned,
                                 counts=counts, prefetch_experts=prefetch_experts)
        self._formats: dict[int, ExpertFormat] = {}  # how each managed layer's stacks are held

    # ----- model construction -----
    def experts_module(self, layer: int, run: RunConfig, shared: dict) -> ResidentExperts | None:
        """The layer's ResidentExperts, or None when the layer is not managed (e.g. the MTP block).
        Layers of one block-type mix share one staging buffer and one lookahead buffer, kept in `shared`
        (one per model build)."""
        spec = self.plan.layers.get(layer)
        if spec is None:
            return None
        fmt = self._formats[layer] = self.streamer.formats[layer] = ExpertFormat(
            MatrixFormat.for_run(run), spec.qtypes, spec.d_model, spec.d_ff)
        if spec.qtypes not in shared:
            shared[spec.qtypes] = staging_buffer(spec, fmt)
            shared["ahead", spec.qtypes] = lookahead_buffer(spec, fmt) if spec.buffer else None
        return ResidentExperts(spec, self.streamer, shared[spec.qtypes], run, shared["ahead", spec.qtypes])

    def source(self, layer: int, path: tuple) -> Callable[[], Any]:
        """The loader of one param of the layer's ResidentExperts (slot stacks, LUT, ring state)."""
        return lambda: self._param(layer, path[0], tuple(path[1:]))

    def _param(self, layer: int, name: str, rest: tuple):
        spec = self.plan.layers[layer]
        ids = np.asarray(spec.resident, np.int64)
        S, E = spec.n_slots, spec.n_expert
        fmt = self._formats[layer]
        if name == "staged":  # staging buffer: zeros until a batch streams into it
            return fmt.zeros(spec.staging if spec.cold != "host" else 0, rest[0])
        if name == "ahead":  # lookahead buffer: empty (no expert, no layer) until a prefetch fills it
            if rest[0] in MATRICES:
                return fmt.zeros(spec.buffer, rest[0])
            return np.full((spec.buffer,) if rest[0] == "expert" else (), -1 if rest[0] != "fresh" else 0, np.int32)
        if name in MATRICES:
            view = self.streamer.sources[layer].views[MATRICES.index(name)]
            return fmt.pack(np.ascontiguousarray(view[ids]), name)
        if name == "lut":
            lut = np.full(E, -1, np.int32)
            lut[ids] = np.arange(S, dtype=np.int32)
            return lut
        if name == "slot_expert":
            return ids.astype(np.int32)
        zeros = {"stamp": (S,), "protected": (S,), "clock": (), "counts": (E,), "ctr": (len(CTR),), "fresh": (S,)}
        return np.zeros(zeros[name], np.int32)

    # ----- counters -----
    def counters(self, runtime) -> dict:
        """Cumulative device counters {layer: {name: int}}, per-expert counts and host counters."""
        return _stats.counters(runtime.expert_cache_arrays(), self.streamer.snapshot())

    zero_counters = staticmethod(_stats.zero_counters)

    def stats(self, before: dict, after: dict) -> dict:
        """What a run cost between two `counters` snapshots (see `stats.run_stats`)."""
        return _stats.run_stats(self.plan, self.streamer.staging_kind, before, after)

    def resident_bytes(self, runtime, what: str = "slots") -> int:
        """nbytes actually on the device (the memory check): "slots" (the slot stacks), "staging"
        (the streaming buffers), "buffer" (the lookahead buffers) or "all"."""
        return _stats.resident_bytes(runtime.expert_cache_arrays(), what)



def configure(f: GGUFFile, config: ModelConfig, spec: ExpertResidency | None) -> Residency | None:
    """The Residency for `sj.load(..., residency=ExpertResidency(...))`, or None (spec None: all resident).
    The options were checked for type and range where `spec` was built; what needs the model (budgets
    against their minimum, staging >= top-k, counts of n_expert) is checked here and in the planner."""
    if spec is None:
        return None
    if not isinstance(spec, ExpertResidency):
        raise InputError(f"residency must be a sharpi_jax.ExpertResidency, got {type(spec).__name__}")
    if not config.is_moe:
        raise InputError(f"expert_budget applies to MoE models; {f.source} ({config.arch}) has no routed experts")
    expert_budget = parse_expert_budget(spec.budget, f, config)
    if spec.device_budget is not None:
        dense = non_expert_bytes(f, config)
        min_exp = minimum_budget(f, config)
        if spec.device_budget < dense + min_exp:
            raise InputError(
                f"device_budget = {spec.device_budget} bytes is too small: the minimum is {dense + min_exp} bytes "
                f"(non-expert weights {dense} + one layer's top-k experts {min_exp})")
        expert_budget = int(spec.device_budget) - dense
    counts, source = load_counts(spec.counts, f.path, config)
    plan = plan_residency(f, config, expert_budget, spec.policy, counts, counts_source=source,
                          staging=spec.staging, ring=spec.ring, cold=spec.cold, stream_min_rows=spec.stream_min_rows,
                          lookahead=spec.lookahead, lookahead_buffer=spec.lookahead_buffer)
    return Residency(f, config, plan, counts, 16 if spec.prefetch is None else spec.prefetch)


__all__ = ["COUNTS_FORMAT", "COUNTS_SUFFIX", "CTR", "ExpertCache", "ExpertResidency", "LayerSpec", "OPTION_NAMES", "POLICIES", "Residency",
           "ResidencyPlan", "ResidentExperts", "SlotPolicy", "budget_for_fraction", "configure",
           "counts_paths", "layer_geometry", "load_counts", "minimum_budget", "non_expert_bytes", "parse_expert_budget",
           "plan_residency", "routing_delta", "save_counts", "slot_policy"]
