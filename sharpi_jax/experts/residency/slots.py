"""Resident slots: one MoE layer's routed experts under an expert budget (`model.moe.ExpertProvider`).

Each MoE trunk layer keeps a *slot stack*: the same QTensor stacks as `provider.RoutedExperts` (laid
out by the run's `MatrixFormat`) with leading dim n_slots instead of n_expert, plus a LUT
`[n_expert] -> slot | -1`.
Because an expert's computation does not depend on the index it sits at, routing through `lut[sel]`
into the slot stack gives the same bits as the full [E, ...] stack.

The jitted path (`ResidentExperts.__call__`, one per MoE layer, inside the step): slot = lut[sel];
`lax.cond(all hit)`: the all-hot branch is `dispatch.routed_experts` on the slot stack, device only;
the other branch makes ONE `io_callback` (`streaming.Streamer.serve`) that returns the batch's cold
experts (into staging, most-used first) and/or their rows computed on the host, picks ring victims
(the layer's `policies.SlotPolicy`), and reduces hot, streamed and host rows in rank order (bitwise
as all-resident). After the cond, a second cond copies staged experts into the victims' slots (in
place: inside the first cond XLA copied the whole stack on every miss). Slot stacks, staging, the
LUT, ring state (slot -> expert, recency stamps, SLRU segment) and per-layer counters are
`ExpertCache` variables that every step takes donated and returns (`runtime.steps.Runtime`).

Lookahead buffer (`expert_lookahead_buffer` = P > 0): the experts predicted for a layer are fetched
into a buffer of P experts shared by the layers of a block-type mix (`lookahead_buffer`), labelled
with the layer they were fetched for; a call routes a pair that misses its slots to the buffer entry
holding its expert when the label is its own layer, so the indices address [slot stack ; buffer ;
staging].

Cold mode ("auto" | "stream" | "host"): "auto" streams from `stream_min_rows` bucket rows up
(streaming.DEFAULT_STREAM_MIN_ROWS, measured) and host-computes below; lru/slru default to "stream"
(their ring fills only from streamed experts).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import io_callback

from sharpi_jax.config import RunConfig
from sharpi_jax.experts import dispatch
from sharpi_jax.experts.provider import ExpertFormat
from sharpi_jax.quant import MatrixFormat
from sharpi_jax.experts.residency import lookahead
from sharpi_jax.experts.residency.plan import PASS_MODES, LayerSpec
from sharpi_jax.experts.residency.policies import slot_policy
from sharpi_jax.experts.streaming import MATRICES, Streamer

# Device counters per layer (int32, cumulative; diff two snapshots for a run).
CTR = ("batches", "rows", "pairs", "hits", "misses", "slow_batches", "streamed", "host_experts",
       "host_pairs", "evicted", "ring_inserts", "unique", "ahead_streamed", "ahead_useful", "ahead_useless")
_C = {n: i for i, n in enumerate(CTR)}


class ExpertCache(nnx.Variable):
    """Mutable residency state (slot stacks, LUT, recency, counters): donated through every step."""


class _Stacked:
    """Two `dispatch.StackView`s read as one: index e < n_a reads `a`, else `b[e - n_a]`.

    What `dispatch.expert_rows` needs (`StackView`'s n_expert, load, ffn): the slot stack and the
    streamed staging computed in one pass without concatenating them (reads counted, not bytes)."""

    bytes_per_read = None

    def __init__(self, a, b, n_a: int):
        self.a, self.b, self.n_a = a, b, n_a
        self.n_expert = (a.n_expert if a is not None else 0) + (b.n_expert if b is not None else 0)
        self.ffn = (a if a is not None else b).ffn

    def load(self, e):
        if self.b is None:
            return self.a.load(e)
        if self.a is None:
            return self.b.load(e - self.n_a)
        return jax.lax.cond(e < self.n_a, self.a.load, lambda e: self.b.load(e - self.n_a), e)


def _concat(parts) -> object:
    """[(view or None, n experts)] -> one view reading them in order (entries of empty parts: none)."""
    out, n = None, 0
    for view, size in parts:
        if size:
            out = view if out is None else _Stacked(out, view, n)
            n += size
    return out


def lookahead_buffer(spec: LayerSpec, fmt: ExpertFormat) -> nnx.Dict:
    """The lookahead buffer of a block-type mix: [buffer, ...] stacks like the staging's, the expert in
    each entry (`expert`, -1: none), the layer they were fetched for (`layer`, -1: none) and whether that
    layer's call has yet to score them (`fresh`). One per mix, shared by its layers: a layer's
    predictions are fetched after the layer before has run, and used by its own call right after."""
    P = spec.buffer
    d = {m: ExpertCache(fmt.zeros(P, m)) for m in MATRICES}
    d.update(expert=ExpertCache(jnp.full((P,), -1, jnp.int32)), layer=ExpertCache(jnp.full((), -1, jnp.int32)),
             fresh=ExpertCache(jnp.zeros((), jnp.int32)))
    return nnx.Dict(d)


def staging_buffer(spec: LayerSpec, fmt: ExpertFormat) -> nnx.Dict:
    """The device staging of streamed experts ([staging, ...] stacks like the slots'; empty when the
    layer only host-computes). One per block-type mix, shared by its layers (they run one at a time)."""
    G = spec.staging if spec.cold != "host" else 0
    return nnx.Dict({m: ExpertCache(fmt.zeros(G, m)) for m in MATRICES})


class ResidentExperts(nnx.Module):
    """One MoE layer's routed experts under residency: slot stack + LUT + ring state (see module doc).

    A `moe.ExpertProvider`: the same rows as `routed_experts(u, sel, w, experts)` on all experts, bit
    for bit, whichever experts are resident.

    Layout of one call: `lax.cond(all hit)` returns the output, the small state (LUT, ring, counters),
    the staging buffer (the callback's experts, or the old buffer passed through) and the ring slots
    to overwrite; the stack is written after the cond, by a second cond on "any slot to overwrite".
    (Writing the stack inside the first cond made XLA copy the whole stack on every miss.)
    """

    def __init__(self, spec: LayerSpec, streamer: Streamer, staged: nnx.Dict | None = None,
                 run: RunConfig = RunConfig(), ahead: nnx.Dict | None = None):
        """staged: the staging buffer shared by the layers of this block-type mix (`staging_buffer`);
        run: the dispatch of the experts computed here (expert_mode, row_kernel), device and host alike;
        ahead: the lookahead buffer shared likewise (`lookahead_buffer`; used when spec.buffer > 0)."""
        self.spec = spec
        self.streamer = streamer
        self.mode, self.row_kernel = run.expert_mode, run.row_kernel
        self.format = ExpertFormat(MatrixFormat.for_run(run), spec.qtypes, spec.d_model, spec.d_ff)
        S, E = spec.n_slots, spec.n_expert
        for m in MATRICES:
            setattr(self, m, ExpertCache(self.format.zeros(S, m)))
        self.staged = staged if staged is not None else staging_buffer(spec, self.format)
        if spec.buffer:
            self.ahead = ahead if ahead is not None else lookahead_buffer(spec, self.format)
        i32 = jnp.int32
        self.lut = ExpertCache(jnp.full((E,), -1, i32))
        self.slot_expert = ExpertCache(jnp.full((S,), -1, i32))
        self.stamp = ExpertCache(jnp.zeros((S,), i32))
        self.protected = ExpertCache(jnp.zeros((S,), i32))
        self.clock = ExpertCache(jnp.zeros((), i32))
        self.counts = ExpertCache(jnp.zeros((E,), i32))
        self.ctr = ExpertCache(jnp.zeros((len(CTR),), i32))
        self.fresh = ExpertCache(jnp.zeros((S,), i32))  # prefetched, not yet used by a call

    _SMALL = ("lut", "slot_expert", "stamp", "protected", "clock", "counts", "ctr", "fresh")

    @property
    def predicts(self) -> bool:
        """Whether the trunk should call `prefetch` with this layer's predicted experts (the block before
        applies this layer's router early: `model.moe.MoE.prefetch`)."""
        return self.spec.predicts

    @staticmethod
    def _weights(stack):
        return tuple(stack[m] for m in MATRICES)

    _LABELS = ("expert", "layer", "fresh")

    def _ahead(self) -> tuple[dict, dict]:
        """The lookahead buffer's (labels, stacks)."""
        return ({n: self.ahead[n].get_value() for n in self._LABELS},
                {m: self.ahead[m].get_value() for m in MATRICES})

    def _set_ahead(self, labels: dict, stacks: dict | None = None) -> None:
        for n in self._LABELS:
            self.ahead[n].set_value(labels[n])
        for m in MATRICES if stacks is not None else ():
            self.ahead[m].set_value(stacks[m])

    def __call__(self, u: jax.Array, sel: jax.Array, w: jax.Array, valid: jax.Array | None) -> jax.Array:
        """`moe.ExpertProvider`: the same rows as `routed_experts` on all experts, bit for bit."""
        s, mode = self.spec, self.mode
        N, k = sel.shape
        E, S, P = s.n_expert, s.n_slots, s.buffer
        v = {name: getattr(self, name).get_value() for name in self._SMALL}
        stack = {m: getattr(self, m).get_value() for m in MATRICES}
        staged = {m: self.staged[m].get_value() for m in MATRICES}
        vmask = jnp.ones((N, k), bool) if valid is None else jnp.broadcast_to(valid[:, None], (N, k))
        slot = v["lut"][sel]  # the layer's own slots
        used = jnp.zeros((S + 1,), bool).at[jnp.where(slot >= 0, slot, S).reshape(-1)].set(True)[:S]
        ahead = None
        if P:  # pairs missing the slots but fetched ahead for this layer: entries S.. of [slots ; buffer]
            labels, ahead = self._ahead()
            bslot = jnp.where(slot >= 0, -1, lookahead.buffer_slots(labels, s.layer, sel, E))
            slot = jnp.where(bslot >= 0, S + bslot, slot)
            labels, v["ctr"] = lookahead.score_buffer(labels, v["ctr"], bslot, s.layer, _C)
            self._set_ahead(labels)
        hit = slot >= 0
        v = self._tally(v, sel, hit, vmask)
        if s.predicts:  # what the prefetch before this call brought: used now, or not
            v["ctr"], v["fresh"] = lookahead.score_prefetch(v["ctr"], v["fresh"], used, _C)
        if s.n_ring:
            v = slot_policy(s.policy).touch(v, used & (jnp.arange(S) >= s.n_pin), s.n_ring)
        no_write = jnp.full((self._n_write(N),), S, jnp.int32)

        def fast(v, stack, staged, u, sel, w, slot, used, vmask):
            if P:  # slots and buffer: the slow path's reads and reduction, with nothing cold
                view = _concat([(dispatch.StackView(self._weights(stack)), S),
                                (dispatch.StackView(self._weights(ahead)), P)])
                y = dispatch.expert_rows(u, slot, view, mode, self.row_kernel)[0]
                return dispatch.weighted_reduce(y, w.astype(jnp.float32)), v, staged, no_write
            out = dispatch.routed_experts(u, slot, w, self._weights(stack), mode=mode, row_kernel=self.row_kernel)
            return out, v, staged, no_write

        def slow(v, stack, staged, u, sel, w, slot, used, vmask):
            return self._slow(v, stack, staged, u, sel, w, slot, used, vmask, mode, ahead)

        args = (v, stack, staged, u, sel, w, slot, used, vmask)
        if S + P == 0:
            out, v, staged, tgt = slow(*args)
        else:
            out, v, staged, tgt = jax.lax.cond(jnp.all(hit), fast, slow, *args)
        stack = self._write_ring(stack, staged, tgt)
        for name in self._SMALL:
            getattr(self, name).set_value(v[name])
        for m in MATRICES:
            getattr(self, m).set_value(stack[m])
            self.staged[m].set_value(staged[m])
        return out

    def _tally(self, v: dict, sel: jax.Array, hit: jax.Array, vmask: jax.Array) -> dict:
        """v with the call's counters (batches, rows, pairs, hits, misses, unique experts), per-expert
        counts and clock advanced. hit: pairs found in the slots or the lookahead buffer."""
        E = self.spec.n_expert
        ctr = v["ctr"]
        for name, val in (("batches", 1), ("rows", vmask[:, 0].sum()), ("pairs", vmask.sum()),
                          ("hits", (vmask & hit).sum()), ("misses", (vmask & ~hit).sum())):
            ctr = ctr.at[_C[name]].add(jnp.asarray(val, jnp.int32))
        batch_counts = jnp.bincount(jnp.where(vmask, sel, E).reshape(-1), length=E + 1)[:E].astype(jnp.int32)
        v["ctr"] = ctr.at[_C["unique"]].add((batch_counts > 0).sum().astype(jnp.int32))
        v["counts"] = v["counts"] + batch_counts
        v["clock"] = v["clock"] + 1
        return v

    def _write_ring(self, stack: dict, staged: dict, tgt: jax.Array) -> dict:
        """The slot stack with the staged experts copied into ring slots `tgt` (S: none), by a cond of
        its own after the call's cond (see the class doc)."""
        if not tgt.shape[0]:
            return stack
        S, nv = self.spec.n_slots, tgt.shape[0]
        put = lambda a, b: a.at[tgt].set(b[:nv], mode="drop")  # noqa: E731
        return jax.lax.cond(jnp.any(tgt < S),
                            lambda st: {m: dataclasses.replace(st[m], data=jax.tree.map(put, st[m].data,
                                                                                        staged[m].data))
                                        for m in MATRICES},
                            lambda st: st, stack)

    def _n_write(self, n_rows: int) -> int:
        """Ring slots one batch may overwrite (static)."""
        return min(self.spec.n_stage(n_rows), self.spec.n_ring)

    def _slow(self, v, stack, staged, u, sel, w, slot, used, vmask, mode, ahead=None):
        """Some pair misses: one callback streams / host-computes the cold experts; ring decisions.
        slot: each pair's index into [slot stack ; lookahead buffer] or -1; used: the slots (not buffer
        entries) the call uses."""
        s = self.spec
        N, k = sel.shape
        E, S, D, P = s.n_expert, s.n_slots, s.d_model, s.buffer
        hit = slot >= 0
        m_max = min(N * k, E)
        n_stage = s.n_stage(N)  # static: the staging this bucket may fill
        with_host = s.n_stage_auto(N) < m_max
        n_dyn = n_stage  # how many a call streams: a verify pass (> 1 valid row) n_stage, decode the auto rule
        if s.stages_passes(N):
            n_dyn = jnp.where(vmask[:, 0].sum() > 1, n_stage, s.n_stage_auto(N))
        mcount = jnp.bincount(jnp.where(hit, E, sel).reshape(-1), length=E + 1)[:E]
        order = jnp.argsort(-mcount, stable=True)[:m_max].astype(jnp.int32)  # most rows first
        is_miss = mcount[order] > 0
        rank = jnp.arange(m_max)
        stream_ids = jnp.pad(jnp.where(is_miss & (rank < n_dyn), order, -1)[:n_stage],
                             (0, max(0, n_stage - m_max)), constant_values=-1)
        host_ids = jnp.where(is_miss & (rank >= n_dyn), order, -1)
        shapes = []
        if n_stage:
            src = self.streamer.sources[s.layer]
            shapes += [jax.ShapeDtypeStruct((n_stage,) + vw.shape[1:], jnp.uint8) for vw in src.views]
        if with_host:
            shapes.append(jax.ShapeDtypeStruct((N, k, D), jnp.float32))
        res = io_callback(functools.partial(self.streamer.serve, s.layer, n_stage, with_host, self.row_kernel),
                          tuple(shapes), stream_ids, host_ids, u, sel, vmask[:, 0], ordered=False)
        ctr = v["ctr"]
        ctr = ctr.at[_C["slow_batches"]].add(1)
        ctr = ctr.at[_C["streamed"]].add((stream_ids >= 0).sum().astype(jnp.int32))
        ctr = ctr.at[_C["host_experts"]].add((host_ids >= 0).sum().astype(jnp.int32))
        tgt = jnp.full((self._n_write(N),), S, jnp.int32)
        if n_stage:
            staged = {m: self.format.pack(res[j], m) for j, m in enumerate(MATRICES)}
            if s.n_ring:
                keep = lookahead.protected(v, used, s) if s.lookahead in PASS_MODES else used
                v, ctr, tgt = self._insert(v, ctr, stream_ids, keep)
        v["ctr"] = ctr
        # Pair -> index into [slot stack ; staging], or -1 for host-computed pairs.
        pos = jnp.full((E + 1,), -1, jnp.int32)
        if n_stage:
            pos = pos.at[jnp.where(stream_ids >= 0, stream_ids, E)].set(jnp.arange(n_stage, dtype=jnp.int32))
        sp = pos[:E][sel]
        idx = jnp.where(hit, slot, jnp.where(sp >= 0, S + P + sp, -1))
        on_dev = idx >= 0
        v["ctr"] = v["ctr"].at[_C["host_pairs"]].add((vmask & ~on_dev).sum().astype(jnp.int32))
        if S or P or n_stage:
            view = _concat([(dispatch.StackView(self._weights(stack)), S),
                            (dispatch.StackView(self._weights(ahead)) if P else None, P),
                            (dispatch.StackView(self._weights(staged)), n_stage)])
            idx_d = jnp.where(on_dev, idx, jnp.maximum(jnp.max(idx), 0))  # host pairs ride along a used expert
            y_dev = jax.lax.cond(jnp.any(on_dev),
                                 lambda: dispatch.expert_rows(u, idx_d, view, mode, self.row_kernel)[0],
                                 lambda: jnp.zeros((N, k, D), jnp.float32))
            y = jnp.where(on_dev[..., None], y_dev, res[-1]) if with_host else y_dev
        else:
            y = res[-1]
        return dispatch.weighted_reduce(y, w.astype(jnp.float32)), v, staged, tgt

    def prefetch(self, pred: jax.Array, valid: jax.Array | None) -> None:
        """Fetch the experts predicted for this layer's next call (pred int32 [N, k]: this layer's router
        applied early to the rows the block before outputs) in one batch: the non-resident ones, most
        predicted rows first, into ring slots (at most min(staging, ring)) or, with a lookahead buffer,
        into the buffer (at most its size), labelled with this layer (see `lookahead`).
        Changes where experts sit, never what a call computes."""
        s = self.spec
        N, k = pred.shape
        S = s.n_slots
        n_pre = min(s.buffer if s.buffer else min(s.staging, s.n_ring), N * k, s.n_expert)
        if not s.predicts or n_pre == 0:
            return
        v = {name: getattr(self, name).get_value() for name in self._SMALL}
        stack = {m: getattr(self, m).get_value() for m in MATRICES}
        vmask = jnp.ones((N, k), bool) if valid is None else jnp.broadcast_to(valid[:, None], (N, k))
        ids, keep = lookahead.plan_prefetch(v, pred, vmask, s, n_pre)
        upcoming = v["clock"] + 1  # the clock of this layer's next call: the pass these are for
        v["stamp"] = jnp.where(keep & (jnp.arange(S) >= s.n_pin), upcoming, v["stamp"])
        if s.buffer:
            self._prefetch_buffer(v, ids, n_pre)
            return

        def fetch(v, stack):
            src = self.streamer.sources[s.layer]
            shapes = tuple(jax.ShapeDtypeStruct((n_pre,) + vw.shape[1:], jnp.uint8) for vw in src.views)
            res = io_callback(functools.partial(self.streamer.fetch, s.layer, n_pre), shapes, ids, ordered=False)
            ctr = v["ctr"].at[_C["ahead_streamed"]].add((ids >= 0).sum().astype(jnp.int32))
            v, ctr, tgt = self._insert(v, ctr, ids, keep)
            v["ctr"] = ctr
            v["stamp"] = v["stamp"].at[tgt].set(upcoming, mode="drop")
            v["fresh"] = v["fresh"].at[tgt].set(1, mode="drop")
            put = lambda a, b: a.at[tgt].set(b, mode="drop")  # noqa: E731
            new = {m: self.format.pack(res[j], m) for j, m in enumerate(MATRICES)}
            stack = {m: dataclasses.replace(stack[m], data=jax.tree.map(put, stack[m].data, new[m].data))
                     for m in MATRICES}
            return v, stack

        v, stack = jax.lax.cond(ids[0] >= 0, fetch, lambda v, stack: (v, stack), v, stack)
        for name in self._SMALL:
            getattr(self, name).set_value(v[name])
        for m in MATRICES:
            getattr(self, m).set_value(stack[m])

    def _prefetch_buffer(self, v: dict, ids: jax.Array, n_pre: int) -> None:
        """The fetch into the shared lookahead buffer: entries 0..n_pre-1 get experts `ids` (-1: none),
        every entry is relabelled (the previous layer's entries are gone), the layer label is this one."""
        s = self.spec
        labels, ahead = self._ahead()

        def fetch(ahead):
            src = self.streamer.sources[s.layer]
            shapes = tuple(jax.ShapeDtypeStruct((n_pre,) + vw.shape[1:], jnp.uint8) for vw in src.views)
            res = io_callback(functools.partial(self.streamer.fetch, s.layer, n_pre), shapes, ids, ordered=False)
            new = {m: self.format.pack(res[j], m) for j, m in enumerate(MATRICES)}
            put = lambda a, b: a.at[:n_pre].set(b)  # noqa: E731
            return {m: dataclasses.replace(ahead[m], data=jax.tree.map(put, ahead[m].data, new[m].data))
                    for m in MATRICES}

        ahead = jax.lax.cond(ids[0] >= 0, fetch, lambda a: a, ahead)
        labels = lookahead.buffer_labels(ids, s.buffer, s.layer)
        v["ctr"] = v["ctr"].at[_C["ahead_streamed"]].add((ids >= 0).sum().astype(jnp.int32))
        for name in self._SMALL:
            getattr(self, name).set_value(v[name])
        self._set_ahead(labels, ahead)

    def _insert(self, v, ctr, stream_ids, used):
        """Ring victims for the streamed experts (chosen by the layer's policy) and the bookkeeping;
        returns the slots to overwrite (S: none). used [S]: slots that may not be victims."""
        s = self.spec
        E, S = s.n_expert, s.n_slots
        policy = slot_policy(s.policy)
        nv = min(stream_ids.shape[0], s.n_ring)  # == _n_write(N): the shape the fast branch returns
        victims = policy.victims(v, used, s.n_pin, nv)
        sid = stream_ids[:nv]
        ok = (sid >= 0) & ~used[victims]
        old = v["slot_expert"][victims]
        evict = ok & (old >= 0)
        lut = v["lut"].at[jnp.where(evict, old, E)].set(-1, mode="drop")
        lut = lut.at[jnp.where(ok, sid, E)].set(victims, mode="drop")
        tgt = jnp.where(ok, victims, S)
        v["lut"] = lut
        v["slot_expert"] = v["slot_expert"].at[tgt].set(sid, mode="drop")
        v = policy.admit(v, tgt)
        ctr = ctr.at[_C["evicted"]].add(evict.sum().astype(jnp.int32))
        ctr = ctr.at[_C["ring_inserts"]].add(ok.sum().astype(jnp.int32))
        return v, ctr, tgt
