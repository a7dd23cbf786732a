"""One decoder skeleton for speculative decoding, chain and tree alike (a chain is a tree of one path).

`Decoder` holds the trunk + MTP state of one sequence: the prefill (trunk, optionally SnapKV-compacted,
and the MTP KV), then passes. A pass from the certain token t at position P:
1. draft (`_draft`, the subclass's drafter): the MTP KV catch-up of the previous pass's certain token
   and accepted drafts (paired with the TARGET's verified hiddens), then drafts from t;
2. verify (`_verify_batched`: one trunk pass over every draft, its commit deferred into the next trunk
   pass; or `_verify_sequential`: single-token decode steps, the reference) and exact-match acceptance;
3. advance: P += accepted + 1; the accepted rows become the next pass's MTP catch-up.
`generate_passes` runs the emit loop over passes and reports the stats both share.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Collection, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.errors import InputError
from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime import kv_eviction
from sharpi_jax.runtime.generate import timing_stats
from sharpi_jax.runtime.mtp import Draft, MTPRuntime
from sharpi_jax.runtime.options import VERIFY_MODES
from sharpi_jax.runtime.passes import PassResult, emit_passes, pass_counts, pass_stats
from sharpi_jax.runtime.sampling import SamplingParams, argmax, sample
from sharpi_jax.runtime.steps import Runtime


@jax.jit
def argmax_rows(logits):
    """The greedy token of each row (of a [V] row: the token)."""
    return argmax(logits)


@functools.partial(jax.jit, static_argnums=1)
def stack_rows(rows, n):
    """[n, D] from a tuple of [D] rows, zero-padded."""
    x = jnp.stack(rows)
    return jnp.concatenate([x, jnp.zeros((n - x.shape[0],) + x.shape[1:], x.dtype)])


class Verdict(NamedTuple):
    """A verified pass: the accepted drafts, the target's next token, the verified hidden rows of the
    accepted path [K + 1, D] (the next pass's MTP catch-up), the draft nodes verified and their depth."""

    accepted: list[int]
    next: int
    hidden: jax.Array
    nodes: int
    depth: int


class Decoder:
    """Trunk + MTP state of one sequence and the pass skeleton (see the module docstring).

    Attributes after `prefill` / `step`: P (position of the next certain token), state, cache, h_prev
    (the trunk hidden paired with the next certain token), mtp_offset (trunk position - MTP position),
    evicted (the SnapKV compaction, or None), draft_s / verify_s (time drafting / verifying).
    Subclasses set K (draft slots: the most drafts on a path; MTP catch-up rows and verified hidden rows
    are K + 1), nodes (the draft nodes a pass plans) and max_nodes (the most a pass holds), and implement
    `_draft`, `_verify_batched`, `_verify_sequential` and `_apply_commit`.
    """

    K: int
    nodes: int
    max_nodes: int
    resume = None  # a session's `session.Resume`: prefill continued from its saved state

    def __init__(self, runtime: Runtime, mtp: MTPRuntime, draft_tokens: int, verify: str, trace: list | None,
                 zero_h_first: bool = False, kv: SnapKV | None = None, kv_capacity: int | None = None,
                 mtp_kv: str = "snapkv"):
        """kv, kv_capacity: SnapKV eviction at prefill into caches of kv_capacity slots (`kv_eviction`);
        mtp_kv: "snapkv" evicts the MTP head's own KV by the same rule, "keep" keeps it whole."""
        assert verify in VERIFY_MODES, verify  # checked where options enter (`options.GenerateOptions`)
        if mtp_kv not in kv_eviction.MTP_KV_MODES:
            raise InputError(f"mtp_kv must be one of {kv_eviction.MTP_KV_MODES}, got {mtp_kv!r}")
        if kv is not None and kv_capacity is None:
            raise InputError("a kv policy needs kv_capacity (kv_budget + max_new_tokens)")
        self.rt, self.mtp, self.k, self.verify, self.trace = runtime, mtp, int(draft_tokens), verify, trace
        self.kv, self.kv_capacity, self.mtp_kv, self.zero_h_first = kv, kv_capacity, mtp_kv, zero_h_first
        self.mtp_offset = 0 if zero_h_first else 1  # MTP position = trunk position - offset
        self.draft_s = self.verify_s = 0.0

    def prefill(self, ids: Sequence[int]) -> jax.Array:
        """Trunk prefill + MTP KV over ids (positions 0..n-1). Returns the last row's logits [V]."""
        chunks, logits, state, self.evicted = kv_eviction.prefill(self.rt, ids, self.kv, self.kv_capacity,
                                                                  self.resume)
        if self.resume is not None:
            cache, h_last = self.resume.mtp_prefill(self.zero_h_first)
        elif self.evicted is not None and self.mtp_kv == "snapkv":
            cache, h_last = kv_eviction.mtp_prefill(self.mtp, ids, chunks, self.zero_h_first, self.kv,
                                                    self.kv_capacity)
        else:
            cache, h_last, _ = self.mtp.prefill(self.mtp.new_cache(), ids, chunks, self.zero_h_first)
        self.state, self.cache, self.P = state, cache, len(ids)
        self._commit = None  # batched: the last pass's commit, applied inside the next trunk pass
        # Rows to catch up before the next draft row: none yet; the certain token pairs with h_last.
        self._pend, self._pend_start, self.h_prev = [], self.P, h_last
        self._hidden = jnp.zeros((self.K + 1, self.rt.config.d_model), jnp.float32)
        jax.block_until_ready((logits, cache))
        return logits

    def room(self) -> int:
        """The most draft rows the next pass may verify: its rows must fit max_context and, on a
        compacted cache, its kv_capacity slots (the evicted cache is sized for the tokens still to come)."""
        return self.last_position() - self.P

    def last_position(self) -> int:
        """The last position a pass may write: max_context's, or the compacted caches' if earlier."""
        last = self.rt.max_context - 1
        return last if self.evicted is None else min(last, self.evicted.last_position)

    def next_pass(self) -> tuple[int, int]:
        """(depth, nodes) of the pass to run: `nodes` draft nodes within `room()`, depth <= draft_tokens."""
        n_nodes = min(self.nodes, self.room())
        return min(self.k, n_nodes), n_nodes

    def step(self, t: int, depth: int, sampling: SamplingParams, index: int,
             n_nodes: int | None = None) -> PassResult:
        """One pass from the certain token t (generated-token index `index`) at position P with drafts of
        depth `depth` (0: a plain verify of t) and at most n_nodes draft nodes (default depth: a chain).
        Returns a `PassResult` and advances P by len(accepted) + 1."""
        n_nodes = depth if n_nodes is None else n_nodes
        P = self.P
        if not 0 <= depth <= min(self.K, n_nodes) or n_nodes > min(self.max_nodes, self.room()):
            raise InputError(f"a pass at position {P} with {n_nodes} draft nodes of depth {depth} does not fit "
                             f"(at most {min(self.max_nodes, self.room())} nodes, depth {self.K})")
        t0 = time.perf_counter()
        toks = np.zeros(self.K + 2, np.int32)
        n_valid = len(self._pend) + 1
        toks[:n_valid] = self._pend + [t]
        draft = self._draft(toks, self._pend_start - self.mtp_offset, n_valid, depth, n_nodes)
        self.cache = draft.cache
        if draft.n is not None:  # a chain stopped early (draft_p_min): verify the drafts made
            depth = min(depth, int(draft.n))
        t1 = time.perf_counter()
        verify = self._verify_batched if self.verify == "batched" else self._verify_sequential
        v = verify(draft.drafts, depth, sampling, index)
        self.draft_s += t1 - t0
        self.verify_s += time.perf_counter() - t1
        self._pend, self._pend_start, self.h_prev, self._hidden = [t] + v.accepted, P, draft.h, v.hidden
        self.P = P + len(v.accepted) + 1
        return PassResult(v.accepted, v.next, v.nodes, v.depth)

    def committed_state(self):
        """The trunk state after the last accepted row (applies a pending batched commit)."""
        if self._commit is not None:
            self.state = self._apply_commit(self.state, self._commit)
            self._commit = None
        return self.state

    @staticmethod
    def target(logits_row, greedy_rows, sampling: SamplingParams, index: int):
        """target(row, depth) -> the target's token after `row` (at generated-token index index + depth + 1):
        greedy_rows[row] when given (greedy), else the seeded sample of logits_row(row)."""
        def target(row: int, depth: int) -> int:
            if greedy_rows is not None:
                return int(greedy_rows[row])
            return int(sample(logits_row(row), sampling, index + depth + 1))
        return target

    # ----- the drafter and verifier (subclasses) -----
    def _draft(self, tokens: np.ndarray, start: int, n_valid: int, depth: int, n_nodes: int) -> Draft:
        """MTP catch-up rows tokens[:n_valid - 1] at MTP positions start.., the certain token at row
        n_valid - 1, then drafts of depth `depth` and at most n_nodes nodes."""
        raise NotImplementedError

    def _verify_batched(self, drafts, depth: int, sampling: SamplingParams, index: int) -> Verdict:
        """One trunk pass over the drafts and the acceptance walk; leaves the pass's commit in self._commit."""
        raise NotImplementedError

    def _verify_sequential(self, drafts, depth: int, sampling: SamplingParams, index: int) -> Verdict:
        """As `_verify_batched` with single-token decode steps (the reference), committed at once."""
        raise NotImplementedError

    def _apply_commit(self, state, commit):
        """The state after a pending batched commit."""
        raise NotImplementedError


def generate_passes(dec: Decoder, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                    stop_ids: Collection[int], per: str, t0: float) -> tuple[list[int], dict[str, Any], list]:
    """The speculative generation loop over `dec` (prefill, then `dec.next_pass()` passes, emitted up to
    a stop; t0: when the run started). Returns (tokens, stats: `timing_stats`, the pass stats
    (`passes.pass_stats`, `per` naming the per-depth list), draft_s, verify_s; the passes' (nodes,
    depth, accepted))."""
    logits = dec.prefill(prompt)
    t1 = time.perf_counter()
    passes: list[tuple[int, int, int]] = []

    def one_pass(out: list[int]) -> list[int]:
        depth, n_nodes = dec.next_pass()
        r = dec.step(out[-1], depth, sampling, len(out) - 1, n_nodes)
        passes.append((r.nodes, r.depth, len(r.accepted)))
        return r.accepted + [r.next]

    first = [int(sample(logits, sampling, 0))] if max_new_tokens > 0 else []
    out, stop = emit_passes(first, max_new_tokens, stop_ids, dec.rt.max_context, lambda: dec.P, one_pass)
    t2 = time.perf_counter()
    return out, {**timing_stats(len(prompt), len(out), t0, t1, t2, stop),
                 **pass_stats(dec.k, pass_counts(dec.k, passes), per), "draft_s": dec.draft_s,
                 "verify_s": dec.verify_s}, passes
