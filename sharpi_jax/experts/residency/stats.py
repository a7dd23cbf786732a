"""What a residency run cost: cumulative counters (device and host) and the stats between two snapshots."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from sharpi_jax.experts.residency.plan import ResidencyPlan
from sharpi_jax.experts.residency.slots import CTR
from sharpi_jax.experts.streaming import MATRICES


def counters(arrays: Mapping[tuple, Any], host: dict) -> dict:
    """Cumulative device counters {layer: {name: int}} and per-expert counts read from the expert
    cache arrays by path (`Runtime.expert_cache_arrays()`), with the streamer's host counters."""
    dev, counts = {}, {}
    for path, arr in arrays.items():
        if len(path) >= 5 and path[0] == "layers" and path[2:4] == ("ffn", "experts"):
            layer = int(path[1])
            if path[4] == "ctr":
                dev[layer] = dict(zip(CTR, (int(x) for x in _over_devices(np.asarray(arr)))))
            elif path[4] == "counts":  # [n_dev, E / n_dev] under expert parallelism: the global order
                counts[layer] = np.asarray(arr).astype(np.int64).reshape(-1)
    return {"device": dev, "counts": counts, "host": host}


def _over_devices(ctr: np.ndarray) -> np.ndarray:
    """A layer's counters summed over the devices of an expert axis (ctr [n_dev, len(CTR)]; one device:
    [len(CTR)] as it is). Each device counts the pairs of its own experts, so pairs, hits, misses,
    streamed... add up; every device counts every row, so `rows` is one device's; `batches`,
    `slow_batches` and `unique` count device calls."""
    if ctr.ndim == 1:
        return ctr
    out = ctr.sum(axis=0)
    out[CTR.index("rows")] = ctr[0, CTR.index("rows")]
    return out


def zero_counters(like: dict) -> dict:
    """Counters of a fresh engine, shaped like `like` (stats since load)."""
    return {"device": {i: {n: 0 for n in CTR} for i in like["device"]},
            "counts": {i: np.zeros_like(c) for i, c in like["counts"].items()},
            "host": {k: {i: 0 for i in v} for k, v in like["host"].items()}}


def run_stats(plan: ResidencyPlan, staging_kind: str, before: dict, after: dict) -> dict:
    """What a run cost between two `counters` snapshots.

    tokens: trunk rows processed (valid rows: prompt, decode and verify rows alike); hit_rate(_per_layer):
    resident (row, expert) pairs / all pairs; bytes_streamed(_per_token): expert bytes copied from
    the mmap into staging (per processed token); callbacks / callback_s: host callbacks and their
    time (host compute included, host_compute_s alone); experts_host_computed / host_bytes_read;
    experts_evicted / ring_inserts (lru/slru); all_hot_batches: layer calls with no miss (no
    callback); unique_experts_per_batch; per_layer: the raw counters.

    Demand vs lookahead (`lookahead`): hits / misses are (row, expert) pairs found resident or not at
    the call (fetched-ahead experts count as hits); bytes_demand = bytes_streamed + host_bytes_read
    (the cold experts' bytes the calls waited for, streamed or computed on the host);
    experts_prefetched / bytes_prefetched (fetched ahead, off the call), prefetch_useful / _useless
    (fetched experts the next call used / did not); bytes_moved = bytes_demand + bytes_prefetched;
    lookahead_buffer_bytes: the shared lookahead buffers' share of the budget (`plan.buffer_bytes`)."""
    layers = sorted(after["device"])
    d = {i: {n: after["device"][i][n] - before["device"][i][n] for n in CTR} for i in layers}
    h = {n: {i: after["host"][n][i] - before["host"][n][i] for i in layers} for n in after["host"]}
    # Bytes moved to the device, from the device counters: the pinned host store moves experts with no
    # callback, so the host side cannot count them.
    bpe = {i: plan.layers[i].bytes_per_expert if i in plan.layers else 0 for i in layers}
    h["streamed_bytes"] = {i: d[i]["streamed"] * bpe[i] for i in layers}
    h["ahead_bytes"] = {i: d[i]["ahead_streamed"] * bpe[i] for i in layers}
    return {**_plan_stats(plan, staging_kind), **_counter_stats(layers, d, h)}


def _plan_stats(plan: ResidencyPlan, staging_kind: str) -> dict:
    """The run's setup: the plan's policy, modes and byte split, and the staging memory kind."""
    return {
        "policy": plan.policy,
        "lookahead": sorted({s.lookahead for s in plan.layers.values()}),
        "budget_bytes": plan.budget,
        "resident_bytes": plan.slot_bytes,
        "staging_bytes": plan.staging_bytes,
        "lookahead_buffer_bytes": plan.buffer_bytes,
        "resident_fraction": plan.resident_fraction,
        "counts_source": plan.counts_source,
        "cold": sorted({s.cold for s in plan.layers.values()}),
        "staging_memory": staging_kind,
    }


def _counter_stats(layers: list[int], d: dict, h: dict) -> dict:
    """The run's costs from the counter deltas: d {layer: {device counter: delta}}, h {host counter:
    {layer: delta}} (see `run_stats`)."""
    pairs = sum(d[i]["pairs"] for i in layers)
    hits = sum(d[i]["hits"] for i in layers)
    tokens = d[layers[0]]["rows"] if layers else 0
    streamed_bytes = sum(h["streamed_bytes"].values())
    host_bytes = sum(h["host_bytes"].values())
    ahead_bytes = sum(h["ahead_bytes"].values())
    total = lambda name: sum(d[i][name] for i in layers)  # noqa: E731
    return {
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
        "host_bytes_read": host_bytes,
        "hits": hits,
        "misses": pairs - hits,
        "bytes_demand": streamed_bytes + host_bytes,
        "experts_prefetched": total("ahead_streamed"),
        "bytes_prefetched": ahead_bytes,
        "prefetch_useful": total("ahead_useful"),
        "prefetch_useless": total("ahead_useless"),
        "bytes_moved": streamed_bytes + host_bytes + ahead_bytes,
        "experts_evicted": sum(d[i]["evicted"] for i in layers),
        "ring_inserts": sum(d[i]["ring_inserts"] for i in layers),
        "prefetched_experts": sum(h["prefetch_experts"].values()),
        "per_layer": {i: {**d[i], "callback_s": h["callback_s"][i], "bytes_streamed": h["streamed_bytes"][i]}
                      for i in layers},
    }


def resident_bytes(arrays: Mapping[tuple, Any], what: str = "slots") -> int:
    """nbytes actually on the device (the memory check): "slots" (the slot stacks), "staging"
    (the streaming buffers), "buffer" (the lookahead buffers: stacks and labels) or "all"."""
    names = {"slots": MATRICES, "staging": ("staged",), "buffer": ("ahead",),
             "all": MATRICES + ("staged", "ahead")}[what]
    total = 0
    for path, arr in arrays.items():
        if len(path) >= 5 and path[2:4] == ("ffn", "experts") and path[4] in names:
            total += int(arr.nbytes)
    return total
