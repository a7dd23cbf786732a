"""Cold routed experts (not resident on the device): ONE host callback per MoE layer and batch.

When a batch routes to experts that are not in the layer's device slots (`residency`), the jitted step
calls `Streamer.serve` once for that layer with every missing expert id. The callback does two things:

- streams: copies the first `n_stage` missing experts (the ones with the most rows in the batch: they
  pay for their transfer best) from the mmap'd GGUF (`GGUFFile.raw` views, zero-copy) into a
  per-layer host staging buffer, which the runtime then copies to the device; the device computes
  them there and the ring policies (lru/slru) keep them in recently-used slots;
- host-computes the rest: runs the routed FFN of the remaining missing experts on the host CPU,
  straight from the mmap bytes, and returns their rows' outputs [N, k, D] (zeros elsewhere).

Bit parity: host rows are computed by the same jitted expert code as the device path
(`dispatch.expert_rows` on expert stacks laid out by the layer's own `provider.ExpertFormat`, products
of >= 2 rows) on the XLA:CPU backend, so on a CPU device they equal the device rows bit for bit. On a GPU device the host rows come from
XLA:CPU and are not bitwise the GPU's (use `cold="stream"` there for bit parity).

Pinned host memory: the staging buffers are reused numpy arrays (the CPU backend copies a callback's
result into its own buffer, so reuse is safe; tests check it), one set per device of an expert axis
(the devices call at once). JAX has no public API to page-lock an existing numpy buffer, so the pinned
path is not this module: `expert_store="pinned_host"` keeps every expert laid out in JAX's
"pinned_host" memory and moves misses inside the step with no callback (`residency.slots`, the
default on a GPU). `staging_memory_kind()` says what this callback's staging is on this backend.

Prefetch: after serving layer l, `madvise(WILLNEED)` is issued on the byte ranges of the next MoE
layer's likely cold experts: its most frequent non-pinned experts from calibrated counts (when the
model has them) and the experts that missed there in the previous batch.

Host compute vs streaming: `DEFAULT_STREAM_MIN_ROWS` is the batch size (rows of the jitted bucket) from
which streaming is used ("auto" mode); below it, every miss is computed on the host. Measured with
`python -m experiments.bench_residency --threshold_only` (see that module and the constant's comment).
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import jax
import numpy as np

from sharpi_jax.experts import dispatch
from sharpi_jax.gguf.reader import GGUFFile
from sharpi_jax.gguf.tensor_specs import EXPERT_MATRICES, expert_qtypes, expert_raw

# Bucket rows N from which "auto" streams cold experts instead of computing them on the host.
# Measured on this project's CPU machine (2 shared cores, XLA:CPU device) with
# `python -m experiments.bench_residency --n_layer=2 --n_vocab=4096 --threshold_only`: one layer of the
# 35B-A3B shape (Q4_K experts, 256, top-8, D 2048, F 512), every expert cold, staging sized to the
# batch, min process CPU ms of 5 calls, stream / host:
#   N=2 (decode, 8 experts) 41.9 / 42.2;  N=4 (32) 363 / 191;  N=8 (56) 323 / 408;
#   N=16 (98) 624 / 755;  N=32 (163) 1048 / 1418;  N=64 (214) 1550 / 1650.
# Decode is a tie (on CPU the "device" is the host: both paths dequantize the same bytes), streaming
# wins by 10-25% from N = 8. On a GPU the crossover is elsewhere: re-measure there.
DEFAULT_STREAM_MIN_ROWS = 8

COLD_MODES = ("auto", "stream", "host")
MATRICES = EXPERT_MATRICES


def staging_memory_kind() -> str:
    """Where streamed experts are staged on this backend, in words (for stats and reports)."""
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    if dev.platform == "cpu":
        return ("host numpy (CPU backend: device memory is host memory, a transfer is a memcpy; "
                "pinned_host is listed but brings nothing)")
    if "pinned_host" in kinds:
        return ("host numpy, not page-locked (pinned_host exists on this backend; registering the buffers "
                "is not implemented)")
    return "host numpy (no pinned_host memory kind on this backend)"


def _next_pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def _host_fn(fns: dict, fmt, row_kernel: str):
    """Jitted host computation: rows x [P, D] through local experts (raw GGUF bytes, laid out inside by
    the layer's `provider.ExpertFormat` `fmt`) -> [P, D]; kept in `fns` (the engine's `Streamer`'s, so
    the compiled code goes with the engine)."""
    key = (fmt.fmt, fmt.backend, fmt.qtypes, fmt.d_model, fmt.d_ff, row_kernel)
    if key not in fns:
        def fn(x, lsel, rg, ru, rd):
            experts = tuple(fmt.pack(r, m) for r, m in zip((rg, ru, rd), MATRICES))
            y, _ = dispatch.expert_rows(x, lsel, experts, "grouped", row_kernel)
            return y[:, 0]

        fns[key] = jax.jit(fn)
    return fns[key]


class LayerSource:
    """One MoE layer's routed experts in the mmap: zero-copy [E, rows, row_bytes] views per matrix."""

    def __init__(self, f: GGUFFile, layer: int, d_model: int, d_ff: int):
        self.layer = layer
        self.d_model, self.d_ff = d_model, d_ff
        self.views = tuple(expert_raw(f, layer, m) for m in MATRICES)
        self.qtypes = tuple(int(q) for q in expert_qtypes(f, layer))
        self.n_expert = self.views[0].shape[0]
        self.bytes_per_expert = sum(int(v[0].nbytes) for v in self.views)
        # Per matrix: (file offset of expert 0, stride between experts, bytes of one expert).
        self.ranges = tuple((f.offset_of(v), v.strides[0], int(v[0].nbytes)) for v in self.views)


class Streamer:
    """The host side of cold experts for one engine: mmap sources, staging buffers, counters.

    Held by every `residency.ResidentExperts` module of the engine (a static attribute); the jitted step
    calls `serve` through `jax.experimental.io_callback`, once per layer per batch with misses.
    """

    def __init__(self, f: GGUFFile, layers: Sequence[int], d_model: int, d_ff: int, *,
                 pinned: dict[int, Sequence[int]] | None = None, counts: dict[int, Sequence[int]] | None = None,
                 prefetch_experts: int = 16):
        self.gguf = f
        self.layers = tuple(layers)
        self.sources = {i: LayerSource(f, i, d_model, d_ff) for i in self.layers}
        self._next = {a: b for a, b in zip(self.layers, self.layers[1:])}
        # Host buffers by (layer, experts, device): reused across calls (see the module doc).
        self._staging: dict[tuple[int, int, int], tuple[np.ndarray, ...]] = {}
        self._ahead: dict[tuple[int, int, int], tuple[np.ndarray, ...]] = {}  # lookahead fetches' buffers
        self._last_miss: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self.prefetch_experts = int(prefetch_experts)
        self._likely: dict[int, np.ndarray] = {}
        pinned = pinned or {}
        for i in self.layers:
            if counts and i in counts:
                c = np.asarray(counts[i], np.int64)
                keep = set(pinned.get(i, ()))
                order = [int(e) for e in np.argsort(-c, kind="stable") if c[e] > 0 and int(e) not in keep]
                self._likely[i] = np.asarray(order[: self.prefetch_experts], np.int64)
        self.staging_kind = staging_memory_kind()
        self.formats: dict = {}  # layer -> its provider.ExpertFormat (set when the layer's module is built)
        self.host_fns: dict = {}  # the jitted host computations by expert format (`_host_fn`)
        self.reset_stats()

    def close(self) -> None:
        """Drop the mmap views, staging buffers and jitted host computations (the engine is closing)."""
        with self._lock:
            self.sources, self._staging, self._ahead, self._last_miss = {}, {}, {}, {}
            self.host_fns, self.gguf = {}, None

    # ----- counters -----
    def reset_stats(self) -> None:
        z = lambda v=0: {i: v for i in self.layers}  # noqa: E731
        # Bytes streamed and fetched ahead are counted on the device (`residency.stats.run_stats`).
        self.stats = {"calls": z(), "callback_s": z(0.0), "host_s": z(0.0), "streamed_experts": z(),
                      "host_experts": z(), "host_pairs": z(), "host_bytes": z(),
                      "prefetch_experts": z(), "ahead_calls": z(), "ahead_s": z(0.0)}

    def snapshot(self) -> dict:
        """A copy of the cumulative host-side counters."""
        with self._lock:
            return {k: dict(v) for k, v in self.stats.items()}

    # ----- the callback -----
    def _buffers(self, layer: int, n: int, device: int = 0) -> tuple[np.ndarray, ...]:
        key = (layer, n, device)
        if key not in self._staging:
            src = self.sources[layer]
            self._staging[key] = tuple(np.zeros((n,) + v.shape[1:], np.uint8) for v in src.views)
        return self._staging[key]

    def serve(self, layer: int, n_stage: int, with_host: bool, row_kernel: str, stream_ids, host_ids, u, sel,
              valid, device=0):
        """Stream `stream_ids` (>= 0; -1 pads) into staging, host-compute the pairs of `host_ids` (with
        the device's row kernel, `RunConfig.row_kernel`). device: the calling device's index on the
        expert axis (expert parallelism: the devices call at once, each into its own staging buffers).

        Returns (gate, up, down raw staging [n_stage, ...]) if n_stage, then y_host f32 [N, k, D]
        if with_host (pairs of valid rows whose expert is in host_ids; zeros elsewhere: padding
        rows carry zero routing weights)."""
        t0 = time.perf_counter()
        src = self.sources[layer]
        stream_ids = np.asarray(stream_ids)
        host_ids = np.asarray(host_ids)
        streamed = stream_ids[stream_ids >= 0].astype(np.int64)
        hosted = host_ids[host_ids >= 0].astype(np.int64)
        out: list[np.ndarray] = []
        if n_stage:
            bufs = self._buffers(layer, n_stage, int(device))
            for j, e in enumerate(streamed):
                for buf, view in zip(bufs, src.views):
                    buf[j] = view[e]
            out.extend(bufs)
        host_s = 0.0
        n_pairs = 0
        if with_host:
            sel = np.asarray(sel)
            u = np.asarray(u, np.float32)
            y = np.zeros(sel.shape + (src.d_model,), np.float32)
            if hosted.size:
                th = time.perf_counter()
                n_pairs = self._host_compute(src, u, sel, np.asarray(valid, bool), hosted, y, row_kernel)
                host_s = time.perf_counter() - th
            out.append(y)
        self._prefetch(layer, np.concatenate([streamed, hosted]))
        dt = time.perf_counter() - t0
        with self._lock:
            s = self.stats
            s["calls"][layer] += 1
            s["callback_s"][layer] += dt
            s["host_s"][layer] += host_s
            s["streamed_experts"][layer] += int(streamed.size)
            s["host_experts"][layer] += int(hosted.size)
            s["host_bytes"][layer] += int(hosted.size) * src.bytes_per_expert
            s["host_pairs"][layer] += n_pairs
        return tuple(out)

    def fetch(self, layer: int, n: int, ids, device=0):
        """Lookahead (`residency.lookahead`): the raw bytes of experts `ids` (>= 0; -1 pads) of a layer,
        fetched before its call asks for them -> (gate, up, down) [n, ...]; counted apart from demand.
        device: as in `serve` (each device's fetches have their own buffers)."""
        t0 = time.perf_counter()
        src = self.sources[layer]
        ids = np.asarray(ids)
        got = ids[ids >= 0].astype(np.int64)
        key = (layer, n, int(device))
        if key not in self._ahead:  # its own buffers: a demand call's staging may be in flight
            self._ahead[key] = tuple(np.zeros((n,) + v.shape[1:], np.uint8) for v in src.views)
        bufs = self._ahead[key]
        for j, e in enumerate(got):
            for buf, view in zip(bufs, src.views):
                buf[j] = view[e]
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats["ahead_calls"][layer] += 1
            self.stats["ahead_s"][layer] += dt
        return bufs

    def _host_compute(self, src: LayerSource, u: np.ndarray, sel: np.ndarray, valid: np.ndarray,
                      hosted: np.ndarray, y: np.ndarray, row_kernel: str) -> int:
        """Rows of the pairs routed to `hosted` experts, computed from the mmap into y [N, k, D]."""
        local = np.full(src.n_expert, -1, np.int64)
        local[hosted] = np.arange(hosted.size)
        li = np.where(valid[:, None], local[sel], -1)  # [N, k]
        rows, ranks = np.nonzero(li >= 0)
        n_pairs = rows.size
        # Power-of-two buckets (few compiles); >= 2 rows: the row-stable product (see dispatch).
        P = _next_pow2(n_pairs, 4)
        n_loc = _next_pow2(hosted.size, 4)
        x = np.zeros((P, src.d_model), np.float32)
        x[:n_pairs] = u[rows]
        lsel = np.zeros((P, 1), np.int32)
        lsel[:n_pairs, 0] = li[rows, ranks]
        raws = []
        for view in src.views:
            r = np.zeros((n_loc,) + view.shape[1:], np.uint8)
            r[: hosted.size] = view[hosted]
            raws.append(r)
        fn = _host_fn(self.host_fns, self.formats[src.layer], row_kernel)
        with jax.default_device(jax.devices("cpu")[0]):
            out = np.asarray(fn(x, lsel, *raws))
        y[rows, ranks] = out[:n_pairs]
        return int(n_pairs)

    def _prefetch(self, layer: int, missed: np.ndarray) -> None:
        """madvise(WILLNEED) on the next MoE layer's likely cold experts; remember this layer's misses."""
        self._last_miss[layer] = missed
        nxt = self._next.get(layer)
        if nxt is None or self.prefetch_experts <= 0:
            return
        cand = [self._likely.get(nxt, np.zeros(0, np.int64)), self._last_miss.get(nxt, np.zeros(0, np.int64))]
        ids = np.unique(np.concatenate(cand))[: self.prefetch_experts]
        src = self.sources[nxt]
        for e in ids:
            for off, stride, size in src.ranges:
                self.gguf.advise_willneed(off + int(e) * stride, size)
        with self._lock:
            self.stats["prefetch_experts"][nxt] += int(ids.size)
