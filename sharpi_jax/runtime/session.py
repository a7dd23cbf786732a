"""Sessions: a conversation's prefilled state kept between generate calls, so a turn prefills only the
tokens the state has not seen, up to one prefill bucket more (`Engine.session`, `Engine.generate(...,
session=...)`).

A `Prefix` is what a session keeps after a turn: the first S ids of the conversation, the trunk state
after them and, for a model with an MTP head, the head's KV and the trunk hidden of ids[S - 1] (the pair
of the next id's MTP row). The next turn's conversation (the previous ids, the reply, the new prompt) is
checked against the prefix id for id; where it extends it, `Resume.prefill` prefills only the rest,
from the kept state at positions S.., else the whole conversation (`Resume.reused` says which).

Bit parity with a fresh generate over the whole conversation. A prefill's bits depend on how its rows
are cut into buckets (the chunked GDN form and the attention blocks run per bucket), not only on the
rows. A prefill of N ids cuts full buckets of the largest size L from position 0 while more than L ids
remain (`steps.prefill_plan`), so every multiple of L below N is a bucket boundary of it, and what
follows a boundary S is cut as prefill_plan(N - S) alone. So the kept state is the one at S = the last
multiple of L below the prefilled length, made by the same buckets a fresh prefill of any longer
conversation makes, and the rest is prefilled from S: the same computations, the same bits
(tests/runtime/test_session.py, conversations crossing bucket boundaries). A turn prefills the new
tokens plus at most L - 1 kept ones. The reply tokens are not kept from the decode loop's state either
(decode steps run the recurrent GDN form, a prefill the chunked form), as a fresh generate would prefill
them. The loops donate the states they run on, so a prefix holds its own copies; a `fork` shares them
(they are never donated).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from sharpi_jax.runtime.state import DecodeState, MTPCache
from sharpi_jax.runtime.steps import Runtime


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


class Prefix(NamedTuple):
    """ids: the first S ids of the conversation (S a multiple of the largest prefill bucket), prefilled
    into `state`; mtp_cache / h_last: the MTP head's KV over them and the trunk hidden of ids[-1] (None
    without an MTP head)."""

    ids: tuple[int, ...]
    state: DecodeState
    mtp_cache: MTPCache | None
    h_last: jax.Array | None


class Resume:
    """One generate call's prefill, continued from a session's `Prefix` where the ids extend it; keeps the
    new prefix (`saved`) for the next turn. mtp: the MTP head's runtime (its KV is kept in step with the
    trunk's, so any turn may speculate), or None."""

    def __init__(self, prefix: Prefix | None, mtp=None):
        self.prefix, self.mtp = prefix, mtp
        self.reused = 0  # ids taken from the prefix (not prefilled again)
        self.saved: Prefix | None = prefix
        self._mtp_out = None

    def reusable(self, ids: Sequence[int]) -> int:
        """How many leading ids the prefix covers: all of its ids when `ids` extends them (by >= 1 id), else 0."""
        p = self.prefix
        if p is None or len(ids) <= len(p.ids) or tuple(ids[:len(p.ids)]) != p.ids:
            return 0
        return len(p.ids)

    def prefill(self, runtime: Runtime, ids: Sequence[int]):
        """The trunk prefill of `ids` (the whole conversation) from the prefix where it extends it, and the
        MTP head's KV with it; keeps the state at the last multiple of the largest bucket below len(ids).
        Returns (chunks of the prefilled rows, the last row's logits, the state)."""
        ids = [int(i) for i in ids]
        n0 = self.reusable(ids)
        self.reused = n0
        L = max(runtime.prefill_buckets)
        cut = n0 + L * ((len(ids) - n0 - 1) // L)  # the new prefix's end: a bucket boundary of any fresh prefill
        if n0:
            state = _copy(self.prefix.state)
            cache, h = (_copy(self.prefix.mtp_cache), self.prefix.h_last) if self.mtp is not None else (None, None)
        else:
            state = runtime.new_state()
            cache, h = (self.mtp.new_cache(), None) if self.mtp is not None else (None, None)
        chunks = []
        for a, b in ((n0, cut), (cut, len(ids))):
            if a == b:
                continue
            part, logits, state = runtime.prefill(state, ids[a:b], start=a)
            chunks += part
            if self.mtp is not None:
                if a == 0:  # from the start: the head's own pairing (no row for ids[0])
                    cache, h, _ = self.mtp.prefill(cache, ids[a:b], part)
                else:
                    cache, h, _ = self.mtp.prefill(cache, ids[a:b], part, start=a, h_before=h)
            if b == cut:
                self.saved = Prefix(tuple(ids[:cut]), _copy(state), None if cache is None else _copy(cache), h)
        self._mtp_out = (cache, h)
        return chunks, logits, state

    def mtp_prefill(self, zero_h_first: bool):
        """(the MTP KV over the conversation, h of its last id) made by `prefill` (for the decoder)."""
        if self._mtp_out is None or zero_h_first:
            raise ValueError("a session's MTP state is kept with the head's own convention (zero_h_first=False)")
        return self._mtp_out
