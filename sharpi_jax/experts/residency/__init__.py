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

With expert parallelism (`configure(..., mesh=)`) the budget is per device: each device of the expert
axis holds slots of its own experts only (`plan.device_plans`), streams its own misses and keeps its own
ring state; the state arrays stack the devices' copies on axis 0 (`slots.ResidentExperts`).

Cold experts are served by `sharpi_jax.experts.streaming` (one host callback per layer and batch).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from sharpi_jax.config import ModelConfig, RunConfig
from sharpi_jax.errors import InputError
from sharpi_jax.experts.provider import ExpertFormat
from sharpi_jax.experts.residency import stats as _stats
from sharpi_jax.experts.residency.counts import (COUNTS_FORMAT, COUNTS_SUFFIX, counts_paths, load_counts,
                                                 routing_delta, save_counts)
from sharpi_jax.experts.residency.options import OPTION_NAMES, ExpertResidency
from sharpi_jax.experts.parallel import EXPERT_AXIS, assemble_on_mesh
from sharpi_jax.experts.residency.plan import (LayerSpec, ResidencyPlan, budget_for_fraction, device_config,
                                               device_plans, layer_geometry, minimum_budget, non_expert_bytes,
                                               parse_expert_budget, plan_residency)
from sharpi_jax.experts.residency.policies import POLICIES, SlotPolicy, slot_policy
from sharpi_jax.experts.residency.slots import (CTR, ExpertCache, ResidentExperts, lookahead_buffer,
                                                staging_buffer)
from sharpi_jax.experts.streaming import MATRICES, Streamer
from sharpi_jax.gguf.reader import GGUFFile
from sharpi_jax.quant import MatrixFormat


class Residency:
    """A plan bound to an open GGUF: builds the layers' modules, loads their slots, reads stats.

    plans: one per device of `mesh`'s expert axis (expert parallelism; `plan` is device 0's, whose
    geometry and budget every device shares), or [plan]."""

    def __init__(self, f: GGUFFile, config: ModelConfig, plan: ResidencyPlan,
                 counts: Mapping[int, Sequence[int]] | None = None, prefetch_experts: int = 16,
                 mesh: Mesh | None = None, plans: Sequence[ResidencyPlan] | None = None):
        self.gguf, self.config, self.plan, self.mesh = f, config, plan, mesh
        self.plans = list(plans) if plans else [plan]
        e_local = config.n_expert // len(self.plans)
        pinned = {i: tuple(d * e_local + e for d, p in enumerate(self.plans) for e in p.layers[i].resident[: s.n_pin])
                  for i, s in plan.layers.items()}
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
        n_dev = len(self.plans)
        if spec.qtypes not in shared:
            shared[spec.qtypes] = staging_buffer(spec, fmt, n_dev)
            shared["ahead", spec.qtypes] = lookahead_buffer(spec, fmt, n_dev) if spec.buffer else None
        return ResidentExperts(spec, self.streamer, shared[spec.qtypes], run, shared["ahead", spec.qtypes],
                               self.mesh)

    def source(self, layer: int, path: tuple) -> Callable[[], Any]:
        """The loader of one param of the layer's ResidentExperts (slot stacks, LUT, ring state)."""
        return lambda: self._param(layer, path[0], tuple(path[1:]))

    def _param(self, layer: int, name: str, rest: tuple):
        if self.mesh is None:
            return self._device_param(0, layer, name, rest)
        return assemble_on_mesh({dev: self._device_param(d, layer, name, rest)
                                 for d, dev in enumerate(self.mesh.devices.flat)}, self.mesh)

    def _device_param(self, device: int, layer: int, name: str, rest: tuple):
        """One device's value of a param (its plan's slots; its experts' global ids offset by device)."""
        spec = self.plans[device].layers[layer]
        ids = np.asarray(spec.resident, np.int64)
        S, E = spec.n_slots, spec.n_expert
        fmt = self._formats[layer]
        if name == "store":  # the pinned host store: every expert, laid out once (`slots.ColdStore`)
            view = self.streamer.sources[layer].views[MATRICES.index(rest[0])]
            return pinned_host(fmt.pack(np.ascontiguousarray(view), rest[0]))
        if name == "staged":  # staging buffer: zeros until a batch streams into it
            return fmt.zeros(spec.staging if spec.cold != "host" else 0, rest[0])
        if name == "ahead":  # lookahead buffer: empty (no expert, no layer) until a prefetch fills it
            if rest[0] in MATRICES:
                return fmt.zeros(spec.buffer, rest[0])
            return np.full((spec.buffer,) if rest[0] == "expert" else (), -1 if rest[0] != "fresh" else 0, np.int32)
        if name in MATRICES:
            view = self.streamer.sources[layer].views[MATRICES.index(name)]
            return fmt.pack(np.ascontiguousarray(view[ids + device * E]), name)
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
        return _stats.run_stats(self.plan, self.staging_kind, before, after)

    @property
    def staging_kind(self) -> str:
        """Where streamed experts come from, in words (the stats' `staging_memory`)."""
        if any(s.store == "pinned_host" for s in self.plan.layers.values()):
            return ("pinned_host store (every expert of a managed layer laid out once in the kernel layout, "
                    f"memory kind {STORE_MEMORY_KIND!r}; each call's misses moved to the device inside the step, none "
                    "computed on the host, no callback)")
        return self.streamer.staging_kind

    def resident_bytes(self, runtime, what: str = "slots") -> int:
        """nbytes actually on the device (the memory check): "slots" (the slot stacks), "staging"
        (the streaming buffers), "buffer" (the lookahead buffers) or "all"."""
        return _stats.resident_bytes(runtime.expert_cache_arrays(), what)



STORE_MEMORY_KIND = "pinned_host"


def pinned_host(value: Any) -> Any:
    """`value` (arrays, QTensors) on the default device's "pinned_host" memory (InputError, one line, where
    the backend has no such memory kind)."""
    device = jax.devices()[0]
    if STORE_MEMORY_KIND not in {m.kind for m in device.addressable_memories()}:
        raise InputError(f"expert_store='pinned_host': the {device.platform} backend has no pinned_host memory "
                         "kind; use expert_store='callback'")
    return jax.device_put(value, SingleDeviceSharding(device, memory_kind=STORE_MEMORY_KIND))


def resolve_store(store: str | None, n_dev: int = 1) -> str:
    """expert_store ("auto" | "pinned_host" | "callback", None: "auto") -> "pinned_host" | "callback".
    "auto" takes the pinned host store on a GPU backend, whose "pinned_host" memory is page-locked and
    reached by DMA; on the CPU backend device memory is host memory, so the callback (no second copy
    of the experts) stays the default there. Not with expert parallelism yet (each device would need
    a store of its own experts): one line says so."""
    store = store or "auto"
    if store == "auto":
        return "pinned_host" if n_dev == 1 and jax.default_backend() in ("gpu", "cuda", "rocm") else "callback"
    if store == "pinned_host" and n_dev > 1:
        raise InputError("expert_store='pinned_host' with expert_parallel is not supported yet: use "
                         "expert_store='callback' (each device streams its own experts)")
    return store


def configure(f: GGUFFile, config: ModelConfig, spec: ExpertResidency | None,
              mesh: Mesh | None = None) -> Residency | None:
    """The Residency for `sj.load(..., residency=ExpertResidency(...))`, or None (spec None: all resident).
    The options were checked for type and range where `spec` was built; what needs the model (budgets
    against their minimum, staging >= top-k, counts of n_expert) is checked here and in the planner.
    mesh: expert parallelism; the budgets are then per device, against the device's own experts."""
    if spec is None:
        return None
    if not isinstance(spec, ExpertResidency):
        raise InputError(f"residency must be a sharpi_jax.ExpertResidency, got {type(spec).__name__}")
    if not config.is_moe:
        raise InputError(f"expert_budget applies to MoE models; {f.source} ({config.arch}) has no routed experts")
    n_dev = 1 if mesh is None else mesh.shape[EXPERT_AXIS]
    mesh = None if n_dev == 1 else mesh  # one device on the axis: the one-device residency, on it
    local = device_config(config, n_dev)
    expert_budget = parse_expert_budget(spec.budget, f, local)
    if spec.device_budget is not None:
        dense = non_expert_bytes(f, config)
        min_exp = minimum_budget(f, local)
        if spec.device_budget < dense + min_exp:
            raise InputError(
                f"device_budget = {spec.device_budget} bytes is too small: the minimum is {dense + min_exp} bytes "
                f"(non-expert weights {dense} + one layer's top-k experts {min_exp})")
        expert_budget = int(spec.device_budget) - dense
    counts, source = load_counts(spec.counts, f.path, config)
    plans = device_plans(f, config, n_dev, expert_budget, spec.policy, counts, counts_source=source,
                         staging=spec.staging, ring=spec.ring, cold=spec.cold, stream_min_rows=spec.stream_min_rows,
                         lookahead=spec.lookahead, lookahead_buffer=spec.lookahead_buffer,
                         store=resolve_store(spec.store, n_dev))
    return Residency(f, config, plans[0], counts, 16 if spec.prefetch is None else spec.prefetch, mesh, plans)


__all__ = ["COUNTS_FORMAT", "COUNTS_SUFFIX", "CTR", "ExpertCache", "ExpertResidency", "LayerSpec", "OPTION_NAMES", "POLICIES", "Residency",
           "ResidencyPlan", "ResidentExperts", "SlotPolicy", "budget_for_fraction", "configure", "device_config",
           "device_plans",
           "counts_paths", "layer_geometry", "load_counts", "minimum_budget", "non_expert_bytes", "parse_expert_budget",
           "pinned_host", "plan_residency", "resolve_store", "routing_delta", "save_counts", "slot_policy"]
