"""MTP speculative decoding (draft, verify, accept, roll back): chain drafts from the
MTP head, ONE trunk pass over [t, d1..dk], greedy / exact-match acceptance, rollback by GDN snapshot.

One pass, with P the position of the certain token t and h[P-1] the target's final-normed hidden:
1. `MTPRuntime.draft` (one jitted call): MTP KV catch-up for the rows accepted by the previous pass,
   paired with the TARGET's verified hiddens (x_p, h[p-1]), fused with draft step 0 (t, h[P-1]) at P
   (they are independent rows of one bucket; row results are bitwise those of separate calls), then
   steps i = 1..k-1 on (d_i, h'_{i-1}), h' being the head's own post-shared_head_norm output.
   Drafts are greedy (argmax of the MTP logits), as llama.cpp's top-k(10)-then-best draft sampler.
2. Verify: one trunk pass over [t, d1..dk] at P..P+k keeping the GDN snapshots after every row
   (`Runtime.commit_verify`: the previous pass's rollback, the verify rows and their argmax in one
   dispatch) ("batched"), or single-token `decode_step`s that stop at the first mismatch ("sequential":
   the reference; its rows are bitwise the batched rows, so both give the same tokens).
3. Accept a = number of leading drafts equal to the target's token of the previous row (greedy
   argmax, or the seeded sampler with the key of that generated-token index: exact-match acceptance,
   so sampled output equals non-speculative sampled output). The target's token at row a is the next
   certain token; nothing is re-decoded.
4. Rollback: select the GDN conv/SSM snapshot after row a (`commit`, applied at the start of the next
   trunk pass); the trunk and MTP KV lengths are host-side (P + a + 1): rows past them are masked and
   overwritten later.

All three archs (qwen35moe, qwen35, qwen3next) roll back by snapshot selection. (llama.cpp does that
for qwen35/qwen35moe but restores a checkpoint and re-decodes the accepted tokens for qwen3next.)

The MTP sequence starts at trunk position 1: the pair (x_p, h[p-1]) sits at MTP position p - 1, and
token 0 has no MTP row. That is how the head was trained, and the transformers reference MTP logits
match it to ~2e-7 (tests/model/test_mtp.py). llama.cpp instead also writes a row for (x_0, h = 0) at
position 0 (`pending_h` zero-initialised), which every later MTP row attends to and which moves the
reference logits by 1e-2 to 3e-1 (relative L2); `zero_h_first=True` reproduces llama.cpp's convention.

Shapes: drafts are computed into a fixed number of slots K (`width`, default k), the verify step has
K + 1 rows and the fused MTP call K + 2 rows, so each compiles once per K; shorter drafts (context
end, llama.cpp's budget cap) use the same compiled functions with fewer valid rows.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Collection, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.errors import InputError
from sharpi_jax.model.mtp import MTPHead
from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime import draft_vocab, kv_eviction
from sharpi_jax.runtime.compiled import Graph, jit_factory, split
from sharpi_jax.runtime.draft_vocab import DraftVocab
from sharpi_jax.runtime.generate import Generation, timing_stats
from sharpi_jax.runtime.options import VERIFY_MODES
from sharpi_jax.runtime.sampling import SamplingParams, sample
from sharpi_jax.runtime.state import MTPCache, gdn_caches, init_mtp_cache, with_gdn
from sharpi_jax.runtime.steps import Runtime


class MTPRows(NamedTuple):
    """MTP rows: the head's post-norm output h' [B, D], the cache, with_q the queries ((q [B, Hq, hd],);
    else ())."""

    hidden: jax.Array
    cache: MTPCache
    queries: tuple


class MTPPrefill(NamedTuple):
    """The MTP KV caught up over a prompt: the cache, the trunk hidden paired with the last id, and
    [(h' [B, D], rows valid)] per MTP bucket."""

    cache: MTPCache
    h_last: jax.Array
    chunks: list


class Draft(NamedTuple):
    """A pass's drafts (chain: [t, d1..dK] int32 device array; tree: a `tree_draft.DraftTree`), the MTP
    cache, and the trunk hidden paired with the certain token t."""

    drafts: Any
    cache: MTPCache
    h: jax.Array


class PassResult(NamedTuple):
    """One speculative pass: the accepted drafts, the target's next token, the draft nodes verified and
    the drafts' depth (a chain: both its length)."""

    accepted: list[int]
    next: int
    nodes: int
    depth: int


@jit_factory
def _mtp_fns(graph: Graph) -> dict:
    """The jitted MTP steps of one head graph (`compiled.jit_factory`): rows, draft, logits."""
    merge = graph.merge

    def rows(params, cache, tokens, hs, start, n_valid, with_q=False):
        hp, cache, *q = merge(params)(tokens, hs, start, n_valid, cache, with_q=with_q)
        return MTPRows(hp, cache, tuple(q))

    def draft(params, cache, tokens, h_prev, hidden, start, n_valid, n_draft, vocab=None):
        mtp = merge(params)
        W = tokens.shape[0]
        hs = jnp.concatenate([h_prev[None], hidden])[:W]
        hp, cache = mtp(tokens, hs, start, n_valid, cache)
        last = n_valid - 1  # the row of the certain token t

        def greedy(h):  # a 2-row bucket: the row-stable kernel; vocab: a `draft_vocab.DraftVocab`
            if vocab is not None:
                return vocab.greedy(jnp.stack([h, h]))
            return jnp.argmax(mtp.logits(jnp.stack([h, h]), 1)[0]).astype(jnp.int32)

        h = jax.lax.dynamic_index_in_dim(hp, last, keepdims=False)
        d = greedy(h)
        drafts = jnp.zeros((W - 2,), jnp.int32).at[0].set(d)
        pos0 = start + last

        def step(i, carry):
            cache, tok, h, drafts = carry
            hp, cache = mtp(jnp.stack([tok, tok]), jnp.stack([h, h]), pos0 + i, jnp.int32(1), cache)
            tok = greedy(hp[0])
            return cache, tok, hp[0], drafts.at[i].set(tok)

        cache, _, _, drafts = jax.lax.fori_loop(1, n_draft, step, (cache, d, h, drafts))
        t = jax.lax.dynamic_index_in_dim(tokens, last, keepdims=False)
        h_t = jax.lax.dynamic_index_in_dim(hs, last, keepdims=False)
        return Draft(jnp.concatenate([t[None], drafts]), cache, h_t)

    def logits(params, h):
        return merge(params).logits(h)

    return dict(rows=(rows, dict(donate_argnums=(1,), static_argnames=("with_q",))),
                draft=(draft, dict(donate_argnums=(1,))), logits=(logits, {}))


@jax.jit
def _argmax_rows(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=1)
def _stack_rows(rows, n):
    """[n, D] from a tuple of [D] rows, zero-padded."""
    x = jnp.stack(rows)
    return jnp.concatenate([x, jnp.zeros((n - x.shape[0],) + x.shape[1:], x.dtype)])


@jax.jit
def _shift_rows(h_prev, hidden):
    """[h_prev, hidden[0], ..., hidden[B-2]]: row i gets the hidden of the row before it."""
    return jnp.concatenate([h_prev[None], hidden[:-1]])


@jax.jit
def _row(hidden, i):
    return jax.lax.dynamic_index_in_dim(hidden, i, keepdims=False)


class MTPRuntime:
    """The jitted MTP steps of one loaded head, bound to its params and a context size."""

    def __init__(self, head: MTPHead, max_context: int):
        self.config = head.config
        self.max_context = int(max_context)
        self.graph, self.params, _ = split(head)  # graph: also for other jitted MTP steps (the tree drafter's)
        fns = _mtp_fns(self.graph)
        self._rows, self._draft, self._logits = fns.rows, fns.draft, fns.logits
        self._head_parts = head.lm_head.parts()
        self._vocabs: dict[tuple, DraftVocab] = {}
        self.path: str | None = None  # the model file (a saved draft-vocabulary ranking is found beside it)

    def draft_vocab(self, n: int | None) -> DraftVocab | None:
        """The draft LM head over the n best-ranked token ids (`draft_vocab.load_ranking`), gathered once
        per n and kept; None: the full head."""
        if n is None:
            return None
        V = self.config.n_vocab
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= V:
            raise InputError(f"draft_vocab must be an integer in [1, {V}] (the vocabulary), got {n!r}")
        rank, source = draft_vocab.load_ranking(self.path, V) if self.path else (np.arange(V), draft_vocab.FALLBACK)
        key = (int(n), source)
        if key not in self._vocabs:
            self._vocabs = {key: draft_vocab.build(self._head_parts, rank, int(n))}  # one kept at a time
        return self._vocabs[key]

    @property
    def draft_fn(self):
        """The jitted draft call (`draft`'s computation, taking params and device arrays explicitly and
        returning a `Draft`: for programs that nest it, such as the device loop)."""
        return self._draft

    def forget_draft_vocabs(self) -> None:
        """Drop the gathered draft heads (after a new calibration)."""
        self._vocabs = {}

    def new_cache(self) -> MTPCache:
        return init_mtp_cache(self.config, self.max_context)

    def rows(self, cache: MTPCache, tokens, hs: jax.Array, start: int, n_valid: int,
             with_q: bool = False) -> MTPRows:
        """MTP rows (tokens[i], hs[i]) at MTP positions start + i, i < n_valid (a bucket of B >= 2 rows),
        written to the cache. Returns `MTPRows(h' [B, D], cache, queries)`, with_q: queries ((q [B, Hq, hd],))."""
        return self._rows(self.params, cache, np.asarray(tokens, np.int32), hs, np.int32(start), np.int32(n_valid),
                          with_q=with_q)

    def prefill(self, cache: MTPCache, ids: Sequence[int], chunks, zero_h_first: bool = False,
                queries: list | None = None) -> MTPPrefill:
        """Catch the MTP KV up over a trunk prefill of ids at positions 0.. (`chunks` = the trunk's
        [(hidden [B, D], n_valid)]): pairs (ids[p], h[p-1]) at MTP position p - 1 for p >= 1, or, with
        zero_h_first (llama.cpp), pairs (ids[p], h[p-1]) at position p including (ids[0], h = 0).
        Returns `MTPPrefill(cache, h of the last id, [(h' [B, D], rows valid)] per chunk)`. queries (a list):
        receives ((q [B, Hq, hd],), rows valid) per MTP bucket (SnapKV)."""
        n, out, off = len(ids), [], 0
        h_prev = jnp.zeros((self.config.d_model,), jnp.float32)
        for hidden, m in chunks:
            B = hidden.shape[0]
            if zero_h_first:
                toks, hs, cnt = ids[off:off + m], _shift_rows(h_prev, hidden), m
            else:
                toks, hs, cnt = ids[off + 1:off + m + 1], hidden, min(m, n - 1 - off)
            if cnt > 0:
                bucket = np.zeros(B, np.int32)
                bucket[:cnt] = toks[:cnt]
                hp, cache, q = self.rows(cache, bucket, hs, off, cnt, with_q=queries is not None)
                out.append((hp, cnt))
                if queries is not None:
                    queries.append((q, cnt))
            h_prev = _row(hidden, np.int32(m - 1))
            off += m
        return MTPPrefill(cache, h_prev, out)

    def draft(self, cache: MTPCache, tokens, h_prev, hidden, start: int, n_valid: int, n_draft: int,
              vocab: DraftVocab | None = None) -> Draft:
        """Catch-up rows 0..n_valid-2 + the chain from row n_valid-1 (the certain token t), n_draft >= 1
        greedy drafts into K = len(tokens) - 2 slots (over `vocab`'s ids only when given). Returns
        `Draft([t, d1..dK] int32 device array (slots past n_draft are 0), cache, the h paired with t)`."""
        return self._draft(self.params, cache, np.asarray(tokens, np.int32), h_prev, hidden, np.int32(start),
                           np.int32(n_valid), np.int32(n_draft), vocab)

    def logits(self, h: jax.Array) -> jax.Array:
        """MTP LM head on post-norm rows [B >= 2, D]."""
        return self._logits(self.params, h)


def teacher_forced_mtp_logits(runtime: Runtime, mtp: MTPRuntime, ids: Sequence[int],
                              zero_h_first: bool = False) -> np.ndarray:
    """MTP logits [T-1, V] at positions 1..T-1 from pairs (ids[p], h[p-1]), h final-normed trunk
    hiddens (chunked prefill). By default the MTP sequence starts at p = 1, as the transformers
    reference; zero_h_first also puts (ids[0], h = 0) first, as llama.cpp."""
    chunks, _, _ = runtime.prefill(runtime.new_state(), ids)
    _, _, hps = mtp.prefill(mtp.new_cache(), ids, chunks, zero_h_first)
    logits = np.concatenate([np.asarray(mtp.logits(hp))[:m] for hp, m in hps])
    return logits[1:] if zero_h_first else logits


class MTPDecoder:
    """Trunk + MTP state of one sequence and the speculative pass (see the module docstring).

    Attributes after `prefill` / `step`: P (position of the next certain token), state, cache, h_prev
    (the trunk hidden paired with the next certain token), mtp_offset (trunk position - MTP position).
    `trace` (a list, optional) receives one dict per pass: tokens [m+1], logits [m+1, V], hidden
    [m+1, D], conv/ssm (per GDN layer, the state after each of the m+1 rows), accepted. With
    full_rows (sequential only) all m+1 rows are computed even past the first mismatch, and the GDN
    state is restored from the copy kept after row a: the batched-vs-sequential parity reference.
    """

    def __init__(self, runtime: Runtime, mtp: MTPRuntime, draft_tokens: int, verify: str = "batched",
                 width: int | None = None, full_rows: bool = False, trace: list | None = None,
                 zero_h_first: bool = False, kv: SnapKV | None = None, kv_capacity: int | None = None,
                 mtp_kv: str = "snapkv", vocab: DraftVocab | None = None):
        """kv, kv_capacity: SnapKV eviction at prefill into caches of kv_capacity slots (`kv_eviction`);
        mtp_kv: "snapkv" evicts the MTP head's own KV by the same rule, "keep" keeps it whole; vocab:
        draft over these token ids only (`draft_vocab`; verification uses the full head)."""
        self.vocab = vocab
        assert verify in VERIFY_MODES, verify  # checked where options enter (`options.GenerateOptions`)
        if mtp_kv not in kv_eviction.MTP_KV_MODES:
            raise InputError(f"mtp_kv must be one of {kv_eviction.MTP_KV_MODES}, got {mtp_kv!r}")
        if kv is not None and kv_capacity is None:
            raise InputError("a kv policy needs kv_capacity (kv_budget + max_new_tokens)")
        self.kv, self.kv_capacity, self.mtp_kv = kv, kv_capacity, mtp_kv
        self.rt, self.mtp, self.k, self.verify = runtime, mtp, int(draft_tokens), verify
        self.K = int(width) if width is not None else self.k
        if not 1 <= self.k <= self.K:
            raise InputError(f"draft_tokens must be in [1, width = {self.K}], got {self.k}")
        self.full_rows, self.trace, self.zero_h_first = full_rows, trace, zero_h_first
        self.mtp_offset = 0 if zero_h_first else 1  # MTP position = trunk position - offset
        self.draft_s = self.verify_s = 0.0

    def prefill(self, ids: Sequence[int]) -> jax.Array:
        """Trunk prefill + MTP KV over ids (positions 0..n-1). Returns the last row's logits [V]."""
        rt = self.rt
        chunks, logits, state, self.evicted = kv_eviction.prefill(rt, ids, self.kv, self.kv_capacity)
        if self.evicted is not None and self.mtp_kv == "snapkv":
            cache, h_last = kv_eviction.mtp_prefill(self.mtp, ids, chunks, self.zero_h_first, self.kv,
                                                    self.kv_capacity)
        else:
            cache, h_last, _ = self.mtp.prefill(self.mtp.new_cache(), ids, chunks, self.zero_h_first)
        self.state, self.cache, self.P = state, cache, len(ids)
        self._commit = None  # batched: (snaps, a) of the last pass, applied inside the next trunk pass
        D = rt.config.d_model
        # Rows to catch up before the next draft row: none yet; the certain token pairs with h_last.
        self._pend, self._pend_start, self.h_prev = [], self.P, h_last
        self._hidden = jnp.zeros((self.K + 1, D), jnp.float32)
        jax.block_until_ready((logits, cache))
        return logits

    def step(self, t: int, n_draft: int, sampling: SamplingParams, index: int) -> PassResult:
        """One pass from the certain token t (generated-token index `index`) at position P with
        n_draft drafts (0 <= n_draft <= K; 0 = a plain verify of t). Returns `PassResult(accepted drafts,
        the target's next token, n_draft, n_draft)` and advances P by len(accepted) + 1."""
        if not 0 <= n_draft <= self.K:
            raise InputError(f"n_draft must be in [0, {self.K}], got {n_draft}")
        P = self.P
        if n_draft > self.max_drafts():
            raise InputError(f"a pass at position {P} with {n_draft} drafts exceeds max_context or the KV slots")
        t0 = time.perf_counter()
        toks = np.zeros(self.K + 2, np.int32)
        n_valid = len(self._pend) + 1
        toks[:n_valid] = self._pend + [t]
        vtokens, self.cache, h_t = self.mtp.draft(self.cache, toks, self.h_prev, self._hidden,
                                                  self._pend_start - self.mtp_offset, n_valid, max(n_draft, 1),
                                                  self.vocab)
        vtokens.block_until_ready()
        t1 = time.perf_counter()
        if self.verify == "batched":
            accepted, nxt, hidden = self._verify_batched(vtokens, n_draft, sampling, index)
        else:
            accepted, nxt, hidden = self._verify_sequential(np.asarray(vtokens), n_draft, sampling, index)
        self.draft_s += t1 - t0
        self.verify_s += time.perf_counter() - t1
        a = len(accepted)
        self._pend, self._pend_start, self.h_prev, self._hidden = [t] + accepted, P, h_t, hidden
        self.P = P + a + 1
        return PassResult(accepted, nxt, n_draft, n_draft)

    def max_drafts(self) -> int:
        """The most drafts the next pass may verify: its rows must fit max_context and, on a compacted
        cache, its kv_capacity slots (the evicted cache is sized for the tokens still to come)."""
        room = self.rt.max_context - 1 - self.P
        if self.evicted is not None:
            room = min(room, self.evicted.capacity - 1 - self.evicted.slot(self.P))
        return min(self.K, room)

    def _targets(self, row: Callable[[int], jax.Array], drafts: np.ndarray, n_draft: int,
                 sampling: SamplingParams, index: int, greedy_rows: np.ndarray | None) -> tuple[list[int], int]:
        """Exact-match acceptance: the target's token of row r (index + r + 1) against d_{r+1}."""
        accepted = []
        for r in range(n_draft + 1):
            if greedy_rows is not None:
                tok = int(greedy_rows[r])
            else:
                tok = int(sample(row(r), sampling, index + r + 1))
            if r < n_draft and tok == int(drafts[r]):
                accepted.append(tok)
                continue
            return accepted, tok
        raise AssertionError("unreachable")

    def committed_state(self):
        """The trunk state after the last accepted row (applies a pending batched rollback)."""
        if self._commit is not None:
            self.state = self.rt.commit(self.state, *self._commit)
            self._commit = None
        return self.state

    def _verify_batched(self, vtokens, n_draft, sampling, index):
        rt = self.rt
        snaps, a = self._commit if self._commit is not None else (None, 0)
        logits, greedy, hidden, state, snaps = rt.commit_verify(self.state, snaps, a, vtokens, self.P, n_draft + 1)
        greedy_rows = np.asarray(greedy) if sampling.greedy else None
        host = np.asarray(vtokens)
        accepted, nxt = self._targets(lambda r: logits[r], host[1:], n_draft, sampling, index, greedy_rows)
        if self.trace is not None:
            m = n_draft + 1
            gdn = gdn_caches(snaps)
            self.trace.append(dict(tokens=host[:m], logits=np.asarray(logits)[:m], hidden=np.asarray(hidden)[:m],
                                   conv=tuple(np.asarray(g.conv)[:m] for g in gdn),
                                   ssm=tuple(np.asarray(g.ssm)[:m] for g in gdn), accepted=len(accepted)))
        self.state, self._commit = state, (snaps, len(accepted))  # rollback: snapshot a, next pass
        return accepted, nxt, hidden

    def _verify_sequential(self, vtokens: np.ndarray, n_draft, sampling, index):
        """Row by row with single-token decode steps; stops after the first mismatch unless full_rows."""
        rt, state = self.rt, self.committed_state()
        logits_rows, hidden_rows, kept = [], [], []
        accepted, nxt = None, None
        greedy = sampling.greedy
        for r in range(n_draft + 1):
            lg, h, state = rt.decode_step(state, int(vtokens[r]), self.P + r)
            logits_rows.append(lg)
            hidden_rows.append(h)
            if self.full_rows:
                kept.append(jax.tree.map(jnp.copy, gdn_caches(state)))
            if accepted is None:
                tok = int(_argmax_rows(lg)) if greedy else int(sample(lg, sampling, index + r + 1))
                if not (r < n_draft and tok == int(vtokens[r + 1])):
                    accepted, nxt = [int(x) for x in vtokens[1:r + 1]], tok
                    if not self.full_rows:
                        break
        a = len(accepted)
        if self.full_rows:
            state = with_gdn(state, kept[a])
        if self.trace is not None:
            m = len(logits_rows)
            n_gdn = len(kept[0]) if kept else 0
            self.trace.append(dict(tokens=vtokens[:m], logits=np.stack([np.asarray(x) for x in logits_rows]),
                                   hidden=np.stack([np.asarray(x) for x in hidden_rows]),
                                   conv=tuple(np.stack([np.asarray(kk[i].conv) for kk in kept])
                                              for i in range(n_gdn)) if kept else None,
                                   ssm=tuple(np.stack([np.asarray(kk[i].ssm) for kk in kept])
                                             for i in range(n_gdn)) if kept else None,
                                   accepted=a))
        self.state = state
        return accepted, nxt, _stack_rows(tuple(hidden_rows[:a + 1]), self.K + 1)


def _pass_stats(k: int, passes: list[tuple[int, int]]) -> dict[str, Any]:
    """Acceptance stats from (n_draft, accepted) per verify pass."""
    counts = dict(passes=len(passes), drafted=sum(n for n, _ in passes), accepted=sum(a for _, a in passes),
                  tried=[sum(n >= i for n, _ in passes) for i in range(1, k + 1)],
                  hit=[sum(n >= i and a >= i for n, a in passes) for i in range(1, k + 1)])
    return pass_stats_from_counts(k, counts)


def pass_stats_from_counts(k: int, counts: dict | None) -> dict[str, Any]:
    """Acceptance stats from pass counts: passes, drafted, accepted (sums over passes), tried[i-1] /
    hit[i-1] (passes that drafted position i / accepted it), i = 1..k. None: no pass."""
    if counts is None:
        counts = dict(passes=0, drafted=0, accepted=0, tried=[0] * k, hit=[0] * k)
    passes, drafted, accepted = int(counts["passes"]), int(counts["drafted"]), int(counts["accepted"])
    return {
        "drafted": drafted,
        "accepted": accepted,
        "verify_passes": passes,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accept_len": (accepted + passes) / passes if passes else 0.0,
        "accept_per_position": [int(h) / int(t) if int(t) else 0.0
                                for t, h in zip(counts["tried"][:k], counts["hit"][:k])],
    }


def emit_passes(first: list[int], max_new_tokens: int, stop_ids: Collection[int], max_context: int,
                position: Callable[[], int], one_pass: Callable[[list[int]], list[int]]) -> tuple[list[int], str]:
    """The emit loop of speculative generation (chain and tree): emit a pass's tokens in order up to
    an EOS or max_new_tokens, then run the next pass from them (`one_pass(out)` -> its accepted tokens
    plus the target's next one) while the certain token's position is inside the context.
    Returns (tokens, stop reason: "eos" | "max_new_tokens" | "max_context")."""
    stop_ids = frozenset(stop_ids)
    out: list[int] = []
    emit = first
    while emit:
        for tok in emit:
            out.append(tok)
            if tok in stop_ids:
                return out, "eos"
            if len(out) == max_new_tokens:
                return out, "max_new_tokens"
        if position() >= max_context:
            return out, "max_context"
        emit = one_pass(out)
    return out, "max_new_tokens"


def generate_mtp(runtime: Runtime, mtp: MTPRuntime, prompt: Sequence[int], max_new_tokens: int,
                 sampling: SamplingParams, stop_ids: Collection[int] = (), draft_tokens: int = 3,
                 verify: str = "batched", width: int | None = None, full_rows: bool = False,
                 trace: list | None = None, zero_h_first: bool = False, kv: SnapKV | None = None,
                 mtp_kv: str = "snapkv", vocab: DraftVocab | None = None) -> Generation:
    """Speculative generation; the tokens are those of `generate.generate_ids` with the same arguments
    (kv: the same SnapKV eviction; mtp_kv: evict the MTP head's KV too, or keep it whole).

    stats: those of `generate_ids` (prompt_tokens, generated_tokens, prefill_s, prefill_tok_s (trunk +
    MTP prompt processing), decode_s, decode_tok_s, stop_reason) plus speculative, draft_tokens,
    verify, drafted (draft tokens verified), accepted, verify_passes, acceptance_rate
    (accepted / drafted), mean_accept_len (mean over passes of accepted drafts + 1 = tokens per
    trunk pass), accept_per_position (k fractions: position i accepted, over the passes that drafted
    it), draft_s and verify_s (MTP vs trunk time; the rest of decode_s is host bookkeeping), kv_slots,
    kv_evicted, kv_capacity (`kv_eviction.kv_stats`).
    """
    t0 = time.perf_counter()
    capacity = kv_eviction.kv_capacity(kv, max_new_tokens, runtime.max_context)
    dec = MTPDecoder(runtime, mtp, draft_tokens, verify, width, full_rows, trace, zero_h_first, kv, capacity, mtp_kv,
                     vocab)
    logits = dec.prefill(prompt)
    t1 = time.perf_counter()
    passes: list[tuple[int, int]] = []

    def one_pass(out: list[int]) -> list[int]:
        r = dec.step(out[-1], min(dec.k, dec.max_drafts()), sampling, len(out) - 1)
        passes.append((r.nodes, len(r.accepted)))
        return r.accepted + [r.next]

    first = [int(sample(logits, sampling, 0))] if max_new_tokens > 0 else []
    out, stop = emit_passes(first, max_new_tokens, stop_ids, runtime.max_context, lambda: dec.P, one_pass)
    t2 = time.perf_counter()
    stats = {
        **timing_stats(len(prompt), len(out), t0, t1, t2, stop),
        "speculative": "mtp",
        "draft_tokens": dec.k,
        "verify": verify,
        "draft_vocab": None if vocab is None else vocab.size,
        **_pass_stats(dec.k, passes),
        "draft_s": dec.draft_s,
        "verify_s": dec.verify_s,
        **kv_eviction.kv_stats(dec.evicted, dec.P, runtime.max_context),
    }
    return Generation(out, stats)


def llamacpp_protocol(runtime: Runtime, mtp: MTPRuntime, prompt: Sequence[int], draft_tokens: int,
                      n_predict: int = 48, replay: bool = False, budget_cap: bool = False,
                      width: int | None = None, zero_h_first: bool = True) -> dict[str, Any]:
    """Acceptance counted as llama.cpp's `llama-speculative-simple --spec-type draft-mtp` (greedy).

    As there: the prompt minus its last token is prefilled, the first pass starts from the last prompt
    token, every pass counts n_drafted += drafts, n_accept += accepted, n_predict += accepted + 1, and
    the loop ends once n_predict > `n_predict`. budget_cap: cap each draft at n_predict - done - 1 (newer
    llama.cpp). replay: count as llama.cpp does for archs it cannot roll back partially (qwen3next): a
    partially accepted pass is not counted; its accepted tokens plus the target's token are verified
    again as a draft (all accepted) and the bonus token follows. Our decoder still rolls back by
    snapshot; only the counting (and pass structure) is mirrored. zero_h_first: llama.cpp's MTP
    position-0 convention (see the module docstring).
    """
    if len(prompt) < 2:
        raise InputError("llamacpp_protocol needs a prompt of at least 2 tokens")
    dec = MTPDecoder(runtime, mtp, draft_tokens, "batched", width, zero_h_first=zero_h_first)
    greedy = SamplingParams()
    dec.prefill(prompt[:-1])
    t = int(prompt[-1])
    n_drafted = n_accept = done = 0
    tokens: list[int] = []
    while True:
        n_max = draft_tokens if not budget_cap else max(0, min(draft_tokens, n_predict - done - 1))
        accepted, nxt, _, _ = dec.step(t, n_max, greedy, 0)
        if replay and len(accepted) < n_max:
            # llama.cpp: restore, then verify [t, accepted..., nxt] as a draft: all accepted, plus a bonus.
            bonus = dec.step(nxt, 0, greedy, 0).next
            n_drafted += len(accepted) + 1
            n_accept += len(accepted) + 1
            done += len(accepted) + 2
            tokens += accepted + [nxt, bonus]
            t = bonus
        else:
            n_drafted += n_max
            n_accept += len(accepted)
            done += len(accepted) + 1
            tokens += accepted + [nxt]
            t = nxt
        if done > n_predict:
            break
    return {"n_drafted": n_drafted, "n_accept": n_accept, "n_predict": done,
            "accept_pct": 100.0 * n_accept / n_drafted if n_drafted else 0.0, "tokens": tokens}
