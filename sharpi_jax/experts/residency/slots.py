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

Pinned host store (spec.store "pinned_host"): the layer's every expert laid out once in `ColdStore`
variables in JAX's "pinned_host" memory; the slow branch moves every miss from it to the device for
the call (`_slow_stored`: no callback, nothing host-computed) and lookahead fetches read it too.

Expert parallelism (a `mesh`): the spec is one device's share (E / n experts); each state array stacks
the devices' copies on axis 0, and a call runs in `jax.shard_map` (`_on_mesh`): each device serves the
pairs of its own experts from its own slots and streams its own misses (the callback gets global ids
and the device index), other pairs are hits at NOT_MINE that no view reads; the unreduced rows are
combined by one psum of bit patterns, as `parallel.sharded_expert_rows` does.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import io_callback
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P_

from sharpi_jax.config import RunConfig
from sharpi_jax.experts import dispatch
from sharpi_jax.experts.provider import ExpertFormat
from sharpi_jax.quant import MatrixFormat, QTensor
from sharpi_jax.experts.parallel import EXPERT_AXIS, owners_sum
from sharpi_jax.experts.residency import lookahead
from sharpi_jax.experts.residency.plan import PASS_MODES, LayerSpec
from sharpi_jax.experts.residency.policies import slot_policy
from sharpi_jax.experts.streaming import MATRICES, Streamer

# Device counters per layer (int32, cumulative; diff two snapshots for a run).
CTR = ("batches", "rows", "pairs", "hits", "misses", "slow_batches", "streamed", "host_experts",
       "host_pairs", "evicted", "ring_inserts", "unique", "ahead_streamed", "ahead_useful", "ahead_useless")
_C = {n: i for i, n in enumerate(CTR)}
# Slot index of a pair another device owns (expert parallelism): a hit, past every view (none reads it).
NOT_MINE = 1 << 30


class _Shard(NamedTuple):
    """This device's part of a call under expert parallelism (traced values inside the shard_map)."""

    owned: jax.Array  # bool [N, k]: the pairs whose expert this device holds
    first: jax.Array  # int32: the global id of this device's expert 0
    device: jax.Array  # int32: the device's index on the expert axis (its host buffers)
    sel: jax.Array  # int32 [N, k]: the global expert ids (what the host side reads)

    def global_ids(self, ids: jax.Array) -> jax.Array:
        """Local expert ids (-1 pads) -> global ids (-1 pads)."""
        return jnp.where(ids >= 0, ids + self.first, -1)


class ExpertCache(nnx.Variable):
    """Mutable residency state (slot stacks, LUT, recency, counters): donated through every step."""


class ColdStore(nnx.Variable):
    """A layer's every expert laid out once at load in the kernel layout, held in JAX's "pinned_host"
    memory (expert_store="pinned_host"): read-only, passed to the steps with the params."""


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


def _in_view(idx: jax.Array, n_view: int, shard: _Shard | None) -> jax.Array:
    """Indices into a view of n_view experts: another device's pairs (NOT_MINE) at n_view, one past
    the view, where no expert's visit reads them (as `parallel.sharded_expert_rows` does)."""
    return idx if shard is None else jnp.minimum(idx, n_view)


def _device_arg(shard: _Shard | None) -> tuple:
    """The callback's trailing argument: the device index, whose host buffers it fills (none: device 0)."""
    return () if shard is None else (shard.device,)


def _concat(parts) -> object:
    """[(view or None, n experts)] -> one view reading them in order (entries of empty parts: none)."""
    out, n = None, 0
    for view, size in parts:
        if size:
            out = view if out is None else _Stacked(out, view, n)
            n += size
    return out


def _per_device(shape: tuple, n_dev: int) -> tuple:
    """The shape of a small state array held by n_dev devices (expert parallelism: [n_dev, *shape],
    sharded on axis 0; one device: `shape`)."""
    return shape if n_dev == 1 else (n_dev,) + tuple(shape)


def lookahead_buffer(spec: LayerSpec, fmt: ExpertFormat, n_dev: int = 1) -> nnx.Dict:
    """The lookahead buffer of a block-type mix: [buffer, ...] stacks like the staging's, the expert in
    each entry (`expert`, -1: none), the layer they were fetched for (`layer`, -1: none) and whether that
    layer's call has yet to score them (`fresh`). One per mix, shared by its layers: a layer's
    predictions are fetched after the layer before has run, and used by its own call right after.
    n_dev > 1 (expert parallelism): one buffer per device, stacked on axis 0."""
    P = spec.buffer
    d = {m: ExpertCache(fmt.zeros(n_dev * P, m)) for m in MATRICES}
    d.update(expert=ExpertCache(jnp.full(_per_device((P,), n_dev), -1, jnp.int32)),
             layer=ExpertCache(jnp.full(_per_device((), n_dev), -1, jnp.int32)),
             fresh=ExpertCache(jnp.zeros(_per_device((), n_dev), jnp.int32)))
    return nnx.Dict(d)


def staging_buffer(spec: LayerSpec, fmt: ExpertFormat, n_dev: int = 1) -> nnx.Dict:
    """The device staging of streamed experts ([staging, ...] stacks like the slots'; empty when the
    layer only host-computes). One per block-type mix, shared by its layers (they run one at a time);
    one per device under expert parallelism (stacked on axis 0)."""
    G = spec.staging if spec.cold != "host" else 0
    return nnx.Dict({m: ExpertCache(fmt.zeros(n_dev * G, m)) for m in MATRICES})


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
                 run: RunConfig = RunConfig(), ahead: nnx.Dict | None = None, mesh: Mesh | None = None):
        """staged: the staging buffer shared by the layers of this block-type mix (`staging_buffer`);
        run: the dispatch of the experts computed here (expert_mode, row_kernel), device and host alike;
        ahead: the lookahead buffer shared likewise (`lookahead_buffer`; used when spec.buffer > 0);
        mesh: expert parallelism (a Mesh with the "expert" axis): `spec` is then ONE device's share (its
        n_expert the experts each device owns, its slots and budget per device) and every state array
        holds all devices' copies stacked on axis 0, sharded over the axis (see `_on_mesh`)."""
        self.spec = spec
        self.streamer = streamer
        self.mesh = mesh  # static (part of the graph): Mesh is hashable
        n_dev = 1 if mesh is None else mesh.shape[EXPERT_AXIS]
        self.mode, self.row_kernel = run.expert_mode, run.row_kernel
        self.format = ExpertFormat(MatrixFormat.for_run(run), spec.qtypes, spec.d_model, spec.d_ff)
        S, E = spec.n_slots, spec.n_expert
        for m in MATRICES:
            setattr(self, m, ExpertCache(self.format.zeros(n_dev * S, m)))
        self.staged = staged if staged is not None else staging_buffer(spec, self.format, n_dev)
        if spec.store == "pinned_host":
            self.store = nnx.Dict({m: ColdStore(self.format.zeros(E, m)) for m in MATRICES})
        if spec.buffer:
            self.ahead = ahead if ahead is not None else lookahead_buffer(spec, self.format, n_dev)
        i32 = jnp.int32
        shape = lambda *s: _per_device(s, n_dev)  # noqa: E731
        self.lut = ExpertCache(jnp.full(shape(E), -1, i32))
        self.slot_expert = ExpertCache(jnp.full(shape(S), -1, i32))
        self.stamp = ExpertCache(jnp.zeros(shape(S), i32))
        self.protected = ExpertCache(jnp.zeros(shape(S), i32))
        self.clock = ExpertCache(jnp.zeros(shape(), i32))
        self.counts = ExpertCache(jnp.zeros(shape(E), i32))
        self.ctr = ExpertCache(jnp.zeros(shape(len(CTR)), i32))
        self.fresh = ExpertCache(jnp.zeros(shape(S), i32))  # prefetched, not yet used by a call

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

    def _state(self) -> dict:
        """The module's state as plain values: the small arrays `v`, the slot `stack`, the `staged`
        buffer and, with a lookahead buffer, its `labels` and `ahead` stacks."""
        st = {"v": {n: getattr(self, n).get_value() for n in self._SMALL},
              "stack": {m: getattr(self, m).get_value() for m in MATRICES},
              "staged": {m: self.staged[m].get_value() for m in MATRICES}}
        if self.spec.buffer:
            st["labels"] = {n: self.ahead[n].get_value() for n in self._LABELS}
            st["ahead"] = {m: self.ahead[m].get_value() for m in MATRICES}
        return st

    def _set_state(self, st: dict) -> None:
        for name in self._SMALL:
            getattr(self, name).set_value(st["v"][name])
        for m in MATRICES:
            getattr(self, m).set_value(st["stack"][m])
            self.staged[m].set_value(st["staged"][m])
        if self.spec.buffer:
            for n in self._LABELS:
                self.ahead[n].set_value(st["labels"][n])
            for m in MATRICES:
                self.ahead[m].set_value(st["ahead"][m])

    def _on_mesh(self, fn: Callable, st: dict, ids: jax.Array, *args) -> tuple:
        """Expert parallelism: fn(local state, _Shard, *args) -> (a replicated result, local state) run
        on every device of the expert axis, each with its own copy of every state array (axis 0 of the
        global arrays) and the pairs of `ids` (global expert ids [N, k]) whose expert it owns."""
        n_dev, e_local = self.mesh.shape[EXPERT_AXIS], self.spec.n_expert
        is_q = lambda x: isinstance(x, QTensor)  # noqa: E731

        def local(st, ids, *args):
            st = jax.tree.map(lambda x: x.with_lead(x.shape[0] // n_dev) if is_q(x) else x[0], st, is_leaf=is_q)
            device = jax.lax.axis_index(EXPERT_AXIS).astype(jnp.int32)
            first = device * e_local
            owned = (ids >= first) & (ids < first + e_local)
            out, st = fn(st, _Shard(owned, first, device, ids), *args)
            return out, jax.tree.map(lambda x: x if is_q(x) else x[None], st, is_leaf=is_q)

        # check_vma=False: as in `parallel.sharded_expert_rows` (the result is replicated after its psum).
        specs = (P_(EXPERT_AXIS), P_()) + (P_(),) * len(args)
        out, st = jax.shard_map(local, mesh=self.mesh, in_specs=specs, out_specs=(P_(), P_(EXPERT_AXIS)),
                                check_vma=False)(st, ids.astype(jnp.int32), *args)
        return out, jax.tree.map(lambda x: x.with_lead(x.shape[0] * n_dev) if is_q(x) else x, st, is_leaf=is_q)

    def __call__(self, u: jax.Array, sel: jax.Array, w: jax.Array, valid: jax.Array | None) -> jax.Array:
        """`moe.ExpertProvider`: the same rows as `routed_experts` on all experts, bit for bit. Under
        expert parallelism each device serves its own experts' pairs from its own slots and streams its
        own misses; their unreduced rows are combined by one psum of bit patterns and reduced replicated,
        as `parallel.sharded_expert_rows` does."""
        N, k = sel.shape
        vmask = jnp.ones((N, k), bool) if valid is None else jnp.broadcast_to(valid[:, None], (N, k))
        if self.mesh is None:
            out, st = self._call(self._state(), u, sel, w, vmask)
            self._set_state(st)
            return out

        def mine(st, shard, u, w, vmask):
            y, st = self._call(st, u, jnp.where(shard.owned, shard.sel - shard.first, 0), w, vmask, shard)
            return owners_sum(y, shard.owned), st

        y, st = self._on_mesh(mine, self._state(), sel, u.astype(jnp.float32), w, vmask)
        self._set_state(st)
        return dispatch.weighted_reduce(y, w.astype(jnp.float32))

    def _call(self, st: dict, u, sel, w, vmask, shard: _Shard | None = None) -> tuple[jax.Array, dict]:
        """One call on plain state -> (output, new state). One device: the reduced rows [N, D]. With a
        `shard` (sel then holds local ids where shard.owned): the unreduced rows Y [N, k, D] of the
        device's own pairs (other pairs are hits at NOT_MINE, read by no view, counted nowhere here)."""
        s, mode = self.spec, self.mode
        N, k = sel.shape
        E, S, P = s.n_expert, s.n_slots, s.buffer
        st, v, stack, staged = dict(st), dict(st["v"]), st["stack"], st["staged"]
        slot = v["lut"][sel]  # the layer's own slots
        if shard is not None:
            slot = jnp.where(shard.owned, slot, -1)
        used = jnp.zeros((S + 1,), bool).at[jnp.where(slot >= 0, slot, S).reshape(-1)].set(True)[:S]
        ahead = None
        if P:  # pairs missing the slots but fetched ahead for this layer: entries S.. of [slots ; buffer]
            labels, ahead = st["labels"], st["ahead"]
            bslot = jnp.where(slot >= 0, -1, lookahead.buffer_slots(labels, s.layer, sel, E))
            if shard is not None:
                bslot = jnp.where(shard.owned, bslot, -1)
            slot = jnp.where(bslot >= 0, S + bslot, slot)
            st["labels"], v["ctr"] = lookahead.score_buffer(labels, v["ctr"], bslot, s.layer, _C)
        pmask = vmask
        if shard is not None:
            slot, pmask = jnp.where(shard.owned, slot, NOT_MINE), vmask & shard.owned
        hit = slot >= 0
        v = self._tally(v, sel, hit, vmask, pmask)
        if s.predicts:  # what the prefetch before this call brought: used now, or not
            v["ctr"], v["fresh"] = lookahead.score_prefetch(v["ctr"], v["fresh"], used, _C)
        if s.n_ring:
            v = slot_policy(s.policy).touch(v, used & (jnp.arange(S) >= s.n_pin), s.n_ring)
        no_write = jnp.full((self._n_write(N),), S, jnp.int32)
        reduce = (lambda y, w: y) if shard is not None else (  # noqa: E731
            lambda y, w: dispatch.weighted_reduce(y, w.astype(jnp.float32)))

        def fast(v, stack, staged, u, sel, w, slot, used, vmask):
            if P:  # slots and buffer: the slow path's reads and reduction, with nothing cold
                view = _concat([(dispatch.StackView(self._weights(stack)), S),
                                (dispatch.StackView(self._weights(ahead)), P)])
                y = dispatch.expert_rows(u, _in_view(slot, S + P, shard), view, mode, self.row_kernel)[0]
                return reduce(y, w), v, staged, no_write
            if shard is not None:
                y = dispatch.expert_rows(u, _in_view(slot, S, shard), self._weights(stack), mode, self.row_kernel)[0]
                return y, v, staged, no_write
            out = dispatch.routed_experts(u, slot, w, self._weights(stack), mode=mode, row_kernel=self.row_kernel)
            return out, v, staged, no_write

        def slow(v, stack, staged, u, sel, w, slot, used, vmask):
            return self._slow(v, stack, staged, u, sel, w, slot, used, vmask, mode, ahead, shard, reduce)

        args = (v, stack, staged, u, sel, w, slot, used, vmask)
        if S + P == 0:
            out, v, staged, tgt = slow(*args)
        else:
            out, v, staged, tgt = jax.lax.cond(jnp.all(hit), fast, slow, *args)
        st.update(v=v, stack=self._write_ring(stack, staged, tgt), staged=staged)
        return out, st

    def _tally(self, v: dict, sel: jax.Array, hit: jax.Array, vmask: jax.Array, pmask: jax.Array) -> dict:
        """v with the call's counters (batches, rows, pairs, hits, misses, unique experts), per-expert
        counts and clock advanced. hit: pairs found in the slots or the lookahead buffer; vmask: the
        valid rows' pairs; pmask: the pairs counted here (vmask, or this device's share of it)."""
        E = self.spec.n_expert
        ctr = v["ctr"]
        for name, val in (("batches", 1), ("rows", vmask[:, 0].sum()), ("pairs", pmask.sum()),
                          ("hits", (pmask & hit).sum()), ("misses", (pmask & ~hit).sum())):
            ctr = ctr.at[_C[name]].add(jnp.asarray(val, jnp.int32))
        batch_counts = jnp.bincount(jnp.where(pmask, sel, E).reshape(-1), length=E + 1)[:E].astype(jnp.int32)
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

    def _slow(self, v, stack, staged, u, sel, w, slot, used, vmask, mode, ahead, shard, reduce):
        """Some pair misses: one callback streams / host-computes the cold experts; ring decisions.
        slot: each pair's index into [slot stack ; lookahead buffer] or -1 (NOT_MINE: another device's
        pair); used: the slots (not buffer entries) the call uses; reduce: the call's output from Y."""
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
        if self._stored:
            return self._slow_stored(v, stack, staged, u, sel, w, slot, used, mode, ahead, reduce,
                                     jnp.where(is_miss, order, -1))
        rank = jnp.arange(m_max)
        stream_ids = jnp.pad(jnp.where(is_miss & (rank < n_dyn), order, -1)[:n_stage],
                             (0, max(0, n_stage - m_max)), constant_values=-1)
        host_ids = jnp.where(is_miss & (rank >= n_dyn), order, -1)
        res = self._serve(n_stage, with_host, stream_ids, host_ids, u, sel, vmask, shard)
        ctr = v["ctr"]
        ctr = ctr.at[_C["slow_batches"]].add(1)
        ctr = ctr.at[_C["streamed"]].add((stream_ids >= 0).sum().astype(jnp.int32))
        ctr = ctr.at[_C["host_experts"]].add((host_ids >= 0).sum().astype(jnp.int32))
        tgt = jnp.full((self._n_write(N),), S, jnp.int32)
        if n_stage:
            staged = {m: self.format.pack(res[j], m) for j, m in enumerate(MATRICES)}
            if s.n_ring:
                v, ctr, tgt = self._insert(v, ctr, stream_ids, self._keep(v, used))
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
            idx_d = _in_view(idx_d, S + P + n_stage, shard)
            y_dev = jax.lax.cond(jnp.any(on_dev),
                                 lambda: dispatch.expert_rows(u, idx_d, view, mode, self.row_kernel)[0],
                                 lambda: jnp.zeros((N, k, D), jnp.float32))
            y = jnp.where(on_dev[..., None], y_dev, res[-1]) if with_host else y_dev
        else:
            y = res[-1]
        return reduce(y, w), v, staged, tgt

    def _serve(self, n_stage: int, with_host: bool, stream_ids, host_ids, u, sel, vmask, shard) -> tuple:
        """The one callback of a call with misses (`streaming.Streamer.serve`): the raw bytes of
        `stream_ids` [n_stage] (if n_stage), then the host-computed rows [N, k, D] of `host_ids`' pairs (if
        with_host). Under expert parallelism the host side reads the file by global expert id, into the
        calling device's own buffers."""
        s = self.spec
        N, k = sel.shape
        shapes = []
        if n_stage:
            src = self.streamer.sources[s.layer]
            shapes += [jax.ShapeDtypeStruct((n_stage,) + vw.shape[1:], jnp.uint8) for vw in src.views]
        if with_host:
            shapes.append(jax.ShapeDtypeStruct((N, k, s.d_model), jnp.float32))
        ids = (stream_ids, host_ids, u, sel) if shard is None else (
            shard.global_ids(stream_ids), shard.global_ids(host_ids), u, shard.sel)
        return io_callback(functools.partial(self.streamer.serve, s.layer, n_stage, with_host, self.row_kernel),
                           tuple(shapes), *ids, vmask[:, 0], *_device_arg(shard), ordered=False)

    def _slow_stored(self, v, stack, staged, u, sel, w, slot, used, mode, ahead, reduce, misses):
        """`_slow` with the pinned host store: every miss (`misses`, most rows first, -1 pads) is moved
        from the store to the device for this call (a transient [min(N k, E)] stack beside the budget's),
        none is computed on the host, so the step makes no callback; the first `n_stage` go to the
        staging buffer and, under a ring policy, into ring slots, as the callback path streams them."""
        s = self.spec
        N, k = sel.shape
        E, S, P = s.n_expert, s.n_slots, s.buffer
        m_max = misses.shape[0]
        n_stage = s.n_stage(N)
        fetched = self._from_store(misses)
        ctr = v["ctr"].at[_C["slow_batches"]].add(1)
        ctr = ctr.at[_C["streamed"]].add((misses >= 0).sum().astype(jnp.int32))
        tgt = jnp.full((self._n_write(N),), S, jnp.int32)
        if n_stage:
            n = min(n_stage, m_max)
            put = lambda a, b: a.at[:n].set(b[:n])  # noqa: E731
            staged = {m: dataclasses.replace(staged[m], data=jax.tree.map(put, staged[m].data, fetched[m].data))
                      for m in MATRICES}
            if s.n_ring:
                stream_ids = jnp.pad(misses[:n_stage], (0, n_stage - n), constant_values=-1)
                v, ctr, tgt = self._insert(v, ctr, stream_ids, self._keep(v, used))
        v["ctr"] = ctr
        pos = jnp.full((E + 1,), -1, jnp.int32).at[jnp.where(misses >= 0, misses, E)].set(
            jnp.arange(m_max, dtype=jnp.int32))
        idx = jnp.where(slot >= 0, slot, S + P + pos[:E][sel])  # every pair on the device
        view = _concat([(dispatch.StackView(self._weights(stack)), S),
                        (dispatch.StackView(self._weights(ahead)) if P else None, P),
                        (dispatch.StackView(self._weights(fetched)), m_max)])
        return reduce(dispatch.expert_rows(u, idx, view, mode, self.row_kernel)[0], w), v, staged, tgt

    def prefetch(self, pred: jax.Array, valid: jax.Array | None) -> None:
        """Fetch the experts predicted for this layer's next call (pred int32 [N, k]: this layer's router
        applied early to the rows the block before outputs) in one batch: the non-resident ones, most
        predicted rows first, into ring slots (at most min(staging, ring)) or, with a lookahead buffer,
        into the buffer (at most its size), labelled with this layer (see `lookahead`). Under expert
        parallelism each device fetches its own experts' predictions into its own slots or buffer.
        Changes where experts sit, never what a call computes."""
        s = self.spec
        N, k = pred.shape
        n_pre = min(s.buffer if s.buffer else min(s.staging, s.n_ring), N * k, s.n_expert)
        if not s.predicts or n_pre == 0:
            return
        vmask = jnp.ones((N, k), bool) if valid is None else jnp.broadcast_to(valid[:, None], (N, k))
        if self.mesh is None:
            self._set_state(self._prefetch(self._state(), pred, vmask, n_pre))
            return

        def mine(st, shard, vmask):
            local = jnp.where(shard.owned, shard.sel - shard.first, 0)
            return jnp.zeros((), jnp.int32), self._prefetch(st, local, vmask & shard.owned, n_pre, shard)

        _, st = self._on_mesh(mine, self._state(), pred, vmask)
        self._set_state(st)

    def _prefetch(self, st: dict, pred, vmask, n_pre: int, shard: _Shard | None = None) -> dict:
        """`prefetch` on plain state -> the new state (pred: local ids where vmask, with a `shard`)."""
        s = self.spec
        S = s.n_slots
        st, v, stack = dict(st), dict(st["v"]), st["stack"]
        ids, keep = lookahead.plan_prefetch(v, pred, vmask, s, n_pre)
        upcoming = v["clock"] + 1  # the clock of this layer's next call: the pass these are for
        v["stamp"] = jnp.where(keep & (jnp.arange(S) >= s.n_pin), upcoming, v["stamp"])
        if s.buffer:
            st["v"] = v
            return self._prefetch_buffer(st, ids, n_pre, shard)

        def fetch(v, stack):
            new = self._fetch(ids, n_pre, shard)
            ctr = v["ctr"].at[_C["ahead_streamed"]].add((ids >= 0).sum().astype(jnp.int32))
            v, ctr, tgt = self._insert(v, ctr, ids, keep)
            v["ctr"] = ctr
            v["stamp"] = v["stamp"].at[tgt].set(upcoming, mode="drop")
            v["fresh"] = v["fresh"].at[tgt].set(1, mode="drop")
            put = lambda a, b: a.at[tgt].set(b, mode="drop")  # noqa: E731
            stack = {m: dataclasses.replace(stack[m], data=jax.tree.map(put, stack[m].data, new[m].data))
                     for m in MATRICES}
            return v, stack

        v, stack = jax.lax.cond(ids[0] >= 0, fetch, lambda v, stack: (v, stack), v, stack)
        st.update(v=v, stack=stack)
        return st

    @property
    def _stored(self) -> bool:
        """Whether streamed experts come from the pinned host store (else from the callback)."""
        return self.spec.store == "pinned_host"

    def _from_store(self, ids: jax.Array) -> dict:
        """{matrix: [n, ...] stack} of experts `ids` (-1 pads: expert 0's bytes, never read) sliced from
        the pinned host store one expert at a time (a dynamic slice of host memory per expert, the form
        XLA moves by DMA) and moved to device memory: no callback, no re-layout."""
        out = {}
        for m in MATRICES:
            q = self.store[m].get_value()
            one = lambda a, e: jax.lax.dynamic_index_in_dim(a, jnp.maximum(e, 0), keepdims=False)  # noqa: E731
            rows = [jax.tree.map(lambda a: one(a, ids[j]), q.data) for j in range(ids.shape[0])]
            data = jax.tree.map(lambda *r: jnp.stack(r), *rows)
            out[m] = QTensor(jax.device_put(data, jax.memory.Space.Device), q.qtype,
                             (ids.shape[0],) + tuple(q.shape[1:]), q.layout, q.backend)
        return out

    def _fetch(self, ids: jax.Array, n_pre: int, shard: _Shard | None) -> dict:
        """{matrix: [n_pre, ...] stack} of experts `ids` (local ids, -1 pads) of this layer, laid out for
        the device: from the pinned host store, or the file's bytes from one callback, packed here."""
        if self._stored:
            return self._from_store(ids)
        s = self.spec
        src = self.streamer.sources[s.layer]
        shapes = tuple(jax.ShapeDtypeStruct((n_pre,) + vw.shape[1:], jnp.uint8) for vw in src.views)
        ids = ids if shard is None else shard.global_ids(ids)
        res = io_callback(functools.partial(self.streamer.fetch, s.layer, n_pre), shapes, ids,
                          *_device_arg(shard), ordered=False)
        return {m: self.format.pack(res[j], m) for j, m in enumerate(MATRICES)}

    def _prefetch_buffer(self, st: dict, ids: jax.Array, n_pre: int, shard: _Shard | None) -> dict:
        """The fetch into the shared lookahead buffer: entries 0..n_pre-1 get experts `ids` (-1: none),
        every entry is relabelled (the previous layer's entries are gone), the layer label is this one."""
        s = self.spec
        v = dict(st["v"])

        def fetch(ahead):
            new = self._fetch(ids, n_pre, shard)
            put = lambda a, b: a.at[:n_pre].set(b)  # noqa: E731
            return {m: dataclasses.replace(ahead[m], data=jax.tree.map(put, ahead[m].data, new[m].data))
                    for m in MATRICES}

        ahead = jax.lax.cond(ids[0] >= 0, fetch, lambda a: a, st["ahead"])
        v["ctr"] = v["ctr"].at[_C["ahead_streamed"]].add((ids >= 0).sum().astype(jnp.int32))
        return dict(st, v=v, ahead=ahead, labels=lookahead.buffer_labels(ids, s.buffer, s.layer))

    def _keep(self, v: dict, used: jax.Array) -> jax.Array:
        """The slots a streamed expert may not take: the call's own, and under a "pass" lookahead the
        ones holding what was fetched for the pass (`lookahead.protected`)."""
        return lookahead.protected(v, used, self.spec) if self.spec.lookahead in PASS_MODES else used

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
