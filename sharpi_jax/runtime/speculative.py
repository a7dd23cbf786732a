"""MTP speculative decoding with a chain of drafts (draft, verify, accept, roll back): `MTPDecoder`, the
chain's drafter and verifier on the shared pass skeleton (`decoder.Decoder`): chain drafts from the MTP
head, ONE trunk pass over [t, d1..dk], greedy / exact-match acceptance, rollback by GDN snapshot. Its
host and device loops: `strategies.chain`.

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

The MTP sequence convention (and llama.cpp's, `zero_h_first`): `runtime.mtp`.

Shapes: drafts are computed into a fixed number of slots K (`width`, default k), the verify step has
K + 1 rows and the fused MTP call K + 2 rows, so each compiles once per K; shorter drafts (context
end, llama.cpp's budget cap) use the same compiled functions with fewer valid rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime.decoder import Decoder, Verdict, argmax_rows, stack_rows
from sharpi_jax.runtime.draft_vocab import DraftVocab
from sharpi_jax.runtime.mtp import Draft, MTPRuntime
from sharpi_jax.runtime.sampling import sample
from sharpi_jax.runtime.state import gdn_caches, with_gdn
from sharpi_jax.runtime.steps import Runtime


class MTPDecoder(Decoder):
    """The chain pass on the decoder skeleton (see the module docstring): drafts [t, d1..dn] from
    `MTPRuntime.draft`, n <= K = width (default draft_tokens) slots.

    `trace` (a list, optional) receives one dict per pass: tokens [m+1], logits [m+1, V], hidden
    [m+1, D], conv/ssm (per GDN layer, the state after each of the m+1 rows), accepted. With
    full_rows (sequential only) all m+1 rows are computed even past the first mismatch, and the GDN
    state is restored from the copy kept after row a: the batched-vs-sequential parity reference.
    """

    def __init__(self, runtime: Runtime, mtp: MTPRuntime, draft_tokens: int, verify: str = "batched",
                 width: int | None = None, full_rows: bool = False, trace: list | None = None,
                 zero_h_first: bool = False, kv: SnapKV | None = None, kv_capacity: int | None = None,
                 mtp_kv: str = "snapkv", vocab: DraftVocab | None = None, p_min: float | None = None):
        """kv, kv_capacity, mtp_kv: SnapKV eviction (`decoder.Decoder`); vocab: draft over these token ids
        only (`draft_vocab`; verification uses the full head); p_min: stop a pass's chain before the first
        draft the head gives a probability below p_min (`MTPRuntime.draft`)."""
        super().__init__(runtime, mtp, draft_tokens, verify, trace, zero_h_first, kv, kv_capacity, mtp_kv)
        self.K = int(width) if width is not None else self.k
        assert 1 <= self.k <= self.K, (self.k, self.K)  # draft_tokens >= 1: `options.GenerateOptions`
        self.nodes, self.max_nodes = self.k, self.K  # a chain: one node per draft
        self.full_rows, self.vocab, self.p_min = full_rows, vocab, p_min

    def _draft(self, tokens, start, n_valid, depth, n_nodes) -> Draft:
        draft = self.mtp.draft(self.cache, tokens, self.h_prev, self._hidden, start, n_valid, max(depth, 1),
                               self.vocab, self.p_min)
        draft.drafts.block_until_ready()
        return draft

    def _apply_commit(self, state, commit):
        return self.rt.commit(state, *commit)

    @staticmethod
    def _accept(target, drafts: np.ndarray, n_draft: int) -> tuple[list[int], int]:
        """Exact-match acceptance: the target's token of row r against d_{r+1}, while they match."""
        accepted = []
        for r in range(n_draft + 1):
            tok = target(r, r)
            if r < n_draft and tok == int(drafts[r]):
                accepted.append(tok)
                continue
            return accepted, tok
        raise AssertionError("unreachable")

    def _verify_batched(self, vtokens, n_draft, sampling, index):
        snaps, a = self._commit if self._commit is not None else (None, 0)
        v = self.rt.commit_verify(self.state, snaps, a, vtokens, self.P, n_draft + 1)
        target = self.target(lambda r: v.logits[r], np.asarray(v.greedy) if sampling.greedy else None, sampling,
                             index)
        host = np.asarray(vtokens)
        accepted, nxt = self._accept(target, host[1:], n_draft)
        if self.trace is not None:
            m = n_draft + 1
            gdn = gdn_caches(v.snaps)
            self.trace.append(dict(tokens=host[:m], logits=np.asarray(v.logits)[:m], hidden=np.asarray(v.hidden)[:m],
                                   conv=tuple(np.asarray(g.conv)[:m] for g in gdn),
                                   ssm=tuple(np.asarray(g.ssm)[:m] for g in gdn), accepted=len(accepted)))
        self.state, self._commit = v.state, (v.snaps, len(accepted))  # rollback: snapshot a, next pass
        return Verdict(accepted, nxt, v.hidden, n_draft, n_draft)

    def _verify_sequential(self, vtokens, n_draft, sampling, index):
        """Row by row with single-token decode steps; stops after the first mismatch unless full_rows."""
        rt, state, vtokens = self.rt, self.committed_state(), np.asarray(vtokens)
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
                tok = int(argmax_rows(lg)) if greedy else int(sample(lg, sampling, index + r + 1))
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
        return Verdict(accepted, nxt, stack_rows(tuple(hidden_rows[:a + 1]), self.K + 1), n_draft, n_draft)
