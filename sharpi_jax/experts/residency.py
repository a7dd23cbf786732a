"""Expert residency (spec speculative.md §4): hot routed experts in device slots, cold ones streamed.

Each MoE trunk layer keeps a *slot stack*: the same storage as `provider.RoutedExperts` (GGUF blocks, SoA
for Q8_0/Q4_K) with leading dim n_slots instead of n_expert, plus a LUT `[n_expert] -> slot | -1`.
Because an expert's computation does not depend on the index it sits at, routing through
`lut[sel]` into the slot stack gives the same bits as the full [E, ...] stack.

Budget. `expert_budget` (bytes) bounds the persistent routed-expert bytes on the device:

    sum over MoE trunk layers of the slot stacks' nbytes  +  the staging buffers' nbytes

The staging buffer holds `staging` experts (default top-k: how many cold experts one layer may stream
per batch; the rest of a batch's misses are computed on the host). Layers run one at a time, so all
layers with the same expert block types share ONE staging buffer (a uniform model has exactly one).
A budget that holds every expert gives all-resident stacks and no staging. The minimum is one layer's
top-k (k x bytes_per_expert per block-type mix: a decode token's experts streamed into staging);
below it `configure` raises InputError naming the minimum. Not counted: the callback's result buffer
(raw bytes of the streamed experts, transient while one layer computes). `device_budget` is the same
check for the whole model: non-expert weights (as loaded: dense matrices in float32, the embedding in
blocks) + the expert budget. The MTP block's experts are not managed (loaded whole when
speculative="mtp" is first used) and are outside the budget.

Policies (one interface: `plan_residency` picks each layer's initial slots and how many of them form a
ring that recency replaces; the rest are pinned):
- "static": the first n experts of every layer, pinned.
- "frequency": calibrated routing counts per byte, greedy across layers, with a per-layer floor of
  min(top_k, equal share) slots; pinned. Counts come from `calibrate` and are saved next to the model
  (`<model>.gguf.expert-counts.json`, or the cache dir when that is read-only) and loaded
  automatically; without counts it falls back to the static order (with a warning).
- "lru": every slot is a ring; a streamed expert replaces the least recently used ring slot that the
  batch does not use. Initial fill: by counts when present, else the first n.
- "slru": segmented LRU: new experts enter a probation segment; a hit promotes to a protected segment
  (at most 80% of the ring); victims come from probation first.
`expert_ring` (a fraction) overrides the ring share, e.g. frequency-pinned + a small LRU ring.

The jitted path (`ResidentExperts.__call__`, one per MoE layer, inside the step): slot = lut[sel];
`lax.cond(all hit)`: the all-hot branch is `dispatch.routed_experts` on the slot stack, device only;
the other branch makes ONE `io_callback` (`streaming.Streamer.serve`) that returns the batch's cold
experts (into staging, most-used first) and/or their rows computed on the host, picks ring victims,
and reduces hot, streamed and host rows in rank order (bitwise as all-resident). After the cond, a
second cond copies staged experts into the victims' slots (in place: inside the first cond XLA copied
the whole stack on every miss). Slot stacks, staging, the LUT, ring state (slot -> expert, recency
stamps, SLRU segment) and per-layer counters are `ExpertCache` variables that every step takes donated
and returns (`runtime.steps.Runtime`).

Cold mode ("auto" | "stream" | "host"): "auto" streams from `stream_min_rows` bucket rows up
(streaming.DEFAULT_STREAM_MIN_ROWS, measured) and host-computes below; lru/slru default to "stream"
(their ring fills only from streamed experts).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from sharpi_jax.config import ModelConfig
from sharpi_jax.errors import InputError
from sharpi_jax.experts import dispatch
from sharpi_jax.experts.expert_weights import (ExpertWeights, expert_storage, qtype_name, row_bytes, storage_values,
                                               storage_variables, to_expert_storage)
from sharpi_jax.experts.provider import EXPERT_MODES, RoutedExperts, field_of
from sharpi_jax.experts.streaming import COLD_MODES, DEFAULT_STREAM_MIN_ROWS, MATRICES, Streamer
from sharpi_jax.gguf.reader import GGUFFile
from sharpi_jax.gguf.tensor_specs import expert_qtypes
from sharpi_jax.model.weights import non_expert_bytes as model_non_expert_bytes

POLICIES = ("static", "frequency", "lru", "slru")
SLRU_PROTECTED_FRAC = 0.8
COUNTS_SUFFIX = ".expert-counts.json"
COUNTS_FORMAT = "sharpi-expert-counts/1"

# Device counters per layer (int32, cumulative; diff two snapshots for a run).
CTR = ("batches", "rows", "pairs", "hits", "misses", "slow_batches", "streamed", "host_experts",
       "host_pairs", "evicted", "ring_inserts", "unique")
_C = {n: i for i, n in enumerate(CTR)}


class ExpertCache(nnx.Variable):
    """Mutable residency state (slot stacks, LUT, recency, counters): donated through every step."""


# ----------------------------------------------------------------------------- plan


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

    @property
    def n_slots(self) -> int:
        return len(self.resident)

    @property
    def n_pin(self) -> int:
        return self.n_slots - self.n_ring

    @property
    def protected_cap(self) -> int:
        return int(SLRU_PROTECTED_FRAC * self.n_ring)

    def n_stage(self, n_rows: int) -> int:
        """Experts streamed for a bucket of n_rows rows (static): the staging size, 0 when host-computing."""
        if self.cold == "host" or (self.cold == "auto" and n_rows < self.stream_min_rows):
            return 0
        return self.staging


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

    @property
    def slot_bytes(self) -> int:
        """Bytes of all slot stacks (persistent device-resident experts)."""
        return sum(s.n_slots * s.bytes_per_expert for s in self.layers.values())

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging buffers: one per expert block-type mix, shared by its layers."""
        return self.staging * sum(_groups(self.layers.values()).values())

    @property
    def resident_fraction(self) -> float:
        return self.slot_bytes / self.total_expert_bytes if self.total_expert_bytes else 1.0


def _groups(specs) -> dict[tuple[int, int, int], int]:
    """{expert qtypes: bytes per expert}: layers with the same block types share one staging buffer."""
    return {s.qtypes: s.bytes_per_expert for s in specs}


def _layer_geometry(f: GGUFFile, c: ModelConfig) -> dict[int, tuple[tuple[int, int, int], int]]:
    """{layer: (qtypes, bytes_per_expert)} of the MoE trunk layers, from the tensor table."""
    out = {}
    for i in range(c.n_layer if c.is_moe else 0):
        q = tuple(int(x) for x in expert_qtypes(f, i))
        F, D = c.expert_ff, c.d_model
        n = [qtype_name(x) for x in q]
        bpe = F * row_bytes(n[0], D) + F * row_bytes(n[1], D) + D * row_bytes(n[2], F)
        out[i] = (q, bpe)
    return out


def plan_residency(f: GGUFFile, c: ModelConfig, expert_budget: int, policy: str = "frequency",
                   counts: Mapping[int, Sequence[int]] | None = None, *, counts_source: str | None = None,
                   staging: int | None = None, ring: float | None = None, cold: str | None = None,
                   stream_min_rows: int | None = None) -> ResidencyPlan:
    """Place experts into per-layer slots within `expert_budget` bytes (see the module doc)."""
    if policy not in POLICIES:
        raise InputError(f"expert_policy must be one of {POLICIES}, got {policy!r}")
    if not c.is_moe:
        raise InputError(f"expert_budget applies to MoE models; {c.arch} has no routed experts")
    if isinstance(expert_budget, bool) or not isinstance(expert_budget, (int, np.integer)) or expert_budget < 0:
        raise InputError(f"expert_budget must be a non-negative integer number of bytes, got {expert_budget!r}")
    cold = cold or ("stream" if policy in ("lru", "slru") else "auto")
    if cold not in COLD_MODES:
        raise InputError(f"expert_cold must be one of {COLD_MODES}, got {cold!r}")
    if ring is not None and not 0.0 <= float(ring) <= 1.0:
        raise InputError(f"expert_ring must be a fraction in [0, 1], got {ring!r}")
    E, k = c.n_expert, c.n_expert_used
    geo = _layer_geometry(f, c)
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
        staging = 0
        n_slots = {i: E for i in layers}
    else:
        staging = min(staging, E)
        avail = budget - staging * group_bpe
        if avail < 0:
            raise InputError(f"expert_budget = {budget} bytes is below the staging of {staging} experts "
                             f"({staging * group_bpe} bytes); lower expert_staging or raise the budget")
        n_slots = _allocate(layers, bpe, E, k, avail, policy, counts)
    if policy == "frequency" and counts is None and not full:
        warnings.warn("expert_policy='frequency' without calibrated counts: using the static order "
                      "(run Engine.calibrate_experts or sharpi_jax.experts.residency.calibrate)", stacklevel=3)
    ring_frac = (1.0 if policy in ("lru", "slru") else 0.0) if ring is None else float(ring)
    smr = DEFAULT_STREAM_MIN_ROWS if stream_min_rows is None else int(stream_min_rows)
    specs = {}
    for i in layers:
        order = _order(E, counts.get(i) if counts and policy != "static" else None)
        n = n_slots[i]
        n_ring = 0 if full else int(round(ring_frac * n))
        specs[i] = LayerSpec(layer=i, n_expert=E, top_k=k, d_model=c.d_model, d_ff=c.expert_ff, qtypes=geo[i][0],
                             resident=tuple(order[:n]), n_ring=n_ring, bytes_per_expert=bpe[i], staging=staging,
                             cold=cold, stream_min_rows=smr, policy=policy)
    plan = ResidencyPlan(policy, budget, staging, specs, total, min_budget, counts_source)
    assert plan.slot_bytes + plan.staging_bytes <= budget or full, "planner exceeded the budget"
    return plan


def _order(n_expert: int, counts: Sequence[int] | None) -> list[int]:
    """Expert ids by calibrated count (descending, ties by id), or 0..E-1 without counts."""
    if counts is None:
        return list(range(n_expert))
    c = np.asarray(counts, np.int64)
    return [int(e) for e in np.argsort(-c, kind="stable")]


def _allocate(layers, bpe, E, k, avail, policy, counts) -> dict[int, int]:
    """Slots per layer within `avail` bytes: round robin, or (frequency) a floor then counts per byte."""
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

    if policy != "frequency" or counts is None:
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


# ----------------------------------------------------------------------------- counts files


def counts_paths(model_path: str | os.PathLike[str]) -> list[Path]:
    """Where calibrated counts for a model are looked for: beside it, then in the cache dir."""
    p = Path(model_path)
    cache = Path(os.environ.get("SHARPI_CACHE", Path.home() / ".cache" / "sharpi-jax")) / "expert-counts"
    size = p.stat().st_size if p.exists() else 0
    return [Path(str(p) + COUNTS_SUFFIX), cache / f"{p.name}-{size}{COUNTS_SUFFIX}"]


def load_counts(source: Any, model_path: str | os.PathLike[str], c: ModelConfig
                ) -> tuple[dict[int, list[int]] | None, str | None]:
    """Counts {layer: [E]} from a dict, a JSON path, or (None) the default files; (None, None) if absent."""
    if isinstance(source, Mapping):
        data, where = dict(source), "<dict>"
    else:
        paths = [Path(source)] if source is not None else counts_paths(model_path)
        found = [p for p in paths if p.exists()]
        if not found:
            if source is not None:
                raise InputError(f"expert counts file {source} does not exist")
            return None, None
        where = str(found[0])
        try:
            data = json.loads(found[0].read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"expert counts file {where}: {e}") from None
    layers = data.get("layers", data)
    try:
        out = {int(i): [int(x) for x in v] for i, v in layers.items()}
    except (TypeError, ValueError, AttributeError):
        raise InputError(f"expert counts {where}: expected {{'layers': {{layer: [n_expert counts]}}}}") from None
    bad = [i for i, v in out.items() if len(v) != c.n_expert]
    if bad:
        raise InputError(f"expert counts {where}: layer {bad[0]} has {len(out[bad[0]])} counts, the model has "
                         f"{c.n_expert} experts")
    return out, where


def save_counts(counts: Mapping[int, Sequence[int]], model_path: str | os.PathLike[str], c: ModelConfig,
                tokens: int, path: str | os.PathLike[str] | None = None) -> Path:
    """Write counts JSON beside the model (or to the cache dir when that is not writable)."""
    data = {"format": COUNTS_FORMAT, "model": Path(model_path).name, "n_expert": c.n_expert,
            "top_k": c.n_expert_used, "tokens": int(tokens),
            "layers": {str(i): [int(x) for x in v] for i, v in sorted(counts.items())}}
    targets = [Path(path)] if path is not None else counts_paths(model_path)
    err = None
    for t in targets:
        try:
            t.parent.mkdir(parents=True, exist_ok=True)
            tmp = t.with_name(t.name + ".partial")
            tmp.write_text(json.dumps(data))
            tmp.replace(t)
            return t
        except OSError as e:
            err = e
    raise InputError(f"cannot save expert counts ({targets}): {err}")


# ----------------------------------------------------------------------------- the module


def _set(v, value):
    if isinstance(v, nnx.Dict):
        for k, x in v.items():
            x[...] = value[k]
    else:
        v[...] = value


class _Stacked:
    """Duck-typed ExpertWeights over two stacks: index e < n_a reads `a`, else `b[e - n_a]`.

    What `dispatch._grouped` / `_per_token` need (n_expert, input_orders, dequant_expert): the slot
    stack and the streamed staging computed in one pass without concatenating them."""

    def __init__(self, a, b, n_a: int):
        self.a, self.b, self.n_a = a, b, n_a
        self.n_expert = (a.n_expert if a is not None else 0) + (b.n_expert if b is not None else 0)
        self.input_orders = (a if a is not None else b).input_orders

    def dequant_expert(self, e, k_order="natural"):
        if self.b is None:
            return self.a.dequant_expert(e, k_order)
        if self.a is None:
            return self.b.dequant_expert(e - self.n_a, k_order)
        return jax.lax.cond(e < self.n_a, lambda e: self.a.dequant_expert(e, k_order),
                            lambda e: self.b.dequant_expert(e - self.n_a, k_order), e)




def _matrix_shape(spec: LayerSpec, m: str) -> tuple[int, int]:
    return (spec.d_model, spec.d_ff) if m == "down" else (spec.d_ff, spec.d_model)


def staging_buffer(spec: LayerSpec) -> nnx.Dict:
    """The device staging of streamed experts ([staging, ...] in slot storage form; empty when the
    layer only host-computes). One per block-type mix, shared by its layers (they run one at a time)."""

    G = spec.staging if spec.cold != "host" else 0
    return nnx.Dict({m: storage_variables(expert_storage((G,) + _matrix_shape(spec, m), spec.qtypes[j]), ExpertCache)
                     for j, m in enumerate(MATRICES)})


class ResidentExperts(nnx.Module):
    """One MoE layer's routed experts under residency: slot stack + LUT + ring state (see module doc).

    Called by `moe.MoE` in place of `routed_experts(u, sel, w, experts)`; returns the same rows bit for
    bit, whichever experts are resident.

    Layout of one call: `lax.cond(all hit)` returns the output, the small state (LUT, ring, counters),
    the staging buffer (the callback's experts, or the old buffer passed through) and the ring slots
    to overwrite; the stack is written after the cond, by a second cond on "any slot to overwrite".
    (Writing the stack inside the first cond made XLA copy the whole stack on every miss.)
    """

    def __init__(self, spec: LayerSpec, streamer: Streamer, staged: nnx.Dict | None = None, mode: str = "grouped"):
        """staged: the staging buffer shared by the layers of this block-type mix (`staging_buffer`);
        mode: the dispatch of device-resident experts ("grouped" | "per_token", bitwise equal)."""
        if mode not in EXPERT_MODES:
            raise ValueError(f"expert_mode must be one of {EXPERT_MODES}, got {mode!r}")
        self.spec = spec
        self.streamer = streamer
        self.mode = mode
        S, E = spec.n_slots, spec.n_expert
        for j, m in enumerate(MATRICES):
            shape = (S,) + _matrix_shape(spec, m)
            setattr(self, m, storage_variables(expert_storage(shape, spec.qtypes[j]), ExpertCache))
        self.staged = staged if staged is not None else staging_buffer(spec)
        i32 = jnp.int32
        self.lut = ExpertCache(jnp.full((E,), -1, i32))
        self.slot_expert = ExpertCache(jnp.full((S,), -1, i32))
        self.stamp = ExpertCache(jnp.zeros((S,), i32))
        self.protected = ExpertCache(jnp.zeros((S,), i32))
        self.clock = ExpertCache(jnp.zeros((), i32))
        self.counts = ExpertCache(jnp.zeros((E,), i32))
        self.ctr = ExpertCache(jnp.zeros((len(CTR),), i32))

    _SMALL = ("lut", "slot_expert", "stamp", "protected", "clock", "counts", "ctr")

    def _weights(self, stack):
        return ExpertWeights.from_storage(stack["gate"], stack["up"], stack["down"], self.spec.qtypes)

    def __call__(self, u: jax.Array, sel: jax.Array, w: jax.Array, valid: jax.Array | None) -> jax.Array:
        """`moe.ExpertProvider`: the same rows as `routed_experts` on all experts, bit for bit."""
        s, mode = self.spec, self.mode
        N, k = sel.shape
        E, S = s.n_expert, s.n_slots
        v = {name: storage_values(getattr(self, name)) for name in self._SMALL}
        stack = {m: storage_values(getattr(self, m)) for m in MATRICES}
        staged = {m: storage_values(self.staged[m]) for m in MATRICES}
        vmask = jnp.ones((N, k), bool) if valid is None else jnp.broadcast_to(valid[:, None], (N, k))
        slot = v["lut"][sel]
        hit = slot >= 0
        ctr = v["ctr"]
        for name, val in (("batches", 1), ("rows", vmask[:, 0].sum()), ("pairs", vmask.sum()),
                          ("hits", (vmask & hit).sum()), ("misses", (vmask & ~hit).sum())):
            ctr = ctr.at[_C[name]].add(jnp.asarray(val, jnp.int32))
        batch_counts = jnp.bincount(jnp.where(vmask, sel, E).reshape(-1), length=E + 1)[:E].astype(jnp.int32)
        v["ctr"] = ctr.at[_C["unique"]].add((batch_counts > 0).sum().astype(jnp.int32))
        v["counts"] = v["counts"] + batch_counts
        v["clock"] = v["clock"] + 1
        used = jnp.zeros((S + 1,), bool).at[jnp.where(hit, slot, S).reshape(-1)].set(True)[:S]
        if s.n_ring:
            hit_ring = used & (jnp.arange(S) >= s.n_pin)
            v["stamp"] = jnp.where(hit_ring, v["clock"], v["stamp"])
            if s.policy == "slru":
                v["protected"] = _promote(v["protected"], v["stamp"], hit_ring, s.protected_cap)
        no_write = jnp.full((self._n_write(N),), S, jnp.int32)

        def fast(v, stack, staged, u, sel, w, slot, used, vmask):
            out = dispatch.routed_experts(u, slot, w, self._weights(stack), mode=mode)
            return out, v, staged, no_write

        def slow(v, stack, staged, u, sel, w, slot, used, vmask):
            return self._slow(v, stack, staged, u, sel, w, slot, used, vmask, mode)

        args = (v, stack, staged, u, sel, w, slot, used, vmask)
        if S == 0:
            out, v, staged, tgt = slow(*args)
        else:
            out, v, staged, tgt = jax.lax.cond(jnp.all(hit), fast, slow, *args)
        if tgt.shape[0]:
            nv = tgt.shape[0]
            stack = jax.lax.cond(jnp.any(tgt < S),
                                 lambda st: {m: jax.tree.map(lambda a, b: a.at[tgt].set(b[:nv], mode="drop"),
                                                             st[m], staged[m]) for m in MATRICES},
                                 lambda st: st, stack)
        for name in self._SMALL:
            _set(getattr(self, name), v[name])
        for m in MATRICES:
            _set(getattr(self, m), stack[m])
            _set(self.staged[m], staged[m])
        return out

    def _n_write(self, n_rows: int) -> int:
        """Ring slots one batch may overwrite (static)."""
        return min(self.spec.n_stage(n_rows), self.spec.n_ring)

    def _slow(self, v, stack, staged, u, sel, w, slot, used, vmask, mode):
        """Some pair misses: one callback streams / host-computes the cold experts; ring decisions."""
        s = self.spec
        N, k = sel.shape
        E, S, D, F = s.n_expert, s.n_slots, s.d_model, s.d_ff
        hit = slot >= 0
        m_max = min(N * k, E)
        n_stage = s.n_stage(N)
        with_host = n_stage < m_max
        mcount = jnp.bincount(jnp.where(hit, E, sel).reshape(-1), length=E + 1)[:E]
        order = jnp.argsort(-mcount, stable=True)[:m_max].astype(jnp.int32)  # most rows first
        is_miss = mcount[order] > 0
        rank = jnp.arange(m_max)
        stream_ids = jnp.pad(jnp.where(is_miss & (rank < n_stage), order, -1)[:n_stage],
                             (0, max(0, n_stage - m_max)), constant_values=-1)
        host_ids = jnp.where(is_miss & (rank >= n_stage), order, -1)
        shapes = []
        if n_stage:
            src = self.streamer.sources[s.layer]
            shapes += [jax.ShapeDtypeStruct((n_stage,) + vw.shape[1:], jnp.uint8) for vw in src.views]
        if with_host:
            shapes.append(jax.ShapeDtypeStruct((N, k, D), jnp.float32))
        res = io_callback(functools.partial(self.streamer.serve, s.layer, n_stage, with_host), tuple(shapes),
                          stream_ids, host_ids, u, sel, vmask[:, 0], ordered=False)
        ctr = v["ctr"]
        ctr = ctr.at[_C["slow_batches"]].add(1)
        ctr = ctr.at[_C["streamed"]].add((stream_ids >= 0).sum().astype(jnp.int32))
        ctr = ctr.at[_C["host_experts"]].add((host_ids >= 0).sum().astype(jnp.int32))
        tgt = jnp.full((self._n_write(N),), S, jnp.int32)
        if n_stage:
            shapes3 = ((n_stage, F, D), (n_stage, F, D), (n_stage, D, F))
            staged = {m: to_expert_storage(res[j], shapes3[j], s.qtypes[j]) for j, m in enumerate(MATRICES)}
            if s.n_ring:
                v, ctr, tgt = self._insert(v, ctr, stream_ids, used)
        v["ctr"] = ctr
        # Pair -> index into [slot stack ; staging], or -1 for host-computed pairs.
        pos = jnp.full((E + 1,), -1, jnp.int32)
        if n_stage:
            pos = pos.at[jnp.where(stream_ids >= 0, stream_ids, E)].set(jnp.arange(n_stage, dtype=jnp.int32))
        sp = pos[:E][sel]
        idx = jnp.where(hit, slot, jnp.where(sp >= 0, S + sp, -1))
        on_dev = idx >= 0
        v["ctr"] = v["ctr"].at[_C["host_pairs"]].add((vmask & ~on_dev).sum().astype(jnp.int32))
        if S or n_stage:
            view = _Stacked(self._weights(stack) if S else None, self._weights(staged) if n_stage else None, S)
            idx_d = jnp.where(on_dev, idx, jnp.maximum(jnp.max(idx), 0))  # host pairs ride along a used expert
            y_dev = jax.lax.cond(jnp.any(on_dev), lambda: dispatch.expert_rows(u, idx_d, view, mode)[0],
                                 lambda: jnp.zeros((N, k, D), jnp.float32))
            y = jnp.where(on_dev[..., None], y_dev, res[-1]) if with_host else y_dev
        else:
            y = res[-1]
        return dispatch.weighted_reduce(y, w.astype(jnp.float32)), v, staged, tgt

    def _insert(self, v, ctr, stream_ids, used):
        """Ring victims for the streamed experts (unused by this batch, probation first, then least
        recently used) and the bookkeeping; returns the slots to overwrite (S: none)."""
        s = self.spec
        E, S = s.n_expert, s.n_slots
        nv = min(stream_ids.shape[0], s.n_ring)  # == _n_write(N): the shape the fast branch returns
        ring = jnp.arange(s.n_pin, S, dtype=jnp.int32)
        used_r, prot_r, stamp_r = used[s.n_pin:], v["protected"][s.n_pin:], v["stamp"][s.n_pin:]
        victims = ring[jnp.lexsort((stamp_r, prot_r, used_r))[:nv]]  # last key is the primary one
        sid = stream_ids[:nv]
        ok = (sid >= 0) & ~used[victims]
        old = v["slot_expert"][victims]
        evict = ok & (old >= 0)
        lut = v["lut"].at[jnp.where(evict, old, E)].set(-1, mode="drop")
        lut = lut.at[jnp.where(ok, sid, E)].set(victims, mode="drop")
        tgt = jnp.where(ok, victims, S)
        v["lut"] = lut
        v["slot_expert"] = v["slot_expert"].at[tgt].set(sid, mode="drop")
        v["stamp"] = v["stamp"].at[tgt].set(v["clock"], mode="drop")
        v["protected"] = v["protected"].at[tgt].set(0, mode="drop")
        ctr = ctr.at[_C["evicted"]].add(evict.sum().astype(jnp.int32))
        ctr = ctr.at[_C["ring_inserts"]].add(ok.sum().astype(jnp.int32))
        return v, ctr, tgt


def _promote(protected, stamp, hit_ring, cap: int):
    """SLRU: hits join the protected segment; beyond `cap`, the oldest unhit protected slots drop back."""
    prot = (protected > 0) | hit_ring
    over = prot.sum() - cap
    cand = prot & ~hit_ring
    order = jnp.lexsort((stamp, ~cand))
    rank = jnp.zeros(prot.shape, jnp.int32).at[order].set(jnp.arange(prot.shape[0], dtype=jnp.int32))
    return (prot & ~(cand & (rank < over))).astype(jnp.int32)


# ----------------------------------------------------------------------------- engine glue


class Residency:
    """A plan bound to an open GGUF: builds the layers' modules, loads their slots, reads stats."""

    def __init__(self, f: GGUFFile, config: ModelConfig, plan: ResidencyPlan,
                 counts: Mapping[int, Sequence[int]] | None = None, prefetch_experts: int = 16):
        self.gguf, self.config, self.plan = f, config, plan
        pinned = {i: s.resident[: s.n_pin] for i, s in plan.layers.items()}
        self.streamer = Streamer(f, sorted(plan.layers), config.d_model, config.expert_ff, pinned=pinned,
                                 counts=counts, prefetch_experts=prefetch_experts)
        self._pending: dict = {}  # SoA fields of the slot stack being loaded

    # ----- model construction -----
    def experts_module(self, layer: int, mode: str, shared: dict) -> ResidentExperts | None:
        """The layer's ResidentExperts, or None when the layer is not managed (e.g. the MTP block).
        Layers of one block-type mix share one staging buffer, kept in `shared` (one per model build)."""
        spec = self.plan.layers.get(layer)
        if spec is None:
            return None
        if spec.qtypes not in shared:
            shared[spec.qtypes] = staging_buffer(spec)
        return ResidentExperts(spec, self.streamer, shared[spec.qtypes], mode)

    def source(self, layer: int, path: tuple) -> Callable[[], Any]:
        """The loader of one param of the layer's ResidentExperts (slot stacks, LUT, ring state)."""
        return lambda: self._param(layer, path[0], tuple(path[1:]))

    def _param(self, layer: int, name: str, rest: tuple):
        spec = self.plan.layers[layer]
        ids = np.asarray(spec.resident, np.int64)
        S, E = spec.n_slots, spec.n_expert
        field = rest[0] if rest else None
        if name == "staged":  # staging buffer: zeros until a batch streams into it
            m = MATRICES.index(rest[0])
            G = spec.staging if spec.cold != "host" else 0
            want = expert_storage((G,) + _matrix_shape(spec, rest[0]), spec.qtypes[m])
            want = want[rest[1]] if len(rest) > 1 else want
            return np.zeros(want.shape, want.dtype)
        if name in MATRICES:
            m = MATRICES.index(name)
            view = self.streamer.sources[layer].views[m]
            shape = (S,) + _matrix_shape(spec, name)
            return field_of(self._pending, (layer, name), field,
                            lambda: to_expert_storage(np.ascontiguousarray(view[ids]), shape, spec.qtypes[m]))
        if name == "lut":
            lut = np.full(E, -1, np.int32)
            lut[ids] = np.arange(S, dtype=np.int32)
            return lut
        if name == "slot_expert":
            return ids.astype(np.int32)
        zeros = {"stamp": (S,), "protected": (S,), "clock": (), "counts": (E,), "ctr": (len(CTR),)}
        return np.zeros(zeros[name], np.int32)

    # ----- counters -----
    def counters(self, runtime) -> dict:
        """Cumulative device counters {layer: {name: int}}, per-expert counts and host counters."""
        dev, counts = {}, {}
        for path, arr in runtime.expert_cache_arrays().items():
            if len(path) >= 5 and path[0] == "layers" and path[2:4] == ("ffn", "experts"):
                layer = int(path[1])
                if path[4] == "ctr":
                    dev[layer] = dict(zip(CTR, (int(x) for x in np.asarray(arr))))
                elif path[4] == "counts":
                    counts[layer] = np.asarray(arr).astype(np.int64)
        return {"device": dev, "counts": counts, "host": self.streamer.snapshot()}

    @staticmethod
    def zero_counters(like: dict) -> dict:
        """Counters of a fresh engine, shaped like `like` (stats since load)."""
        return {"device": {i: {n: 0 for n in CTR} for i in like["device"]},
                "counts": {i: np.zeros_like(c) for i, c in like["counts"].items()},
                "host": {k: {i: 0 for i in v} for k, v in like["host"].items()}}

    def stats(self, before: dict, after: dict) -> dict:
        """What a run cost between two `counters` snapshots.

        tokens: trunk rows processed (valid rows: prompt, decode and verify rows alike); hit_rate(_per_layer):
        resident (row, expert) pairs / all pairs; bytes_streamed(_per_token): expert bytes copied from
        the mmap into staging (per processed token); callbacks / callback_s: host callbacks and their
        time (host compute included, host_compute_s alone); experts_host_computed / host_bytes_read;
        experts_evicted / ring_inserts (lru/slru); all_hot_batches: layer calls with no miss (no
        callback); unique_experts_per_batch; per_layer: the raw counters."""
        layers = sorted(after["device"])
        d = {i: {n: after["device"][i][n] - before["device"][i][n] for n in CTR} for i in layers}
        h = {n: {i: after["host"][n][i] - before["host"][n][i] for i in layers} for n in after["host"]}
        pairs = sum(d[i]["pairs"] for i in layers)
        hits = sum(d[i]["hits"] for i in layers)
        tokens = d[layers[0]]["rows"] if layers else 0
        streamed_bytes = sum(h["streamed_bytes"].values())
        plan = self.plan
        return {
            "policy": plan.policy,
            "budget_bytes": plan.budget,
            "resident_bytes": plan.slot_bytes,
            "staging_bytes": plan.staging_bytes,
            "resident_fraction": plan.resident_fraction,
            "counts_source": plan.counts_source,
            "cold": sorted({s.cold for s in plan.layers.values()}),
            "staging_memory": self.streamer.staging_kind,
            "tokens": tokens,
            "hit_rate": hits / pairs if pairs else 1.0,
            "hit_rate_per_layer": {i: (d[i]["hits"] / d[i]["pairs"] if d[i]["pairs"] else 1.0) for i in layers},
            "all_hot_batches": sum(d[i]["batches"] - d[i]["slow_batches"] for i in layers),
            "unique_experts_per_batch": (sum(d[i]["unique"] for i in layers) / sum(d[i]["batches"] for i in layers)
                                         if layers and sum(d[i]["batches"] for i in layers) else 0.0),
            "callbacks": sum(h["calls"].values()),
            "callback_s": sum(h["callback_s"].values()),
            "host_compute_s": sum(h["host_s"].values()),
            "experts_streamed": sum(d[i]["streamed"] for i in layers),
            "bytes_streamed": streamed_bytes,
            "bytes_streamed_per_token": streamed_bytes / tokens if tokens else 0.0,
            "experts_host_computed": sum(d[i]["host_experts"] for i in layers),
            "host_bytes_read": sum(h["host_bytes"].values()),
            "experts_evicted": sum(d[i]["evicted"] for i in layers),
            "ring_inserts": sum(d[i]["ring_inserts"] for i in layers),
            "prefetched_experts": sum(h["prefetch_experts"].values()),
            "per_layer": {i: {**d[i], "callback_s": h["callback_s"][i], "bytes_streamed": h["streamed_bytes"][i]}
                          for i in layers},
        }

    def resident_bytes(self, runtime, what: str = "slots") -> int:
        """nbytes actually on the device (the memory check): "slots" (the slot stacks), "staging"
        (the streaming buffers) or "all"."""
        names = {"slots": MATRICES, "staging": ("staged",), "all": MATRICES + ("staged",)}[what]
        total = 0
        for path, arr in runtime.expert_cache_arrays().items():
            if len(path) >= 5 and path[2:4] == ("ffn", "experts") and path[4] in names:
                total += int(arr.nbytes)
        return total


def non_expert_bytes(f: GGUFFile, c: ModelConfig) -> int:
    """Device bytes of every param except the routed experts, as the loader holds them."""
    return model_non_expert_bytes(f, c)


OPTION_NAMES = ("expert_counts", "expert_staging", "expert_ring", "expert_cold", "expert_stream_min_rows",
                "expert_prefetch", "device_budget")


def configure(f: GGUFFile, config: ModelConfig, expert_budget: int | None = None,
              expert_policy: str = "frequency", **options: Any) -> Residency | None:
    """The Residency for `sj.load(..., expert_budget=, expert_policy=, ...)`, or None (all resident).

    options: device_budget (bytes for non-expert weights + experts, instead of expert_budget),
    expert_counts (dict or JSON path; default: the file beside the model), expert_staging (experts
    streamable per layer and batch, >= top-k), expert_ring (ring fraction of each layer's slots),
    expert_cold ("auto" | "stream" | "host"), expert_stream_min_rows, expert_prefetch (experts
    madvise'd ahead per layer).
    """
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise InputError(f"unknown load option(s) {unknown}; residency options are {OPTION_NAMES}")
    device_budget = options.get("device_budget")
    if expert_budget is not None and config.is_moe:
        expert_budget = parse_expert_budget(expert_budget, f, config)
    if expert_budget is None and device_budget is None:
        if any(options.get(n) is not None for n in OPTION_NAMES):
            raise InputError("expert residency options need expert_budget (or device_budget)")
        return None
    if expert_budget is not None and device_budget is not None:
        raise InputError("give expert_budget or device_budget, not both")
    if not config.is_moe:
        raise InputError(f"expert_budget applies to MoE models; {f.source} ({config.arch}) has no routed experts")
    if device_budget is not None:
        if isinstance(device_budget, bool) or not isinstance(device_budget, (int, np.integer)) or device_budget < 0:
            raise InputError(f"device_budget must be a non-negative integer number of bytes, got {device_budget!r}")
        dense = non_expert_bytes(f, config)
        min_exp = _min_budget(f, config)
        if device_budget < dense + min_exp:
            raise InputError(
                f"device_budget = {device_budget} bytes is too small: the minimum is {dense + min_exp} bytes "
                f"(non-expert weights {dense} + one layer's top-k experts {min_exp})")
        expert_budget = int(device_budget) - dense
    counts, source = load_counts(options.get("expert_counts"), f.path, config)
    plan = plan_residency(f, config, expert_budget, expert_policy, counts, counts_source=source,
                          staging=options.get("expert_staging"), ring=options.get("expert_ring"),
                          cold=options.get("expert_cold"), stream_min_rows=options.get("expert_stream_min_rows"))
    prefetch = options.get("expert_prefetch")
    return Residency(f, config, plan, counts, 16 if prefetch is None else int(prefetch))


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
                     f"like '25%' (0-100%], got {value!r}")


def budget_for_fraction(f: GGUFFile, config: ModelConfig, frac: float) -> int:
    """expert_budget bytes whose slot stacks hold `frac` of all routed experts (plus the top-k staging
    when frac < 1), rounded to whole experts: what the benches and tests sweep."""
    geo = _layer_geometry(f, config)
    bpe = max(b for _, b in geo.values())
    total = sum(config.n_expert * b for _, b in geo.values())
    if frac >= 1.0:
        return total
    return int(frac * total) // bpe * bpe + _min_budget(f, config)


def _min_budget(f: GGUFFile, config: ModelConfig) -> int:
    """One layer's top-k of staging per expert block-type mix (see the module doc)."""
    return config.n_expert_used * sum(dict(_layer_geometry(f, config).values()).values())


def calibrate(engine, prompts: Sequence[Any], save: bool | str | os.PathLike[str] = True) -> dict[int, list[int]]:
    """Routing counts {layer: [E]} over teacher-forced prompts (text or ids), saved for 'frequency'.

    The engine must have been loaded with an expert budget (any: the counts are routing decisions, which
    do not depend on residency). save=True writes beside the model (or the cache dir); a path writes there.
    """
    res = getattr(engine, "residency", None)
    if res is None:
        raise InputError("calibrate needs an engine loaded with expert_budget= (any budget; the full one "
                         "keeps every expert resident)")
    before = res.counters(engine.runtime)["counts"]
    tokens = 0
    for p in prompts:
        ids = engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
        engine.logits(ids)
        tokens += len(ids)
    after = res.counters(engine.runtime)["counts"]
    counts = {i: [int(x) for x in after[i] - before[i]] for i in sorted(after)}
    if save:
        save_counts(counts, engine.path, engine.config, tokens, None if save is True else save)
    return counts
