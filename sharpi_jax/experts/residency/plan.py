"""Residency planning: which experts start in which device slots of each MoE layer, within a budget.

Budget. `expert_budget` (bytes) bounds the persistent routed-expert bytes on the device:

    sum over MoE trunk layers of the slot stacks' nbytes  +  the staging buffers' nbytes
                                                          +  the lookahead buffers' nbytes

The staging buffer holds `staging` experts (default top-k: how many cold experts one layer may stream
per batch; the rest of a batch's misses are computed on the host). Layers run one at a time, so all
layers with the same expert block types share ONE staging buffer (a uniform model has exactly one).
A budget that holds every expert gives all-resident stacks and no staging. The minimum is one layer's
top-k (k x bytes_per_expert per block-type mix: a decode token's experts streamed into staging);
below it planning raises InputError naming the minimum. Not counted: the callback's result buffer
(raw bytes of the streamed experts, transient while one layer computes). `device_budget` is the same
check for the whole model: non-expert weights (as loaded: dense matrices in float32, the embedding in
blocks) + the expert budget. The MTP block's experts are not managed (loaded whole when
speculative="mtp" is first used) and are outside the budget.

Placement follows the policy (`policies`): each layer's initial slots are ordered by calibrated
counts (or expert id), "frequency" spends the budget greedily across layers by count per byte with a
per-layer floor of min(top_k, equal share) slots, the others round robin; the policy's ring share
(or `expert_ring`) of each layer's slots forms the ring, the rest are pinned. Under an
`expert_lookahead` other than "none", a policy without a ring (static, frequency) gets
`LOOKAHEAD_RING_SHARE` of each layer's slots as its ring (what is fetched ahead lands there; see
`lookahead`); the budget is the same.

Lookahead buffer (`expert_lookahead_buffer` = P experts, with "next_layer" / "both"): predicted experts
land in ONE buffer of P experts per block-type mix, shared by its layers like the staging (only the
next layer's predictions are in flight at a time), instead of in each layer's ring. Its bytes are
charged to the budget once and taken out of the slots of the layers it serves (every MoE layer but
the first, which has no layer before it to predict from): the slots are planned as without a buffer,
then the predicted layers give up slots, the fullest first, until the buffer's bytes are free.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Sequence

import numpy as np

from sharpi_jax.config import ModelConfig
from sharpi_jax.errors import InputError, shown
from sharpi_jax.quant import gguf_nbytes
from sharpi_jax.experts.residency.options import LOOKAHEAD_MODES
from sharpi_jax.experts.residency.policies import POLICIES, slot_policy
from sharpi_jax.experts.streaming import COLD_MODES, DEFAULT_STREAM_MIN_ROWS
from sharpi_jax.gguf.reader import GGUFFile
from sharpi_jax.gguf.tensor_specs import expert_qtypes
from sharpi_jax.model.weights import non_expert_bytes as model_non_expert_bytes


# Lookahead modes that prefetch a layer's predicted experts / that stream a verify pass's union.
PREDICT_MODES = ("next_layer", "both")
PASS_MODES = ("pass", "both")
# Ring share of each layer's slots under a lookahead when the policy has none (static / frequency):
# what is fetched ahead lands in these slots; the rest stay pinned. `expert_ring` overrides it.
LOOKAHEAD_RING_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Static residency of one MoE layer (hashable: it is part of the model graph)."""

    layer: int
    n_expert: int
    top_k: int
    d_model: int
    d_ff: int
    qtypes: tuple[int, int, int]
    resident: tuple[int, ...]  # initial expert in each slot; the last n_ring slots form the ring
    n_ring: int
    bytes_per_expert: int
    staging: int  # cold experts one batch may stream (0: host only)
    cold: str
    stream_min_rows: int
    policy: str
    lookahead: str = "none"  # `lookahead.LOOKAHEAD_MODES`
    buffer: int = 0  # experts in the shared lookahead buffer (0: fetched-ahead experts go to the ring)
    store: str = "callback"  # where streamed experts come from: "callback" | "pinned_host" (`options`)

    @property
    def n_slots(self) -> int:
        return len(self.resident)

    @property
    def n_pin(self) -> int:
        return self.n_slots - self.n_ring

    def n_stage(self, n_rows: int) -> int:
        """Experts streamed for a bucket of n_rows rows (static): the staging size, 0 when host-computing.
        With a "pass" lookahead every bucket of >= 2 rows may stream (a verify pass streams its union;
        `stages_passes` says which of its calls do)."""
        if self.cold == "host":
            return 0
        if self.cold == "auto" and n_rows < self.stream_min_rows and not self.stages_passes(n_rows):
            return 0
        return self.staging

    def n_stage_auto(self, n_rows: int) -> int:
        """`n_stage` without the pass rule: what a call of one valid row (decode) streams."""
        if self.cold == "host" or (self.cold == "auto" and n_rows < self.stream_min_rows):
            return 0
        return self.staging

    def stages_passes(self, n_rows: int) -> bool:
        """Whether a call of this bucket with more than one valid row (a verify pass) streams its cold
        experts whatever the cold mode's row threshold ("pass" / "both" lookahead)."""
        return self.lookahead in PASS_MODES and self.cold != "host" and n_rows >= 2

    @property
    def predicts(self) -> bool:
        """Whether this layer's predicted experts are prefetched from the layer before ("next_layer" /
        "both" lookahead, and a ring to put them in)."""
        return self.lookahead in PREDICT_MODES and (self.n_ring > 0 or self.buffer > 0)


@dataclasses.dataclass(frozen=True)
class ResidencyPlan:
    """Which experts start in which slots, per MoE trunk layer, and the budget they satisfy."""

    policy: str
    budget: int  # expert bytes the device may hold (see module doc)
    staging: int  # experts
    layers: Mapping[int, LayerSpec]
    total_expert_bytes: int  # every routed expert of the managed layers
    min_budget: int
    counts_source: str | None
    buffer: int = 0  # experts in each shared lookahead buffer


    @property
    def slot_bytes(self) -> int:
        """Bytes of all slot stacks (persistent device-resident experts)."""
        return sum(s.n_slots * s.bytes_per_expert for s in self.layers.values())

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging buffers: one per expert block-type mix, shared by its layers."""
        return self.staging * sum(staging_groups(self.layers.values()).values())

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the lookahead buffers: one per expert block-type mix, shared by its layers."""
        return self.buffer * sum(staging_groups(self.layers.values()).values())

    @property
    def device_bytes(self) -> int:
        """Every routed-expert byte the plan holds on the device (what the budget bounds)."""
        return self.slot_bytes + self.staging_bytes + self.buffer_bytes

    @property
    def resident_fraction(self) -> float:
        return self.slot_bytes / self.total_expert_bytes if self.total_expert_bytes else 1.0


def staging_groups(specs) -> dict[tuple[int, int, int], int]:
    """{expert qtypes: bytes per expert}: layers with the same block types share one staging buffer."""
    return {s.qtypes: s.bytes_per_expert for s in specs}


def layer_geometry(f: GGUFFile, c: ModelConfig) -> dict[int, tuple[tuple[int, int, int], int]]:
    """{layer: (qtypes, bytes_per_expert)} of the MoE trunk layers, from the tensor table."""
    out = {}
    for i in range(c.n_layer if c.is_moe else 0):
        q = tuple(int(x) for x in expert_qtypes(f, i))
        F, D = c.expert_ff, c.d_model
        bpe = gguf_nbytes(q[0], (F, D)) + gguf_nbytes(q[1], (F, D)) + gguf_nbytes(q[2], (D, F))
        out[i] = (q, bpe)
    return out


def plan_residency(f: GGUFFile, c: ModelConfig, expert_budget: int, policy: str = "frequency",
                   counts: Mapping[int, Sequence[int]] | None = None, *, counts_source: str | None = None,
                   staging: int | None = None, ring: float | None = None, cold: str | None = None,
                   stream_min_rows: int | None = None, lookahead: str | None = None,
                   lookahead_buffer: int | None = None, store: str = "callback") -> ResidencyPlan:
    """Place experts into per-layer slots within `expert_budget` bytes (see the module doc)."""
    lookahead, buffer = _checked_lookahead(lookahead, lookahead_buffer)
    if policy not in POLICIES:
        raise InputError(f"expert_policy must be one of {POLICIES}, got {shown(policy)}")
    if not c.is_moe:
        raise InputError(f"expert_budget applies to MoE models; {c.arch} has no routed experts")
    if isinstance(expert_budget, bool) or not isinstance(expert_budget, (int, np.integer)) or expert_budget < 0:
        raise InputError(f"expert_budget must be a non-negative integer number of bytes, got {shown(expert_budget)}")
    pol = slot_policy(policy)
    cold = cold or pol.default_cold
    if cold not in COLD_MODES:
        raise InputError(f"expert_cold must be one of {COLD_MODES}, got {shown(cold)}")
    if ring is not None and not 0.0 <= float(ring) <= 1.0:
        raise InputError(f"expert_ring must be a fraction in [0, 1], got {shown(ring)}")
    E, k = c.n_expert, c.n_expert_used
    geo = layer_geometry(f, c)
    layers = sorted(geo)
    bpe = {i: geo[i][1] for i in layers}
    group_bpe = sum({geo[i][0]: geo[i][1] for i in layers}.values())  # one staging per block-type mix
    total = sum(E * b for b in bpe.values())
    staging = k if staging is None else int(staging)
    if staging < k:
        raise InputError(f"expert_staging must hold at least one layer's top-k ({k} experts), got {staging}")
    min_budget = k * group_bpe
    budget = int(expert_budget)
    if budget < min_budget:
        raise InputError(
            f"expert_budget = {budget} bytes is too small: the minimum is {min_budget} bytes (one layer's "
            f"top-k: {k} experts x {group_bpe} bytes, the staging a decode token streams into)")
    full = budget >= total
    if full:
        staging = buffer = 0
        n_slots = {i: E for i in layers}
    else:
        staging, buffer, n_slots = _partial_slots(layers, bpe, group_bpe, E, k, budget, staging, buffer,
                                                  counts if pol.greedy_by_counts else None)
    if pol.greedy_by_counts and counts is None and not full:
        warnings.warn("expert_policy='frequency' without calibrated counts: using the static order "
                      "(run Engine.calibrate_experts)", stacklevel=3)
    ring_frac = pol.ring_share if ring is None else float(ring)
    if ring is None and lookahead != "none":  # fetched-ahead experts need ring slots to land in
        ring_frac = max(ring_frac, LOOKAHEAD_RING_SHARE)
    smr = DEFAULT_STREAM_MIN_ROWS if stream_min_rows is None else int(stream_min_rows)
    specs = {}
    for i in layers:
        order = _order(E, counts.get(i) if counts and pol.ordered_by_counts else None)
        n = n_slots[i]
        n_ring = 0 if full else int(round(ring_frac * n))
        specs[i] = LayerSpec(layer=i, n_expert=E, top_k=k, d_model=c.d_model, d_ff=c.expert_ff, qtypes=geo[i][0],
                             resident=tuple(order[:n]), n_ring=n_ring, bytes_per_expert=bpe[i], staging=staging,
                             cold=cold, stream_min_rows=smr, policy=policy, lookahead=lookahead,
                             buffer=buffer, store=store)
    plan = ResidencyPlan(policy, budget, staging, specs, total, min_budget, counts_source, buffer)
    assert plan.device_bytes <= budget or full, "planner exceeded the budget"
    return plan


def _checked_lookahead(lookahead: str | None, lookahead_buffer: int | None) -> tuple[str, int]:
    """(lookahead mode, buffer experts) of the options: the mode defaults to "none", and a buffer needs a
    predicting mode (InputError otherwise)."""
    lookahead = lookahead or "none"
    if lookahead not in LOOKAHEAD_MODES:
        raise InputError(f"expert_lookahead must be one of {LOOKAHEAD_MODES}, got {shown(lookahead)}")
    buffer = int(lookahead_buffer or 0)
    if buffer and lookahead not in PREDICT_MODES:
        raise InputError(f"expert_lookahead_buffer holds predicted experts: it needs expert_lookahead in "
                         f"{PREDICT_MODES}, got {shown(lookahead)}")
    return lookahead, buffer


def _partial_slots(layers, bpe, group_bpe: int, E: int, k: int, budget: int, staging: int, buffer: int,
                   counts) -> tuple[int, int, dict[int, int]]:
    """(staging, buffer, slots per layer) of a budget below every expert: the staging and buffer capped
    at E experts, the slots in what the staging leaves (`_allocate`; counts: None unless the policy is
    greedy by counts), less the buffer's bytes (`_carve_buffer`). InputError if the staging alone is over
    the budget or the slots cannot pay for the buffer."""
    staging = min(staging, E)
    buffer = min(buffer, E)
    avail = budget - staging * group_bpe
    if avail < 0:
        raise InputError(f"expert_budget = {budget} bytes is below the staging of {staging} experts "
                         f"({staging * group_bpe} bytes); lower expert_staging or raise the budget")
    n_slots = _allocate(layers, bpe, E, k, avail, counts)
    if buffer:
        n_slots = _carve_buffer(n_slots, layers, bpe, buffer * group_bpe, avail)
    return staging, buffer, n_slots


def _carve_buffer(n_slots: dict[int, int], layers, bpe, need: int, avail: int) -> dict[int, int]:
    """Slots per layer once the lookahead buffer's `need` bytes are taken out of `avail` (the bytes
    the slots had): from the layers the buffer serves (all but the first), the fullest first (ties:
    the later layer), then from the first layer if they run out; InputError if the slots cannot pay."""
    n = dict(n_slots)
    free = avail - sum(n[i] * bpe[i] for i in layers)
    served, first = layers[1:], layers[:1]
    for group in (served, first):
        while free < need:
            cand = [i for i in group if n[i] > 0]
            if not cand:
                break
            i = max(cand, key=lambda j: (n[j], j))
            n[i] -= 1
            free += bpe[i]
    if free < need:
        raise InputError(f"expert budget too small for a lookahead buffer of {need} bytes beside the staging; "
                         f"lower expert_lookahead_buffer or raise the budget")
    return n


def _order(n_expert: int, counts: Sequence[int] | None) -> list[int]:
    """Expert ids by calibrated count (descending, ties by id), or 0..E-1 without counts."""
    if counts is None:
        return list(range(n_expert))
    c = np.asarray(counts, np.int64)
    return [int(e) for e in np.argsort(-c, kind="stable")]


def _allocate(layers, bpe, E, k, avail, counts) -> dict[int, int]:
    """Slots per layer within `avail` bytes: round robin, or (with counts) a floor then counts per byte."""
    n = {i: 0 for i in layers}

    def round_robin(cap: int) -> int:
        nonlocal avail
        added, progress = 0, True
        while progress:
            progress = False
            for i in layers:
                if n[i] < cap and bpe[i] <= avail:
                    n[i] += 1
                    avail -= bpe[i]
                    added += 1
                    progress = True
        return added

    if counts is None:
        round_robin(E)
        return n
    share = avail // sum(bpe.values())  # equal slots per layer the budget allows
    round_robin(min(k, share, E))  # the per-layer floor
    # Then the globally best (count / bytes) experts, each layer in its own count order.
    cand = []
    for i in layers:
        order = _order(E, counts.get(i))
        c = np.asarray(counts.get(i, np.zeros(E)), np.float64)
        for rank in range(n[i], E):
            cand.append((-c[order[rank]] / bpe[i], i, rank))
    cand.sort()
    for _, i, rank in cand:
        if avail < bpe[i]:
            continue
        if rank == n[i]:  # layers fill in order; a later rank waits for the earlier ones
            n[i] += 1
            avail -= bpe[i]
    round_robin(E)  # budget left by skipped ranks
    return n


def non_expert_bytes(f: GGUFFile, c: ModelConfig) -> int:
    """Device bytes of every param except the routed experts, as the loader holds them."""
    return model_non_expert_bytes(f, c)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_expert_budget(value: Any, f: GGUFFile, config: ModelConfig) -> int | None:
    """expert_budget as given by a caller -> bytes (None stays None).

    Accepts an int (bytes) or a string: "8GiB", "512 MiB", "1.5GB", "123456", or "25%" (that share of
    all routed-expert bytes in slots, `budget_for_fraction`). Anything else raises InputError.
    """
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        try:
            if text.endswith("%"):
                frac = float(text[:-1]) / 100
                if not 0 < frac <= 1:
                    raise ValueError
                return budget_for_fraction(f, config, frac)
            num = text.rstrip("kmgtib")
            unit = text[len(num):]
            if unit in _UNITS and num:
                return int(float(num) * _UNITS[unit])
        except (ValueError, OverflowError):
            pass
    raise InputError(f"expert_budget must be bytes (an int, or a string like '8GiB' / '512MiB') or a share "
                     f"like '25%' (0-100%], got {shown(value)}")


def budget_for_fraction(f: GGUFFile, config: ModelConfig, frac: float) -> int:
    """expert_budget bytes whose slot stacks hold `frac` of all routed experts (plus the top-k staging
    when frac < 1), rounded to whole experts: what the benches and tests sweep."""
    geo = layer_geometry(f, config)
    bpe = max(b for _, b in geo.values())
    total = sum(config.n_expert * b for _, b in geo.values())
    if frac >= 1.0:
        return total
    return int(frac * total) // bpe * bpe + minimum_budget(f, config)


def minimum_budget(f: GGUFFile, config: ModelConfig) -> int:
    """One layer's top-k of staging per expert block-type mix (see the module doc)."""
    return config.n_expert_used * sum(dict(layer_geometry(f, config).values()).values())


def device_config(c: ModelConfig, n_dev: int) -> ModelConfig:
    """The model as one device of an n_dev expert axis sees its routed experts (expert parallelism): its
    E / n_dev experts, and a top-k of at most that (all of a token's experts may be one device's). What
    a per-device budget is planned, parsed ("25%": of the device's expert bytes) and checked against."""
    if n_dev == 1:
        return c
    e_local = c.n_expert // n_dev
    return dataclasses.replace(c, n_expert=e_local, n_expert_used=min(c.n_expert_used, e_local))


def device_plans(f: GGUFFile, c: ModelConfig, n_dev: int, expert_budget: int, policy: str = "frequency",
                 counts: Mapping[int, Sequence[int]] | None = None, **options: Any) -> list[ResidencyPlan]:
    """One plan per device of an n_dev expert axis, each within `expert_budget` bytes of the device's own
    experts (`device_config`; counts: over all E experts, as calibrated). The devices run one program,
    so they share one slot geometry (slots, ring, staging and buffer per layer), planned on the sum of
    the devices' count profiles (each device's counts sorted, summed rank by rank); each device's slots
    start with its own experts in its own count order. One device: `plan_residency` as it is."""
    if n_dev == 1:
        return [plan_residency(f, c, expert_budget, policy, counts, **options)]
    local = device_config(c, n_dev)
    e_local = local.n_expert
    per_dev = [{i: np.asarray(v, np.int64)[d * e_local:(d + 1) * e_local] for i, v in counts.items()}
               if counts else None for d in range(n_dev)]
    profile = ({i: sum(np.sort(p[i])[::-1] for p in per_dev) for i in counts} if counts else None)
    base = plan_residency(f, local, expert_budget, policy, profile, **options)
    by_counts = counts is not None and slot_policy(policy).ordered_by_counts
    plans = []
    for d in range(n_dev):
        layers = {i: dataclasses.replace(s, resident=tuple(_order(e_local, per_dev[d].get(i) if by_counts else None)
                                                           [:s.n_slots]))
                  for i, s in base.layers.items()}
        plans.append(dataclasses.replace(base, layers=layers))
    return plans
