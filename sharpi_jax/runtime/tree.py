"""Tree speculative decoding over the GDN/MoE hybrid: MTP-drafted trees, ONE trunk pass, per-node GDN state
(`TreeDecoder`: the tree's drafter and verifier on the shared pass skeleton, `decoder.Decoder`; its host
and device loops: `strategies.tree`).

One pass, from the certain token t at position P:
1. Draft (`tree_draft.TreeDrafter`): MTP KV catch-up along the previous pass's accepted path (paired
   with the TARGET's verified hiddens) + a tree of up to `tree_nodes` drafts and depth `draft_tokens`
   that always holds the greedy chain.
2. Verify ("batched"): one trunk pass over all nodes (`Runtime.tree_commit_verify`): node t at logical
   position P + depth[t], its K/V at slot P + t, attention over the context and its ancestors only,
   GDN recurrent form from its parent's snapshot, every node's snapshot kept, grouped experts over all
   nodes (each selected expert read once per pass). Every node's logits, hidden row and GDN snapshot
   are bitwise those of single-token decode steps along its root path. "sequential" (the reference):
   single-token decode steps along the accepted path only.
3. Accept the longest root path whose every node's token equals the target's token at its parent
   (greedy argmax, or the seeded sampler with the key of that generated-token index: exact-match, so
   sampled output equals non-speculative output). The target's token at the last accepted node is the
   next certain token.
4. Commit (applied at the start of the next trunk pass, same dispatch): GDN snapshot of the last
   accepted node; its path's K/V rows moved to P, P + 1, ...; host lengths P + a + 1. Nothing is
   re-decoded.

Memory: a pass keeps one GDN snapshot per node (`snapshot_bytes_per_node`); `max_snapshot_bytes` caps
tree_nodes so that the pass's snapshots fit.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.config import ModelConfig
from sharpi_jax.errors import InputError
from sharpi_jax.model.cache import cache_shapes
from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime.decoder import Decoder, Verdict, argmax_rows, stack_rows
from sharpi_jax.runtime.draft_vocab import DraftVocab
from sharpi_jax.runtime.mtp import Draft, MTPRuntime
from sharpi_jax.runtime.sampling import sample
from sharpi_jax.runtime.state import gdn_caches, move_kv_rows, select_snapshot
from sharpi_jax.runtime.steps import Runtime
from sharpi_jax.runtime.tree_draft import DraftTree, TreeDrafter


def snapshot_bytes_per_node(c: ModelConfig) -> int:
    """GDN conv + SSM state bytes of one tree node (all GDN layers): what a pass keeps per node."""
    shapes = [cache_shapes(c, i, 1) for i in range(c.n_layer) if c.is_recurrent(i)]
    return sum(s.size * s.dtype.itemsize for g in shapes for s in (g.conv, g.ssm))


def capped_tree_nodes(c: ModelConfig, tree_nodes: int, max_snapshot_bytes: int | None) -> int:
    """tree_nodes, lowered so that the pass's tree_nodes + 1 snapshots fit in max_snapshot_bytes."""
    if max_snapshot_bytes is None:
        return tree_nodes
    per = snapshot_bytes_per_node(c)
    return min(tree_nodes, int(max_snapshot_bytes) // per - 1) if per else tree_nodes


@jax.jit
def _take_rows(hidden, rows):
    return hidden[rows]


@functools.partial(jax.jit, donate_argnums=(0,))
def _commit(state, snaps, index, src, dst0, n):
    """A pending tree commit on its own (`Runtime.tree_commit_verify` fuses it into the next pass)."""
    return move_kv_rows(select_snapshot(state, snaps, index), src, dst0, n)


class TreeDecoder(Decoder):
    """The tree pass on the decoder skeleton (see the module docstring): trees of at most tree_nodes
    (after the memory cap) nodes and depth draft_tokens from a `TreeDrafter` (over `vocab`'s ids only when
    given: a draft vocabulary).

    `trace` (a list, optional) receives one dict per pass: tokens, parent, depth [n] of the tree, and
    for the rows computed (batched: all n nodes; sequential: the accepted path) rows [m] (node
    indices), logits [m, V], hidden [m, D], conv/ssm (per GDN layer, the state after each row), path
    (accepted node indices, root first), accepted, chain (the greedy-chain flags).
    """

    def __init__(self, runtime: Runtime, mtp: MTPRuntime, draft_tokens: int, tree_nodes: int,
                 verify: str = "batched", trace: list | None = None, max_snapshot_bytes: int | None = None,
                 kv: SnapKV | None = None, kv_capacity: int | None = None, vocab: DraftVocab | None = None):
        super().__init__(runtime, mtp, draft_tokens, verify, trace, kv=kv, kv_capacity=kv_capacity)
        k, n = self.k, int(tree_nodes)
        assert 1 <= k <= n, (k, n)  # checked in `options.GenerateOptions`
        capped = capped_tree_nodes(runtime.config, n, max_snapshot_bytes)
        if capped < k:
            raise InputError(f"max_snapshot_bytes={max_snapshot_bytes} holds {max(capped, 0) + 1} node snapshots "
                             f"of {snapshot_bytes_per_node(runtime.config)} bytes; depth {k} needs {k + 1}")
        self.K, self.nodes = k, capped
        self.n_nodes = self.max_nodes = capped  # n_nodes: the most drafts a pass holds, after the memory cap
        self.T = capped + 1  # trunk rows per pass (root + nodes)
        self.drafter = TreeDrafter(mtp, k, capped, vocab)

    def _draft(self, tokens, start, n_valid, depth, n_nodes) -> Draft:
        return self.drafter.draft(self.cache, tokens, self.h_prev, self._hidden, start, n_valid, depth, n_nodes)

    def _apply_commit(self, state, commit):
        snaps, node, prev, path, n_path = commit
        return _commit(state, snaps, np.int32(node), np.int32(prev) + path, np.int32(prev), np.int32(n_path))

    @staticmethod
    def _accept(tree: DraftTree, target) -> tuple[list[int], int]:
        """Walk from the root while a child holds the target's token. target(node, depth) -> int.
        Returns (accepted path of node indices, root first; the target's token at its last node)."""
        children: dict[int, dict[int, int]] = {}
        for i in range(1, tree.n):
            children.setdefault(int(tree.parent[i]), {})[int(tree.tokens[i])] = i
        path = [0]
        while True:
            tok = target(path[-1], int(tree.depth[path[-1]]))
            nxt = children.get(path[-1], {}).get(tok)
            if nxt is None:
                return path, tok
            path.append(nxt)

    @staticmethod
    def _size(tree: DraftTree) -> tuple[int, int]:
        """(draft nodes, depth) of a drafted tree."""
        return tree.n - 1, int(tree.depth.max())

    def _verify_batched(self, tree: DraftTree, depth, sampling, index):
        rt, T = self.rt, self.T
        tokens = np.zeros(T, np.int32)
        tokens[:tree.n] = tree.tokens
        parent = np.full(T, -1, np.int32)
        parent[:tree.n] = tree.parent
        if self._commit is None:
            snaps, node, prev, path, n_path = None, 0, 0, None, 0
        else:
            snaps, node, prev, path, n_path = self._commit
        v = rt.tree_commit_verify(self.state, snaps, node, prev, path, n_path, tokens, self.P, tree.n, parent)
        target = self.target(lambda r: v.logits[r], np.asarray(v.greedy) if sampling.greedy else None, sampling,
                             index)
        path, nxt = self._accept(tree, target)
        rows = np.zeros(T, np.int32)
        rows[:len(path)] = path
        if self.trace is not None:
            n, gdn = tree.n, gdn_caches(v.snaps)
            self.trace.append(dict(tokens=tree.tokens, parent=tree.parent, depth=tree.depth, chain=tree.chain,
                                   rows=np.arange(n), logits=np.asarray(v.logits)[:n],
                                   hidden=np.asarray(v.hidden)[:n], conv=tuple(np.asarray(g.conv)[:n] for g in gdn),
                                   ssm=tuple(np.asarray(g.ssm)[:n] for g in gdn), path=path, accepted=len(path) - 1))
        self.state, self._commit = v.state, (v.snaps, path[-1], self.P, rows, len(path))
        accepted = [int(tree.tokens[i]) for i in path[1:]]
        return Verdict(accepted, nxt, _take_rows(v.hidden, rows[:self.k + 1]), *self._size(tree))

    def _verify_sequential(self, tree: DraftTree, depth, sampling, index):
        """Single-token decode steps along the accepted path (the reference)."""
        rt = self.rt
        self.committed_state()
        out: dict[int, tuple] = {}

        def target(node, node_depth):  # decode the node (its parent was the last one decoded), then its target
            lg, h, self.state = rt.decode_step(self.state, int(tree.tokens[node]), self.P + node_depth)
            out[node] = (lg, h, jax.tree.map(jnp.copy, gdn_caches(self.state)) if self.trace is not None else None)
            return int(argmax_rows(lg)) if sampling.greedy else int(sample(lg, sampling, index + node_depth + 1))

        path, nxt = self._accept(tree, target)
        if self.trace is not None:
            gdn = [out[i][2] for i in path]
            per_layer = range(len(gdn[0]))
            self.trace.append(dict(tokens=tree.tokens, parent=tree.parent, depth=tree.depth, chain=tree.chain,
                                   rows=np.array(path), logits=np.stack([np.asarray(out[i][0]) for i in path]),
                                   hidden=np.stack([np.asarray(out[i][1]) for i in path]),
                                   conv=tuple(np.stack([np.asarray(g[j].conv) for g in gdn]) for j in per_layer),
                                   ssm=tuple(np.stack([np.asarray(g[j].ssm) for g in gdn]) for j in per_layer),
                                   path=path, accepted=len(path) - 1))
        accepted = [int(tree.tokens[i]) for i in path[1:]]
        return Verdict(accepted, nxt, stack_rows(tuple(out[i][1] for i in path), self.k + 1), *self._size(tree))
