"""Draft trees from the MTP head (level by level, best-first by cumulative draft log-prob).

The rule (EAGLE-2-like expansion and reranking, with the greedy chain kept):
1. Root: the certain token t (depth 0). One MTP call does the KV catch-up of the previous pass's
   accepted rows and t's row (exactly the chain drafter's first call); its top-c tokens are the depth-1
   candidates, scored by their draft log-prob.
2. Depth d = 1..k-1: expand a beam of w depth-d candidates, the greedy chain's node (the argmax child of
   the chain's node at depth d-1) first, then the best others by cumulative log-prob. One MTP call runs
   the beam (draft-tree rows: each row attends to the MTP context and its own ancestors' MTP rows, at
   MTP position root + d); each row's top-c tokens become depth-(d+1) candidates, scored by the sum of
   the log-probs along their root path.
3. Tree: the k greedy-chain nodes, then the best other candidates by cumulative log-prob (ties: the
   shallower first) up to `tree_nodes` nodes. A child's score is never above its parent's, so the tree
   is closed under ancestors. Rows are in depth order (every parent before its children).

With c = w = min(8, tree_nodes - k + 1) (1 for tree_nodes = k: the tree is the chain), the k MTP calls
are the chain drafter's k calls, batched over w rows. Because the tree always holds the chain drafter's
chain (bitwise the same MTP rows), a tree pass accepts at least as many tokens as a chain pass would
from the same state. With a draft vocabulary (`draft_vocab.DraftVocab`) every call ranks the subset's ids
only, log-probs under the subset's softmax: the tree then holds the chain that vocabulary drafts.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.errors import InputError
from sharpi_jax.model.tree import TreeRows
from sharpi_jax.runtime.compiled import Graph, jit_factory
from sharpi_jax.runtime.draft_vocab import DraftVocab
from sharpi_jax.runtime.mtp import Draft, MTPRuntime

MAX_BRANCH = 8  # children per expanded node and expanded nodes per depth, at most


class Expansion(NamedTuple):
    """One drafting call's top-c children per row: ids [R, c] (the root call: [c]), their draft log-probs,
    the rows' MTP output h' (the root call: the depth-1 parent rows [max(2, c), D]), the cache, and (the
    root call only) the trunk hidden paired with the certain token."""

    idx: jax.Array
    logp: jax.Array
    hidden: jax.Array
    cache: object
    h: jax.Array | None = None


@jit_factory
def _tree_mtp_fns(graph: Graph) -> dict:
    """Jitted MTP tree-drafting calls of one head graph (`compiled.jit_factory`): root, level."""
    merge = graph.merge

    def top(mtp, hp, c, rows, vocab):
        # vocab (a `draft_vocab.DraftVocab`): the head over its N ids only, log-probs under its softmax,
        # ranks mapped back to token ids (ascending ids: the lowest id still wins a tie, as the chain's)
        logits = mtp.logits(hp, rows) if vocab is None else vocab.logits_rows(hp, rows)
        _, idx = jax.lax.top_k(logits, c)  # idx[:, 0] is the argmax (lowest index on ties), as the chain's
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits), idx, axis=1)
        if vocab is not None:
            idx = vocab.ids[idx]
        return idx.astype(jnp.int32), lp

    def root(params, cache, tokens, h_prev, hidden, start, n_valid, c, live=True, vocab=None):
        # live False (a stopped sequence of a batch, `runtime.batch`): every row is padding (no product
        # row, no expert read); the results are discarded.
        mtp = merge(params)
        live = jnp.asarray(live, jnp.int32)
        hs = jnp.concatenate([h_prev[None], hidden])[:tokens.shape[0]]
        hp, cache = mtp(tokens, hs, start, n_valid * live, cache)
        last = n_valid - 1  # the certain token's row
        h = jax.lax.dynamic_index_in_dim(hp, last, keepdims=False)
        idx, lp = top(mtp, jnp.stack([h, h]), c, live, vocab)  # a 2-row bucket (row 1 padding): row-stable
        h_t = jax.lax.dynamic_index_in_dim(hs, last, keepdims=False)
        rows = jnp.broadcast_to(h, (max(2, c), h.shape[0]))  # the parent rows of depth 1 (level calls)
        return Expansion(idx[0], lp[0], rows, cache, h_t)

    def level(params, cache, tokens, prev_hp, pidx, base, n_valid, depth, slots, anc, c, vocab=None):
        mtp = merge(params)
        tree = TreeRows(depth, jnp.full_like(depth, -1), slots, anc)
        hp, cache = mtp(tokens, prev_hp[pidx], base, n_valid, cache, tree)
        idx, lp = top(mtp, hp, c, n_valid, vocab)
        return Expansion(idx, lp, hp, cache)

    return dict(root=(root, dict(donate_argnums=(1,), static_argnums=(7,))),
                level=(level, dict(donate_argnums=(1,), static_argnums=(10,))))


@dataclasses.dataclass
class DraftTree:
    """A drafted tree in row order: tokens [n] (row 0 = the certain token), parent [n] (-1 for row 0),
    depth [n], score [n] (cumulative draft log-prob, summed in float32), chain [n] (on the greedy chain)."""

    tokens: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    score: np.ndarray
    chain: np.ndarray

    @property
    def n(self) -> int:
        return len(self.tokens)


def branching(draft_tokens: int, tree_nodes: int) -> int:
    """c = w of the drafting rule: min(MAX_BRANCH, tree_nodes - draft_tokens + 1)."""
    return max(1, min(MAX_BRANCH, tree_nodes - draft_tokens + 1))


class TreeDrafter:
    """Drafts trees of up to `tree_nodes` nodes and depth `draft_tokens` with one loaded MTP head; vocab (a
    `draft_vocab.DraftVocab`, optional): every drafting call's head over its ids only (the chain's
    draft_vocab: the candidates, their log-probs and so the tree change; verification does not)."""

    def __init__(self, mtp: MTPRuntime, draft_tokens: int, tree_nodes: int, vocab: DraftVocab | None = None):
        self.mtp, self.k, self.n_nodes, self.vocab = mtp, int(draft_tokens), int(tree_nodes), vocab
        self.c = branching(self.k, self.n_nodes)
        if vocab is not None and vocab.size < self.c:
            raise InputError(f"draft_vocab={vocab.size} is below the tree's {self.c} children per node "
                             f"(min(8, tree_nodes - depth + 1)); give at least {self.c} ids")
        self.rows = max(2, self.c)  # MTP rows per level call (>= 2: the row-stable kernel)
        fns = _tree_mtp_fns(mtp.graph)
        self.root, self.level = fns.root, fns.level  # the jitted calls (the device loop nests them)

    def draft(self, cache, tokens: np.ndarray, h_prev, hidden, start: int, n_valid: int, depth: int,
              n_nodes: int) -> Draft:
        """KV catch-up rows 0..n_valid-2 and the certain token at row n_valid-1 (MTP positions start..,
        as `MTPRuntime.draft`), then a tree of at most n_nodes drafts and depth `depth` (0: the root only).
        Returns `Draft(the DraftTree, cache, the h paired with the certain token)`."""
        idx, lp, root_h, cache, h_t = self.root(self.mtp.params, cache, np.asarray(tokens, np.int32), h_prev,
                                                 hidden, np.int32(start), np.int32(n_valid), self.c, True,
                                                 self.vocab)
        R = start + n_valid - 1  # the certain token's MTP position
        # candidate nodes: (token, parent node, depth, score, chain, MTP slot when expanded)
        tok, par, dep, score, chain = [int(tokens[n_valid - 1])], [-1], [0], [0.0], [True]
        slot = {0: None}
        if depth >= 1 and n_nodes >= 1:
            idx, lp = np.asarray(idx), np.asarray(lp)
            for j in range(self.c):
                tok.append(int(idx[j])), par.append(0), dep.append(1), score.append(float(lp[j]))
                chain.append(j == 0)
        prev_hp, prev_row = root_h, {0: 0}  # expanded node -> its row in prev_hp
        W = max(1, self.k)
        base = R + 1
        S = int(cache.end_position())  # where the MTP cache's slots end, as a position
        for d in range(1, depth):
            level = [i for i in range(len(tok)) if dep[i] == d]
            others = sorted((i for i in level if not chain[i]), key=lambda i: -score[i])
            first = R + 1 + (d - 1) * self.rows
            n_beam = min(self.c, S - first)
            if n_beam < 1:
                break
            beam = ([i for i in level if chain[i]] + others)[:n_beam]
            B = self.rows
            btok = np.zeros(B, np.int32)
            pidx = np.zeros(B, np.int32)
            bdepth = np.zeros(B, np.int32)
            slots = np.full(B, S, np.int32)
            anc = np.tile(base + np.arange(W, dtype=np.int32), (B, 1))
            for b, i in enumerate(beam):
                btok[b], pidx[b], bdepth[b] = tok[i], prev_row[par[i]], d - 1
                slots[b] = first + b
                slot[i] = first + b
                path, j = [], i
                while par[j] != -1:
                    path.append(slot[j])
                    j = par[j]
                anc[b, :d] = path[::-1]
            idx, lp, prev_hp, cache, _ = self.level(self.mtp.params, cache, btok, prev_hp, pidx, np.int32(base),
                                                    np.int32(len(beam)), bdepth, slots, np.minimum(anc, S - 1), self.c,
                                                    self.vocab)
            idx, lp = np.asarray(idx), np.asarray(lp)
            prev_row = {i: b for b, i in enumerate(beam)}
            for b, i in enumerate(beam):
                for j in range(self.c):
                    tok.append(int(idx[b, j])), par.append(i), dep.append(d + 1)
                    score.append(float(np.float32(score[i]) + lp[b, j]))  # float32 sums, as `tree_device`
                    chain.append(chain[i] and j == 0)
        return Draft(self._select(tok, par, dep, score, chain, n_nodes), cache, h_t)

    @staticmethod
    def _select(tok, par, dep, score, chain, n_nodes: int) -> DraftTree:
        """The chain nodes, then the best others by (score desc, depth asc), n_nodes drafts at most;
        rows in depth order."""
        cands = range(1, len(tok))
        keep = [i for i in cands if chain[i]][:n_nodes]
        others = sorted((i for i in cands if not chain[i]), key=lambda i: (-score[i], dep[i], i))
        keep += others[:max(0, n_nodes - len(keep))]
        rows = [0] + sorted(keep, key=lambda i: (dep[i], -score[i], i))
        row_of = {i: r for r, i in enumerate(rows)}
        assert all(par[i] in row_of for i in rows[1:]), "tree not closed under ancestors"
        return DraftTree(tokens=np.array([tok[i] for i in rows], np.int32),
                         parent=np.array([row_of[par[i]] if par[i] >= 0 else -1 for i in rows], np.int32),
                         depth=np.array([dep[i] for i in rows], np.int32),
                         score=np.array([score[i] for i in rows], np.float64),
                         chain=np.array([chain[i] for i in rows], bool))
