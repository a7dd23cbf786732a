"""Jitted step functions (functional nnx pattern: split once, merge inside jit, state donated).

- `prefill`: a bucket of B prompt rows with the chunked GDN form; one compile per bucket size.
- `decode_step`: one token with the recurrent GDN form, run as a 2-row bucket (row 1 is inert padding:
  its KV write is dropped, it reuses row 0's experts with zero weight, its GDN row is not computed); the
  GDN loop keeps the state after the row, with no per-row snapshot.
- `verify_step`: T >= 2 tokens with the recurrent form, returning logits and final-normed hidden rows
  for every row plus the GDN snapshots after every row; `commit` selects one snapshot (rollback).
For every row, `verify_step` logits/hidden/snapshots are bitwise those of T successive `decode_step`s
(see `sharpi_jax.model.transformer`). Compiled functions are cached per model graph, so engines of
the same architecture and quant layout share them.

MTP speculative decoding composes these: prefill -> (chain of drafts) -> verify_step over
[t, d1..dk] -> accept a drafts -> commit(snapshot a) and set the host length to P + a + 1 (KV rows past
it are stale and masked, then overwritten). `hidden` rows are the final-normed trunk states the MTP
head consumes. Every step also runs on a state whose attention caches were compacted by SnapKV
(`kv_eviction`): positions stay logical (RoPE, masks), rows land in slot position - shift.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sharpi_jax.config import DEFAULT_PREFILL_BUCKETS, RunConfig  # noqa: F401 (DEFAULT_PREFILL_BUCKETS: re-export)
from sharpi_jax.errors import InputError
from sharpi_jax.experts.residency import ExpertCache
from sharpi_jax.model.transformer import Transformer
from sharpi_jax.model.tree import TreeRows, tree_arrays
from sharpi_jax.runtime.compiled import Graph, hold, jit_factory, split
from sharpi_jax.runtime.sampling import argmax
from sharpi_jax.runtime.state import (DecodeState, Snapshots, init_state, move_kv_rows, repeat_as_snapshots,
                                      select_snapshot, snapshot_rows)

MAX_PADDING_SHARE = 0.25  # a chunk may round up to a bucket when at most this share of it is padding


class PrefillChunk(NamedTuple):
    """One prefill bucket: final-normed hidden [B, D], the logits [V] of its last valid row, the state, and
    with_q the attention layers' post-rope queries (a tuple of [B, Hq, hd]; else ())."""

    hidden: jax.Array
    logits: jax.Array
    state: DecodeState
    queries: tuple


class Prefill(NamedTuple):
    """A prompt's prefill: chunks [(hidden [B, D], n_valid)] per bucket, the last prompt row's logits [V],
    the state."""

    chunks: list
    logits: jax.Array
    state: DecodeState


class Step(NamedTuple):
    """One decoded token: logits [V], final-normed hidden [D], the state after it."""

    logits: jax.Array
    hidden: jax.Array
    state: DecodeState


class Verified(NamedTuple):
    """T verify rows: logits [T, V], hidden [T, D], the state (KV written, GDN unchanged), the GDN
    snapshots after every row."""

    logits: jax.Array
    hidden: jax.Array
    state: DecodeState
    snaps: Snapshots


class Pass(NamedTuple):
    """A trunk pass (commit + verify rows): logits [T, V], greedy (argmax of each row [T] int32), hidden
    [T, D], the state, the GDN snapshots after every row."""

    logits: jax.Array
    greedy: jax.Array
    hidden: jax.Array
    state: DecodeState
    snaps: Snapshots


def prefill_plan(n: int, buckets: Sequence[int]) -> list[tuple[int, int]]:
    """Cut n prompt rows into (bucket, rows) chunks: the smallest bucket that holds the rest when it
    wastes at most MAX_PADDING_SHARE of its rows (or it is the smallest bucket), else the largest
    bucket that the rest fills. E.g. buckets (32, 128, 256): 128 -> [128]; 130 -> [128, 32 (2 rows)];
    200 -> [256 (200 rows)]; 600 -> [256, 256, 128 (88 rows)]."""
    buckets = sorted(buckets)
    plan, rest = [], n
    while rest > 0:
        fits = [b for b in buckets if b >= rest]
        if fits and (fits[0] == buckets[0] or rest >= (1 - MAX_PADDING_SHARE) * fits[0]):
            plan.append((fits[0], rest))
            break
        b = max([b for b in buckets if b <= rest], default=buckets[0])
        plan.append((b, min(b, rest)))
        rest -= b
    return plan


@jit_factory
def _step_fns(graph: Graph) -> dict:
    """The jitted steps of one model graph (`compiled.jit_factory`). `cache` is the flat tuple of mutable
    expert-residency arrays (`ExpertCache`; empty without a budget): the model steps take it donated and
    return (their named result, its new value).
    """
    merge = graph.merge

    def cache_out(model):
        return tuple(jax.tree.leaves(nnx.state(model, ExpertCache)))

    def prefill(params, cache, state, tokens, start, n_valid, gdn="chunked", with_q=False):
        model = merge(params, cache)
        hidden, state, *queries = model.prefill(state, tokens, start, n_valid, gdn, with_q)
        queries = tuple(queries[0]) if with_q else ()  # with_q: the attention layers' queries, flat
        logits = model.head_row(hidden, jnp.maximum(n_valid - 1, 0))  # the last valid row's
        return PrefillChunk(hidden, logits, state, queries), cache_out(model)

    def head(params, cache, hidden):
        return merge(params, cache).lm_head(hidden)

    def head_row(params, cache, hidden, r):
        return merge(params, cache).head_row(hidden, r)

    def decode(params, cache, state, token, pos, live=True):
        # live False (a finished sequence of a batch, `runtime.batch`): row 0 is padding too, so the
        # step computes no product row and reads no expert; its results are discarded.
        model = merge(params, cache)
        tokens = jnp.stack([token, token])
        logits, hidden, state = model.step(state, tokens, pos, jnp.asarray(live, jnp.int32))
        return Step(logits[0], hidden[0], state), cache_out(model)

    def verify(params, cache, state, tokens, pos, n_valid, into=None):
        model = merge(params, cache)
        return Verified(*model.rows(state, tokens, pos, n_valid, into=into)), cache_out(model)

    def commit(state, snaps, index):
        return select_snapshot(state, snaps, index)

    def commit_verify(params, cache, state, snaps, index, tokens, pos, n_valid, head=True):
        # The commit is not a copy: row 0 reads snapshot `index` of the previous pass's snapshots (donated)
        # in place, then the pass rewrites them. The state's GDN entries go through unread.
        model = merge(params, cache)
        logits, hidden, state, snaps = model.rows(state, tokens, pos, n_valid, into=snaps, head=head,
                                                  from_snapshot=index)
        return _pass(logits, hidden, state, snaps), cache_out(model)

    def tree_commit_verify(params, cache, state, snaps, index, prev_pos, path, n_path, tokens, pos, n_valid,
                           depth, parent, anc, head=True):
        state = move_kv_rows(state, prev_pos + path, prev_pos, n_path)  # the GDN commit: as commit_verify's
        model = merge(params, cache)
        tree = TreeRows(depth, parent, pos + jnp.arange(tokens.shape[0], dtype=jnp.int32), pos + anc)
        logits, hidden, state, snaps = model.rows(state, tokens, pos, n_valid, tree, into=snaps, head=head,
                                                  from_snapshot=index)
        return _pass(logits, hidden, state, snaps), cache_out(model)

    return dict(
        tree_commit_verify=(tree_commit_verify, dict(donate_argnums=(1, 2, 3), static_argnames=("head",))),
        prefill=(prefill, dict(donate_argnums=(1, 2), static_argnames=("gdn", "with_q"))),
        head=(head, {}),
        head_row=(head_row, {}),
        decode=(decode, dict(donate_argnums=(1, 2))),
        verify=(verify, dict(donate_argnums=(1, 2))),
        # keep_unused: a commit replaces the state's GDN entries by snapshots without reading them; kept
        # as (donated) arguments, their buffers take the committed state in place of fresh allocations.
        # (The passes return those entries as they came: their first row reads the snapshot in place.)
        commit=(commit, dict(donate_argnums=(0,), keep_unused=True)),
        commit_verify=(commit_verify, dict(donate_argnums=(1, 2, 3), static_argnames=("head",))),
    )


def _pass(logits, hidden, state, snaps) -> Pass:
    """A trunk pass's outputs; without the LM head (logits None) no greedy rows either."""
    greedy = None if logits is None else argmax(logits)
    return Pass(logits, greedy, hidden, state, snaps)


# "auto" on ggml's head: passes of up to this many rows compute every row's head in one product. 2 / 4 head
# rows stream at 1.06x / 1.5x one row's time with the AVX-512 kernels (the 248k-row Q6_K head, Zen 4, 2
# threads) and at 1.06x / 1.37x with the AVX2 ones (Zen 3, 2026-12-02), while a lazy walk reads the whole head
# once per walked row; on the research twin "full" ran the chain 1.03-1.05x (Zen 4) and 1.04-1.10x (Zen 3)
# faster at k = 1..3 (WORKSPACE.md). Wider passes (a tree's 9 rows) cost their arithmetic (8 rows ~2.7x a row).
AUTO_FULL_HEAD_ROWS = 4
ALL_ROWS = 1 << 30  # no pass is wider


def full_head_rows(verify_head: str, on_ggml: bool) -> int:
    """`RunConfig.verify_head` resolved: the widest verify pass that computes its LM head in one product
    ("full": every pass; "lazy": none; "auto": every pass off ggml, e.g. on a GPU where extra rows are nearly
    free; on ggml AUTO_FULL_HEAD_ROWS, beyond which each extra head row costs its arithmetic)."""
    if verify_head == "full" or (verify_head == "auto" and not on_ggml):
        return ALL_ROWS
    if verify_head == "lazy":
        return 0
    return AUTO_FULL_HEAD_ROWS


class Runtime:
    """The jitted steps of one loaded model, bound to its params and a context size.

    Every step donates the state it is given: use the returned state, never the passed one.
    """

    def __init__(self, model: Transformer, max_context: int, run: RunConfig | Sequence[int] = RunConfig()):
        """run: the run configuration (its prefill_buckets), or just the prefill bucket sizes."""
        self.config = model.config
        self.max_context = int(max_context)
        self.run = run if isinstance(run, RunConfig) else RunConfig(prefill_buckets=tuple(run))
        self.prefill_buckets = self.run.prefill_buckets
        # params: the model's arrays, flat; cache: expert residency state, replaced after every step
        self.graph, self.params, self.cache = split(model, ExpertCache)
        # The device loop's verify head (`RunConfig.verify_head`) as the widest pass whose head rows are one
        # product; wider passes walk them lazily (`lazy_head_for`).
        self.full_head_rows = full_head_rows(self.run.verify_head,
                                             all(p.kernels == "ggml" for p in model.lm_head.parts()))
        self._fns = _step_fns(self.graph)
        self._hold = hold(self.graph)
        self._snapshot_buffers: Snapshots | None = None  # the last device loop's (`snapshot_buffers`)

    def lazy_head_for(self, rows: int) -> bool:
        """Whether a device-loop verify pass of `rows` rows computes its LM head lazily (one walked row at a
        time) rather than in one product of every row."""
        return rows > self.full_head_rows

    def verify_head_desc(self) -> str:
        """The resolved verify head in words: "full", "lazy" or "full up to N rows, lazy above"."""
        r = self.full_head_rows
        return "full" if r >= ALL_ROWS else "lazy" if r == 0 else f"full up to {r} rows, lazy above"

    def close(self) -> None:
        """Drop the params and cache and release the graph's compiled steps (`compiled.release`)."""
        self._hold.release()
        self.params, self.cache, self._fns = (), (), None
        self._snapshot_buffers = None

    def snapshot_buffers(self, state: DecodeState, T: int) -> Snapshots:
        """GDN snapshot buffers of T rows for a speculative device loop to donate (it seeds row 0 with
        the state, `state.first_snapshots`, and hands them back through `keep_snapshot_buffers`): the
        last loop's when they have T rows, else new ones. Kept between generations (T rows of the GDN
        state: 60 MB a row on the 35B shapes) because a loop's fresh buffers cost their page faults on
        every generation; `close` drops them."""
        kept, self._snapshot_buffers = self._snapshot_buffers, None
        if kept is not None and snapshot_rows(kept) == T:
            return kept
        del kept  # a loop of another width: its buffers go before the new ones are made
        return repeat_as_snapshots(state, T)

    def keep_snapshot_buffers(self, snaps: Snapshots) -> None:
        """Keep a device loop's returned snapshot buffers for the next (`snapshot_buffers`)."""
        self._snapshot_buffers = snaps

    @property
    def steps(self) -> SimpleNamespace:
        """The jitted step functions of this model graph (`_step_fns`: prefill, head, head_row, decode,
        verify, commit, commit_verify, tree_commit_verify; the two passes take a static head=False for no LM
        head), taking (params, cache, ...) explicitly and returning (their named result: `PrefillChunk`,
        `Step`, `Verified`, `Pass`; the new cache): for programs that nest them, such as the device loop."""
        return self._fns

    def expert_cache_arrays(self) -> dict[tuple, jax.Array]:
        """The expert residency arrays by nnx path (empty without an expert budget)."""
        state = jax.tree.unflatten(self.graph.cache_treedef, self.cache)
        return {tuple(p): (v.get_value() if hasattr(v, "get_value") else v) for p, v in nnx.to_flat_state(state)}

    def new_state(self) -> DecodeState:
        """A zeroed state for a new sequence."""
        return init_state(self.config, self.max_context)

    def prefill(self, state: DecodeState, ids: Sequence[int], start: int = 0, gdn: str = "chunked",
                queries: list | None = None) -> Prefill:
        """Run prompt ids at positions start.. in bucketed chunks.

        Returns `Prefill(chunks, logits, state)`: chunks is a list of (hidden [B, D], n_valid) per
        chunk (device arrays, rows >= n_valid are padding); logits [V] is for the last prompt row.
        queries (a list): receives, per chunk, (the attention layers' post-rope queries, a tuple of
        [B, Hq, hd], n_valid) (SnapKV's observation window), from a separately compiled prefill.
        """
        ids = np.asarray(ids, dtype=np.int32)
        n = len(ids)
        if n == 0:
            raise InputError("prefill needs at least one token")
        if start + n > self.max_context:
            raise InputError(f"{start + n} positions exceed max_context = {self.max_context}")
        chunks, off, logits = [], 0, None
        for B, m in prefill_plan(n, self.prefill_buckets):
            toks = np.zeros(B, np.int32)
            toks[:m] = ids[off:off + m]
            out, self.cache = self._fns.prefill(self.params, self.cache, state, toks, np.int32(start + off),
                                                np.int32(m), gdn=gdn, with_q=queries is not None)
            state, logits = out.state, out.logits
            if queries is not None:
                queries.append((out.queries, m))
            chunks.append((out.hidden, m))
            off += m
        return Prefill(chunks, logits, state)

    def head(self, hidden: jax.Array) -> jax.Array:
        """LM head on a [B, D] bucket of final-normed hidden rows (B >= 2)."""
        return self._fns.head(self.params, self.cache, hidden)

    def chunk_logits(self, chunks: list) -> np.ndarray:
        """Teacher-forced logits [T, V] of a prefill's chunks (`Prefill.chunks`): the LM head on every
        valid row."""
        return np.concatenate([np.asarray(self.head(h))[:n] for h, n in chunks])

    def decode_step(self, state: DecodeState, token: int, pos: int) -> Step:
        """One token at position pos -> `Step(logits [V], hidden [D], state)`."""
        out, self.cache = self._fns.decode(self.params, self.cache, state, np.int32(token), np.int32(pos))
        return out

    def verify_step(self, state: DecodeState, tokens: Sequence[int] | jax.Array, pos: int,
                    n_valid: int | None = None) -> Verified:
        """T >= 2 tokens at positions pos.. -> `Verified(logits [T, V], hidden [T, D], state with KV written
        and GDN state unchanged, snaps)`. Follow with `commit(state, snaps, index)`.

        n_valid < T: rows >= n_valid are bucket padding (no KV write, no expert reads; their outputs
        and snapshots are meaningless), so one width serves several draft lengths. `tokens` may be a
        device int32 array (no host round trip)."""
        if not isinstance(tokens, jax.Array):
            tokens = np.asarray(tokens, np.int32)
        T = tokens.shape[0] if tokens.ndim == 1 else -1
        if T < 2:
            raise InputError(f"verify_step needs a 1-D row of at least 2 tokens, got shape {tokens.shape}")
        n_valid = T if n_valid is None else int(n_valid)
        if not 1 <= n_valid <= T:
            raise InputError(f"verify_step n_valid must be in [1, {T}], got {n_valid}")
        if pos + n_valid > self.max_context:
            raise InputError(f"{pos + n_valid} positions exceed max_context = {self.max_context}")
        out, self.cache = self._fns.verify(self.params, self.cache, state, tokens, np.int32(pos), np.int32(n_valid))
        return out

    def commit(self, state: DecodeState, snaps: Snapshots, index: int) -> DecodeState:
        """Set the GDN state to snapshot `index` (the state after verify row `index`)."""
        return self._fns.commit(state, snaps, np.int32(index))

    def commit_verify(self, state: DecodeState, snaps: Snapshots | None, index: int, tokens: jax.Array, pos: int,
                      n_valid: int) -> Pass:
        """`commit(state, snaps, index)` (the previous pass's rollback; snaps=None: none) then
        `verify_step(state, tokens, pos, n_valid)` in ONE dispatch (the MTP loop's trunk pass).
        Returns `Pass(logits [T, V], greedy (argmax of each row [T] int32), hidden [T, D], state, snaps)`.
        `snaps` is donated like the state: the pass writes its snapshots into those buffers (same width).
        The returned state has the pass's KV rows; its GDN entries are the given ones, unread (row 0
        starts from snapshot `index` in place): the state after a row is `commit(state, snaps, row)`."""
        T = tokens.shape[0]
        if not 1 <= n_valid <= T or pos + n_valid > self.max_context:
            raise InputError(f"commit_verify: {n_valid} rows at position {pos} (width {T}, max_context "
                             f"{self.max_context})")
        if snaps is None:  # "after row 0" of a pass that did not happen = the state itself
            snaps, index = repeat_as_snapshots(state, T), 0
        out, self.cache = self._fns.commit_verify(self.params, self.cache, state, snaps, np.int32(index), tokens,
                                                  np.int32(pos), np.int32(n_valid))
        return out

    def tree_commit_verify(self, state: DecodeState, snaps: Snapshots | None, index: int, prev_pos: int,
                           path: np.ndarray, n_path: int, tokens, pos: int, n_valid: int, parent: np.ndarray) -> Pass:
        """The previous tree pass's commit, then one pass over draft-tree rows, in ONE dispatch.

        Commit (skipped when snaps is None): GDN snapshot `index`, and the KV rows of the accepted path
        (rows path[:n_path] of the pass at prev_pos) moved to prev_pos, prev_pos + 1, .... Pass: row t
        (parent[t] < t, -1 for the root) at position pos + depth[t], its K/V at slot pos + t; rows >=
        n_valid are padding. Every valid row's logits, hidden and GDN snapshot are bitwise those of
        single-token decode steps along its root path. Returns `Pass(logits [T, V], greedy [T] int32,
        hidden [T, D], state, snaps (row t = the state after node t))`; the state's GDN entries as
        `commit_verify`'s."""
        T = tokens.shape[0]
        if not 1 <= n_valid <= T or pos + n_valid > self.max_context:
            raise InputError(f"tree pass: {n_valid} of {T} rows at position {pos} exceed max_context "
                             f"{self.max_context}")
        try:
            depth, parent, anc = tree_arrays(parent, n_valid, T)
        except ValueError as e:
            raise InputError(f"tree pass: {e}") from None
        if snaps is None:
            snaps, index, n_path = repeat_as_snapshots(state, T), 0, 0
        path = np.zeros(T, np.int32) if path is None else np.asarray(path, np.int32)
        out, self.cache = self._fns.tree_commit_verify(
            self.params, self.cache, state, snaps, np.int32(index), np.int32(prev_pos), path, np.int32(n_path),
            tokens, np.int32(pos), np.int32(n_valid), depth, parent, anc)
        return out
