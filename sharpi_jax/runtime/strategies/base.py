"""The protocol every speculation strategy implements: a host loop and a device loop behind one signature."""

from __future__ import annotations

import abc
from typing import Collection, Sequence

from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime.draft_vocab import DraftVocab
from sharpi_jax.runtime.generate import Generation
from sharpi_jax.runtime.mtp import MTPRuntime
from sharpi_jax.runtime.options import GenerateOptions
from sharpi_jax.runtime.session import Resume
from sharpi_jax.runtime.steps import Runtime


class Strategy(abc.ABC):
    """One speculation strategy (MTP off, the MTP chain, the MTP tree): its host loop (`host`, the
    sequential reference) and its device loop (`device`, one jitted program per run), which give the same
    tokens. Both take (runtime, mtp, ids, opts, stop_ids, kv, vocab, resume): mtp, the MTP head's runtime
    (None for MTP off); kv, SnapKV eviction; vocab, the chain's draft vocabulary; resume, a session's
    continued prefill (`session.Resume`). `opts` is validated (`options.GenerateOptions`)."""

    @abc.abstractmethod
    def host(self, runtime: Runtime, mtp: MTPRuntime | None, ids: Sequence[int], opts: GenerateOptions,
             stop_ids: Collection[int] = (), kv: SnapKV | None = None, vocab: DraftVocab | None = None,
             resume: Resume | None = None) -> Generation:
        """The host loop."""

    @abc.abstractmethod
    def device(self, runtime: Runtime, mtp: MTPRuntime | None, ids: Sequence[int], opts: GenerateOptions,
               stop_ids: Collection[int] = (), kv: SnapKV | None = None, vocab: DraftVocab | None = None,
               resume: Resume | None = None) -> Generation:
        """The device loop."""

    def run(self, runtime: Runtime, mtp: MTPRuntime | None, ids: Sequence[int], opts: GenerateOptions,
            stop_ids: Collection[int] = (), kv: SnapKV | None = None, vocab: DraftVocab | None = None,
            resume: Resume | None = None) -> Generation:
        """Generate after ids with the loop `opts.device_loop` selects."""
        loop = self.device if opts.device_loop else self.host
        return loop(runtime, mtp, ids, opts, stop_ids, kv, vocab, resume)
