"""Tree speculative decoding over the GDN/MoE hybrid: MTP-drafted trees, ONE trunk pass, per-node GDN state.

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
import time
from typing import Any, Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.config import ModelConfig
from sharpi_jax.errors import InputError
from sharpi_jax.model.cache import cache_shapes
from sharpi_jax.runtime.generate import Generation, timing_stats
from sharpi_jax.runtime.options import VERIFY_MODES
from sharpi_jax.runtime.sampling import SamplingParams, sample
from sharpi_jax.runtime.speculative import MTPRuntime, PassResult, _argmax_rows, _stack_rows, emit_passes
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


class TreeDecoder:
    """Trunk + MTP state of one sequence and the tree pass (see the module docstring).

    `trace` (a list, optional) receives one dict per pass: tokens, parent, depth [n] of the tree, and
    for the rows computed (batched: all n nodes; sequential: the accepted path) rows [m] (node
    indices), logits [m, V], hidden [m, D], conv/ssm (per GDN layer, the state after each row), path
    (accepted node indices, root first), accepted, chain (the greedy-chain flags).
    """

    def __init__(self, runtime: Runtime, mtp: MTPRuntime, draft_tokens: int, tree_nodes: int,
                 verify: str = "batched", trace: list | None = None, max_snapshot_bytes: int | None = None):
        k, n = int(draft_tokens), int(tree_nodes)
        assert verify in VERIFY_MODES and 1 <= k <= n, (verify, k, n)  # checked in `options.GenerateOptions`
        capped = capped_tree_nodes(runtime.config, n, max_snapshot_bytes)
        if capped < k:
            raise InputError(f"max_snapshot_bytes={max_snapshot_bytes} holds {max(capped, 0) + 1} node snapshots "
                             f"of {snapshot_bytes_per_node(runtime.config)} bytes; depth {k} needs {k + 1}")
        self.rt, self.mtp, self.k, self.n_nodes, self.verify = runtime, mtp, k, capped, verify
        self.T = capped + 1  # trunk rows per pass (root + nodes)
        self.drafter = TreeDrafter(mtp, k, capped)
        self.trace = trace
        self.draft_s = self.verify_s = 0.0

    def prefill(self, ids: Sequence[int]) -> jax.Array:
        """Trunk prefill + MTP KV over ids. Returns the last row's logits [V]."""
        rt = self.rt
        chunks, logits, state = rt.prefill(rt.new_state(), ids)
        cache, h_last, _ = self.mtp.prefill(self.mtp.new_cache(), ids, chunks)
        self.state, self.cache, self.P = state, cache, len(ids)
        self._commit = None  # batched: (snaps, node, P, path, n_path) of the last pass
        self._pend, self._pend_start, self.h_prev = [], self.P, h_last
        self._hidden = jnp.zeros((self.k + 1, rt.config.d_model), jnp.float32)
        jax.block_until_ready((logits, cache))
        return logits

    def step(self, t: int, depth: int, n_nodes: int, sampling: SamplingParams, index: int) -> PassResult:
        """One pass from the certain token t (generated-token index `index`) at position P with a tree
        of at most n_nodes drafts and depth `depth`. Returns `PassResult(accepted drafts, the target's next
        token, the tree's draft nodes, its depth)` and advances P by len(accepted) + 1."""
        P = self.P
        if not 0 <= depth <= min(self.k, n_nodes) or n_nodes > self.n_nodes or P + n_nodes >= self.rt.max_context:
            raise InputError(f"a tree pass at position {P} with {n_nodes} nodes of depth {depth} does not fit")
        t0 = time.perf_counter()
        toks = np.zeros(self.k + 2, np.int32)
        n_valid = len(self._pend) + 1
        toks[:n_valid] = self._pend + [t]
        tree, self.cache, h_t = self.drafter.draft(self.cache, toks, self.h_prev, self._hidden,
                                                   self._pend_start - 1, n_valid, depth, n_nodes)
        t1 = time.perf_counter()
        if self.verify == "batched":
            path, nxt, hidden = self._verify_batched(tree, sampling, index)
        else:
            path, nxt, hidden = self._verify_sequential(tree, sampling, index)
        self.draft_s += t1 - t0
        self.verify_s += time.perf_counter() - t1
        accepted = [int(tree.tokens[i]) for i in path[1:]]
        self._pend, self._pend_start, self.h_prev, self._hidden = [t] + accepted, P, h_t, hidden
        self.P = P + len(accepted) + 1
        return PassResult(accepted, nxt, tree.n - 1, int(tree.depth.max()))

    @staticmethod
    def _accept(tree: DraftTree, target) -> tuple[list[int], int]:
        """Walk from the root while a child holds the target's token. target(node) -> int.
        Returns (accepted path of node indices, root first; the target's token at its last node)."""
        children: dict[int, dict[int, int]] = {}
        for i in range(1, tree.n):
            children.setdefault(int(tree.parent[i]), {})[int(tree.tokens[i])] = i
        path = [0]
        while True:
            tok = target(path[-1])
            nxt = children.get(path[-1], {}).get(tok)
            if nxt is None:
                return path, tok
            path.append(nxt)

    def _target(self, logits_of, greedy_rows, tree, sampling, index):
        def target(node):
            if greedy_rows is not None:
                return int(greedy_rows[node])
            return int(sample(logits_of(node), sampling, index + int(tree.depth[node]) + 1))
        return target

    def committed_state(self):
        """The trunk state after the last accepted node (applies a pending batched commit)."""
        if self._commit is not None:
            snaps, node, prev, path, n_path = self._commit
            self.state = _commit(self.state, snaps, np.int32(node), np.int32(prev) + path, np.int32(prev),
                                 np.int32(n_path))
            self._commit = None
        return self.state

    def _verify_batched(self, tree: DraftTree, sampling, index):
        rt, T = self.rt, self.T
        tokens = np.zeros(T, np.int32)
        tokens[:tree.n] = tree.tokens
        parent = np.full(T, -1, np.int32)
        parent[:tree.n] = tree.parent
        if self._commit is None:
            snaps, node, prev, path, n_path = None, 0, 0, None, 0
        else:
            snaps, node, prev, path, n_path = self._commit
        logits, greedy, hidden, state, snaps = rt.tree_commit_verify(self.state, snaps, node, prev, path, n_path,
                                                                     tokens, self.P, tree.n, parent)
        target = self._target(lambda r: logits[r], np.asarray(greedy) if sampling.greedy else None, tree,
                              sampling, index)
        path, nxt = self._accept(tree, target)
        rows = np.zeros(T, np.int32)
        rows[:len(path)] = path
        if self.trace is not None:
            n, gdn = tree.n, gdn_caches(snaps)
            self.trace.append(dict(tokens=tree.tokens, parent=tree.parent, depth=tree.depth, chain=tree.chain,
                                   rows=np.arange(n), logits=np.asarray(logits)[:n], hidden=np.asarray(hidden)[:n],
                                   conv=tuple(np.asarray(g.conv)[:n] for g in gdn),
                                   ssm=tuple(np.asarray(g.ssm)[:n] for g in gdn), path=path, accepted=len(path) - 1))
        self.state, self._commit = state, (snaps, path[-1], self.P, rows, len(path))
        return path, nxt, _take_rows(hidden, rows[:self.k + 1])

    def _verify_sequential(self, tree: DraftTree, sampling, index):
        """Single-token decode steps along the accepted path (the reference)."""
        rt, state = self.rt, self.committed_state()
        out: dict[int, tuple] = {}

        def target(node):  # decode the node (its parent was the last one decoded), then its target token
            lg, h, self.state = rt.decode_step(self.state, int(tree.tokens[node]), self.P + int(tree.depth[node]))
            out[node] = (lg, h, jax.tree.map(jnp.copy, gdn_caches(self.state)) if self.trace is not None else None)
            if sampling.greedy:
                return int(_argmax_rows(lg))
            return int(sample(lg, sampling, index + int(tree.depth[node]) + 1))

        self.state = state
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
        return path, nxt, _stack_rows(tuple(out[i][1] for i in path), self.k + 1)


def tree_pass_stats(k: int, passes: list[tuple[int, int, int]]) -> dict[str, Any]:
    """Stats from (nodes verified, tree depth, accepted) per pass; drafted_nodes: the nodes verified, per pass."""
    drafted = sum(n for n, _, _ in passes)
    accepted = sum(a for _, _, a in passes)
    per_depth = []
    for i in range(1, k + 1):
        tried = [a for _, d, a in passes if d >= i]
        per_depth.append(sum(a >= i for a in tried) / len(tried) if tried else 0.0)
    return {
        "drafted": drafted,
        "drafted_nodes": [n for n, _, _ in passes],
        "accepted": accepted,
        "verify_passes": len(passes),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accept_len": (accepted + len(passes)) / len(passes) if passes else 0.0,
        "accept_per_depth": per_depth,
    }


def generate_tree(runtime: Runtime, mtp: MTPRuntime, prompt: Sequence[int], max_new_tokens: int,
                  sampling: SamplingParams, stop_ids: Collection[int] = (), draft_tokens: int = 3,
                  tree_nodes: int = 8, verify: str = "batched", trace: list | None = None,
                  max_snapshot_bytes: int | None = None) -> Generation:
    """Tree speculative generation; the tokens are those of `generate.generate_ids` with the same arguments.

    stats: those of `generate_ids` plus speculative ("mtp_tree"), draft_tokens (depth), tree_nodes
    (after the memory cap: the most a pass drafts), verify, drafted (draft nodes verified), drafted_nodes
    (the nodes each pass actually drafted and verified, a list), accepted, verify_passes,
    acceptance_rate (accepted / drafted), mean_accept_len (accepted + 1 per trunk pass),
    accept_per_depth (fraction of the passes whose tree reached depth i that accepted >= i tokens),
    snapshot_bytes_per_node, draft_s, verify_s.
    """
    t0 = time.perf_counter()
    dec = TreeDecoder(runtime, mtp, draft_tokens, tree_nodes, verify, trace, max_snapshot_bytes)
    logits = dec.prefill(prompt)
    t1 = time.perf_counter()
    passes: list[tuple[int, int, int]] = []

    def one_pass(out: list[int]) -> list[int]:
        n_nodes = min(dec.n_nodes, runtime.max_context - 1 - dec.P)
        depth = min(dec.k, n_nodes)
        r = dec.step(out[-1], depth, n_nodes, sampling, len(out) - 1)
        passes.append((r.nodes, r.depth, len(r.accepted)))
        return r.accepted + [r.next]

    first = [int(sample(logits, sampling, 0))] if max_new_tokens > 0 else []
    out, stop = emit_passes(first, max_new_tokens, stop_ids, runtime.max_context, lambda: dec.P, one_pass)
    t2 = time.perf_counter()
    stats = {
        **timing_stats(len(prompt), len(out), t0, t1, t2, stop),
        "speculative": "mtp_tree",
        "draft_tokens": dec.k,
        "tree_nodes": dec.n_nodes,
        "verify": verify,
        **tree_pass_stats(dec.k, passes),
        "snapshot_bytes_per_node": snapshot_bytes_per_node(runtime.config),
        "draft_s": dec.draft_s,
        "verify_s": dec.verify_s,
    }
    return Generation(out, stats)
