"""The tree pass's host-side logic as traced functions, for the device loop: drafting (`draft_tree`, the
rule of `tree_draft.TreeDrafter` with static shapes), the trunk's tree arrays (`tree_arrays`, as
`model.tree.tree_arrays`) and the acceptance walk (`accept_path`, as `tree.TreeDecoder._accept`).

Candidates sit at fixed slots: 0 the root, 1..c depth 1, then per expanded level d = 1..K-1 a block of
c * c children (beam row b, rank j at b * c + j); `valid` marks the ones the host drafter would have
created. Orders are stable sorts on the host's keys, scores are float32 sums as on the host, so the
drafted tree (tokens, parents, depths, row order) is the host drafter's exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class DeviceTree(NamedTuple):
    """A tree drafted on the device: tokens [N + 1], parent rows [N + 1] (-1: none), depths [N + 1], rows
    valid n, the MTP cache, the trunk hidden paired with the certain token."""

    tokens: jax.Array
    parent: jax.Array
    depth: jax.Array
    n: jax.Array
    cache: object
    h: jax.Array


def _neg(score):
    """-score with -0.0 made +0.0 (Python's sort treats them as equal)."""
    return -score + jnp.float32(0.0)


def _last(flag):
    """A sort key putting the rows where flag is set first."""
    return (~flag).astype(jnp.int32)


def draft_tree(root, level, params, cache, tokens, h_prev, hidden, start, n_valid, depth, n_nodes, *,
               K: int, N: int, c: int, S, live=True, vocab=None):
    """One tree draft (root call with the MTP catch-up, then up to K - 1 level calls), `TreeDrafter.draft`
    on device. root / level: the jitted calls of `tree_draft._tree_mtp_fns`; N: the most drafts a pass
    holds; S: where the MTP cache's slots end, as a position (its length + shift); live False: a stopped
    sequence of a batch, whose root rows are padding and whose tree is the root alone (no level call
    computes a row); vocab: the draft vocabulary (`draft_vocab.DraftVocab`), None: the full head. Returns a
    `DeviceTree`."""
    B = max(2, c)
    W = max(1, K)
    Nc = 1 + c + (K - 1) * c * c
    idx, lp, prev_hp, cache, h_t = root(params, cache, tokens, h_prev, hidden, start, n_valid, c, live, vocab)
    depth, n_nodes = depth * live, n_nodes * live
    cand = jnp.arange(Nc, dtype=jnp.int32)
    j_of = jnp.arange(c, dtype=jnp.int32)
    has1 = (depth >= 1) & (n_nodes >= 1)
    tok = jnp.zeros((Nc,), jnp.int32).at[0].set(tokens[n_valid - 1]).at[1:1 + c].set(idx)
    par = jnp.full((Nc,), -1, jnp.int32).at[1:1 + c].set(0)
    dep = jnp.zeros((Nc,), jnp.int32).at[1:1 + c].set(1)
    score = jnp.zeros((Nc,), jnp.float32).at[1:1 + c].set(lp)
    chain = jnp.zeros((Nc,), bool).at[0].set(True).at[1:1 + c].set(j_of == 0)
    valid = jnp.zeros((Nc,), bool).at[0].set(True).at[1:1 + c].set(has1)
    slot = jnp.full((Nc,), S, jnp.int32)
    hrow = jnp.zeros((Nc,), jnp.int32)  # an expanded node's row in the previous level's output
    R = start + n_valid - 1  # the certain token's MTP position
    base = R + 1
    active = has1
    rows_b = jnp.arange(B, dtype=jnp.int32)
    cols = jnp.arange(W, dtype=jnp.int32)
    for d in range(1, K):
        lo = 1 if d == 1 else 1 + c + (d - 2) * c * c
        size = c if d == 1 else c * c
        first = R + 1 + (d - 1) * B
        n_beam = jnp.minimum(c, S - first)
        active = active & (d < depth) & (n_beam >= 1)
        v, ch, sc = valid[lo:lo + size], chain[lo:lo + size], score[lo:lo + size]
        order = jnp.lexsort((jnp.arange(size), _neg(sc), _last(ch), _last(v)))  # chain first, then by score, stable
        nb = jnp.where(active, jnp.minimum(n_beam, jnp.sum(v, dtype=jnp.int32)), 0)
        sel = jnp.concatenate([lo + order[:c].astype(jnp.int32), jnp.zeros((B - c,), jnp.int32)])
        bvalid = rows_b < nb
        btok = jnp.where(bvalid, tok[sel], 0)
        pidx = jnp.where(bvalid, hrow[par[sel]], 0)
        bdepth = jnp.where(bvalid, d - 1, 0)
        slots = jnp.where(bvalid, first + rows_b, S)
        scatter = jnp.where(bvalid, sel, Nc)
        slot = slot.at[scatter].set(first + rows_b, mode="drop")
        hrow = hrow.at[scatter].set(rows_b, mode="drop")
        anc = _ancestor_slots(jnp.broadcast_to(base + cols, (B, W)), d, sel, bvalid, slot, par, S)

        def run(cache, prev_hp, btok=btok, pidx=pidx, bdepth=bdepth, slots=slots, anc=anc, nb=nb):
            return level(params, cache, btok, prev_hp, pidx, base, nb, bdepth, slots, anc, c, vocab)

        def skip(cache, prev_hp):
            return (jnp.zeros((B, c), jnp.int32), jnp.zeros((B, c), jnp.float32), prev_hp, cache)

        idx, lp, hp, cache = jax.lax.cond(active, lambda *a: tuple(run(*a))[:4], skip, cache, prev_hp)
        prev_hp = hp
        tok, par, dep, score, chain, valid = _add_children((tok, par, dep, score, chain, valid), d, c, j_of, idx,
                                                           lp, sel, bvalid)

    tree_tok, tree_par, tree_dep, n_rows = _select(cand, tok, par, dep, score, chain, valid, n_nodes, N)
    return DeviceTree(tree_tok, tree_par, tree_dep, n_rows, cache, h_t)


def _ancestor_slots(anc, d: int, sel, bvalid, slot, par, S):
    """The beam rows' ancestor MTP slots [B, W]: column e holds the slot of the path's node at depth
    e + 1 (d down to 1), for valid rows; the rest keep `anc`'s; clipped to the cache (S - 1)."""
    node = sel
    for e in range(d - 1, -1, -1):
        anc = anc.at[:, e].set(jnp.where(bvalid, slot[node], anc[:, e]))
        node = par[node]
    return jnp.minimum(anc, S - 1)


def _add_children(nodes: tuple, d: int, c: int, j_of, idx, lp, sel, bvalid) -> tuple:
    """The c x c candidates a level call drafted (the top c of each of the c beam nodes), written into the
    node arrays (tok, par, dep, score, chain, valid) at their block: score adds the log-probability to
    the parent's, a chain node is the first child of a chain node."""
    tok, par, dep, score, chain, valid = nodes
    off = 1 + c + (d - 1) * c * c
    blk = slice(off, off + c * c)
    tok = tok.at[blk].set(idx[:c].reshape(-1))
    par = par.at[blk].set(jnp.repeat(sel[:c], c))
    dep = dep.at[blk].set(d + 1)
    score = score.at[blk].set(jnp.repeat(score[sel[:c]], c) + lp[:c].reshape(-1))
    chain = chain.at[blk].set(jnp.repeat(chain[sel[:c]], c) & jnp.tile(j_of == 0, c))
    valid = valid.at[blk].set(jnp.repeat(bvalid[:c], c))
    return tok, par, dep, score, chain, valid


def _select(cand, tok, par, dep, score, chain, valid, n_nodes, N: int):
    """Selection (`TreeDrafter._select`): every chain node, then the best others by (score, depth,
    index), at most n_nodes -> the tree's (tokens, parents, depths) [1 + N] with the root as row 0, and
    its rows in use. cand: the candidates' indices 0..Nc-1."""
    Nc = tok.shape[0]
    real = valid & (cand > 0)
    is_chain = real & chain
    others = real & ~chain
    rank = jnp.zeros((Nc,), jnp.int32).at[jnp.lexsort((cand, dep, _neg(score), _last(others)))].set(cand)
    kept = is_chain | (others & (rank < n_nodes - jnp.sum(is_chain, dtype=jnp.int32)))
    n_kept = jnp.sum(kept, dtype=jnp.int32)
    order = jnp.lexsort((cand, _neg(score), dep, _last(kept)))[:N].astype(jnp.int32)  # rows 1..n_kept
    r = jnp.arange(N, dtype=jnp.int32)
    inside = r < n_kept
    row_of = jnp.zeros((Nc,), jnp.int32).at[jnp.where(inside, order, Nc)].set(1 + r, mode="drop")
    tree_tok = jnp.concatenate([tok[:1], jnp.where(inside, tok[order], 0)])
    tree_par = jnp.concatenate([jnp.full((1,), -1, jnp.int32), jnp.where(inside, row_of[par[order]], -1)])
    tree_dep = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.where(inside, dep[order], 0)])
    return tree_tok, tree_par, tree_dep, 1 + n_kept


def tree_arrays(parent, n_valid):
    """(depth [T], parent [T], anc [T, T]) int32 of `model.tree.tree_arrays` for a valid tree (rows past
    n_valid: padding roots), traced."""
    T = parent.shape[0]
    col = jnp.arange(T, dtype=jnp.int32)
    depth = jnp.zeros((T,), jnp.int32)
    par = jnp.full((T,), -1, jnp.int32)
    anc = jnp.broadcast_to(col, (T, T)).at[:, 0].set(0)

    def row(i, carry):
        depth, par, anc = carry
        p = jnp.maximum(parent[i], 0)
        d = depth[p] + 1
        new = jnp.where(col < d, anc[p], col).at[d].set(i)
        ok = i < n_valid
        return (depth.at[i].set(jnp.where(ok, d, 0)), par.at[i].set(jnp.where(ok, p, -1)),
                anc.at[i].set(jnp.where(ok, new, anc[i])))

    return jax.lax.fori_loop(1, T, row, (depth, par, anc))


def child_holding(tokens, parent, n, r, token):
    """(whether a valid node whose parent is row r holds token, the first such node's row)."""
    m = (jnp.arange(tokens.shape[0], dtype=jnp.int32) < n) & (parent == r) & (tokens == token)
    return jnp.any(m), jnp.argmax(m).astype(jnp.int32)


def accept_path(tokens, parent, n, target, K: int):
    """The longest root path whose every node holds the target's token at its parent (`TreeDecoder._accept`).
    Returns (path [T] node rows, root first, zero-padded; accepted a = len(path) - 1; its last node)."""
    T = tokens.shape[0]
    path = jnp.zeros((T,), jnp.int32)
    cur, a, alive = jnp.int32(0), jnp.int32(0), jnp.bool_(True)
    for step in range(min(K, T - 1)):
        found, nxt = child_holding(tokens, parent, n, cur, target[cur])
        found = alive & found
        path = path.at[step + 1].set(jnp.where(found, nxt, 0))
        cur = jnp.where(found, nxt, cur)
        a = a + found.astype(jnp.int32)
        alive = found
    return path, a, cur
