"""The MTP head's jitted steps (`MTPRuntime`): MTP rows, the prompt's MTP KV catch-up, the fused
catch-up + greedy chain draft of one pass, the MTP LM head, and the draft vocabularies.

The MTP sequence starts at trunk position 1: the pair (x_p, h[p-1]) sits at MTP position p - 1, and
token 0 has no MTP row. That is how the head was trained, and the transformers reference MTP logits
match it to ~2e-7 (tests/model/test_mtp.py). llama.cpp instead also writes a row for (x_0, h = 0) at
position 0 (`pending_h` zero-initialised), which every later MTP row attends to and which moves the
reference logits by 1e-2 to 3e-1 (relative L2); `zero_h_first=True` reproduces llama.cpp's convention.

Shapes: drafts are computed into a fixed number of slots K (`width`), the fused draft call has K + 2
rows, so it compiles once per K; shorter drafts use the same compiled function with fewer valid rows.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.errors import InputError
from sharpi_jax.model.mtp import MTPHead
from sharpi_jax.runtime import draft_vocab
from sharpi_jax.runtime.compiled import Graph, hold, jit_factory, split
from sharpi_jax.runtime.draft_vocab import DraftVocab
from sharpi_jax.runtime.sampling import argmax
from sharpi_jax.runtime.state import MTPCache, init_mtp_cache
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
    n: Any = None  # chain: the drafts made (int32 device scalar; fewer than asked when draft_p_min stopped it)


@jit_factory
def _mtp_fns(graph: Graph) -> dict:
    """The jitted MTP steps of one head graph (`compiled.jit_factory`): rows, draft, logits."""
    merge = graph.merge

    def rows(params, cache, tokens, hs, start, n_valid, with_q=False):
        hp, cache, *q = merge(params)(tokens, hs, start, n_valid, cache, with_q=with_q)
        return MTPRows(hp, cache, tuple(q))

    def draft(params, cache, tokens, h_prev, hidden, start, n_valid, n_draft, vocab=None, p_min=None, live=True):
        # live False (a finished sequence of a batch, `runtime.batch`): every row is padding (no product
        # row, no expert read); the results are discarded.
        mtp = merge(params)
        W = tokens.shape[0]
        live = jnp.asarray(live, jnp.int32)
        hs = jnp.concatenate([h_prev[None], hidden])[:W]
        hp, cache = mtp(tokens, hs, start, n_valid * live, cache)
        last = n_valid - 1  # the row of the certain token t

        def greedy(h):
            """(draft token, whether drafting goes on): a 2-row bucket, the row-stable kernel; vocab: a
            `draft_vocab.DraftVocab`. With p_min, drafting stops at the first draft whose probability under
            the head (its softmax, over the vocabulary it drafts from) is below p_min; that draft is dropped."""
            h2 = jnp.stack([h, h])
            logits = vocab.logits(h2, live) if vocab is not None else mtp.logits(h2, live)[0]
            tok = vocab.token(logits) if vocab is not None else argmax(logits)
            if p_min is None:
                return tok, jnp.bool_(True)
            p_top = 1.0 / jnp.sum(jnp.exp(logits - jnp.max(logits)))
            return tok, p_top >= p_min

        h = jax.lax.dynamic_index_in_dim(hp, last, keepdims=False)
        d, keep = greedy(h)
        drafts = jnp.zeros((W - 2,), jnp.int32).at[0].set(d)
        pos0 = start + last

        def step(c):
            i, cache, tok, h, drafts, n = c
            hp, cache = mtp(jnp.stack([tok, tok]), jnp.stack([h, h]), pos0 + i, live, cache)
            tok, keep = greedy(hp[0])
            return i + 1, cache, tok, hp[0], drafts.at[i].set(tok), n + keep.astype(jnp.int32)

        # Draft i while every earlier draft was kept (n == i); n counts the kept drafts.
        _, cache, _, _, drafts, n = jax.lax.while_loop(
            lambda c: (c[0] < n_draft) & (c[5] == c[0]), step,
            (jnp.int32(1), cache, d, h, drafts, keep.astype(jnp.int32)))
        n = jnp.minimum(n, n_draft)
        drafts = jnp.where(jnp.arange(W - 2) < n, drafts, 0)
        t = jax.lax.dynamic_index_in_dim(tokens, last, keepdims=False)
        h_t = jax.lax.dynamic_index_in_dim(hs, last, keepdims=False)
        return Draft(jnp.concatenate([t[None], drafts]), cache, h_t, n)

    def logits(params, h):
        return merge(params).logits(h)

    return dict(rows=(rows, dict(donate_argnums=(1,), static_argnames=("with_q",))),
                draft=(draft, dict(donate_argnums=(1,))), logits=(logits, {}))


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
        self._hold = hold(self.graph)

    def close(self) -> None:
        """Drop the params and draft vocabularies and release the graph's compiled steps."""
        self._hold.release()
        self.params, self._head_parts, self._vocabs = (), None, {}
        self._rows = self._draft = self._logits = None

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

    @property
    def draft_ranking(self) -> str | None:
        """Where the kept draft vocabulary's ranking came from: a saved file's path, or the fallback."""
        return next(iter(self._vocabs))[1] if self._vocabs else None

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
                queries: list | None = None, start: int = 0, h_before: jax.Array | None = None) -> MTPPrefill:
        """Catch the MTP KV up over a trunk prefill of ids at positions 0.. (`chunks` = the trunk's
        [(hidden [B, D], n_valid)]): pairs (ids[p], h[p-1]) at MTP position p - 1 for p >= 1, or, with
        zero_h_first (llama.cpp), pairs (ids[p], h[p-1]) at position p including (ids[0], h = 0).
        Returns `MTPPrefill(cache, h of the last id, [(h' [B, D], rows valid)] per chunk)`. queries (a list):
        receives ((q [B, Hq, hd],), rows valid) per MTP bucket (SnapKV).

        start > 0 (a session's continuation, `session.Resume`): ids are trunk positions start.. of a
        conversation whose rows before start are in `cache`, and h_before is h[start - 1]: the pairs
        (ids[p], h[p-1]) from p = start on, the same rows a prefill from position 0 writes there."""
        n, out, off = len(ids), [], 0
        shifted = zero_h_first or start > 0  # every id pairs with the hidden of the row before it
        pos0 = start - (1 if start > 0 and not zero_h_first else 0)
        h_prev = jnp.zeros((self.config.d_model,), jnp.float32) if h_before is None else h_before
        for hidden, m in chunks:
            B = hidden.shape[0]
            if shifted:
                toks, hs, cnt = ids[off:off + m], _shift_rows(h_prev, hidden), m
            else:
                toks, hs, cnt = ids[off + 1:off + m + 1], hidden, min(m, n - 1 - off)
            if cnt > 0:
                bucket = np.zeros(B, np.int32)
                bucket[:cnt] = toks[:cnt]
                hp, cache, q = self.rows(cache, bucket, hs, pos0 + off, cnt, with_q=queries is not None)
                out.append((hp, cnt))
                if queries is not None:
                    queries.append((q, cnt))
            h_prev = _row(hidden, np.int32(m - 1))
            off += m
        return MTPPrefill(cache, h_prev, out)

    def draft(self, cache: MTPCache, tokens, h_prev, hidden, start: int, n_valid: int, n_draft: int,
              vocab: DraftVocab | None = None, p_min: float | None = None) -> Draft:
        """Catch-up rows 0..n_valid-2 + the chain from row n_valid-1 (the certain token t), up to n_draft
        >= 1 greedy drafts into K = len(tokens) - 2 slots (over `vocab`'s ids only when given; with p_min,
        stopping before the first draft whose probability is below it). Returns `Draft([t, d1..dK] int32
        device array (slots past the drafts made are 0), cache, the h paired with t, drafts made)`."""
        return self._draft(self.params, cache, np.asarray(tokens, np.int32), h_prev, hidden, np.int32(start),
                           np.int32(n_valid), np.int32(n_draft), vocab,
                           None if p_min is None else np.float32(p_min))

    def logits(self, h: jax.Array) -> jax.Array:
        """MTP LM head on post-norm rows [B >= 2, D]."""
        return self._logits(self.params, h)

    def teacher_forced_logits(self, ids: Sequence[int], chunks, zero_h_first: bool = False) -> np.ndarray:
        """`teacher_forced_mtp_logits` from a trunk prefill of ids already run (`Prefill.chunks`)."""
        _, _, hps = self.prefill(self.new_cache(), ids, chunks, zero_h_first)
        logits = np.concatenate([np.asarray(self.logits(hp))[:m] for hp, m in hps])
        return logits[1:] if zero_h_first else logits


def teacher_forced_mtp_logits(runtime: Runtime, mtp: MTPRuntime, ids: Sequence[int],
                              zero_h_first: bool = False) -> np.ndarray:
    """MTP logits [T-1, V] at positions 1..T-1 from pairs (ids[p], h[p-1]), h final-normed trunk
    hiddens (chunked prefill). By default the MTP sequence starts at p = 1, as the transformers
    reference; zero_h_first also puts (ids[0], h = 0) first, as llama.cpp."""
    return mtp.teacher_forced_logits(ids, runtime.prefill(runtime.new_state(), ids).chunks, zero_h_first)
