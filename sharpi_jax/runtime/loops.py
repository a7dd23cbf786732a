"""The six generation loops (MTP off, the MTP chain, the MTP tree; each on the device or the host) behind
one signature: `run(runtime, mtp, ids, opts, stop_ids, kv, vocab, resume)`, the loop chosen by `GenerateOptions`
(validated there; nothing is checked again here)."""

from __future__ import annotations

from typing import Callable, Collection, Sequence

from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime.device_loop import generate_ids_device, generate_mtp_device, generate_tree_device
from sharpi_jax.runtime.draft_vocab import DraftVocab
from sharpi_jax.runtime.generate import Generation, generate_ids
from sharpi_jax.runtime.options import GenerateOptions
from sharpi_jax.runtime.mtp import MTPRuntime
from sharpi_jax.runtime.session import Resume
from sharpi_jax.runtime.speculative import generate_mtp
from sharpi_jax.runtime.steps import Runtime
from sharpi_jax.runtime.tree import generate_tree

Loop = Callable[[Runtime, "MTPRuntime | None", Sequence[int], GenerateOptions, Collection[int], "SnapKV | None",
                 "DraftVocab | None", "Resume | None"], Generation]

# (speculative, device loop) -> the loop, every one called as loop(rt, mtp, ids, o, stop, kv, vocab, resume).
LOOPS: dict[tuple[str | None, bool], Loop] = {
    (None, True): lambda rt, mtp, ids, o, stop, kv, vocab, resume: generate_ids_device(
        rt, ids, o.max_new_tokens, o.sampling, stop, kv, resume),
    (None, False): lambda rt, mtp, ids, o, stop, kv, vocab, resume: generate_ids(
        rt, ids, o.max_new_tokens, o.sampling, stop, kv, resume),
    ("mtp", True): lambda rt, mtp, ids, o, stop, kv, vocab, resume: generate_mtp_device(
        rt, mtp, ids, o.max_new_tokens, o.sampling, stop, o.draft_tokens, kv=kv, vocab=vocab, p_min=o.p_min,
        resume=resume),
    ("mtp", False): lambda rt, mtp, ids, o, stop, kv, vocab, resume: generate_mtp(
        rt, mtp, ids, o.max_new_tokens, o.sampling, stop, o.draft_tokens, o.verify, kv=kv, vocab=vocab,
        p_min=o.p_min, resume=resume),
    ("mtp_tree", True): lambda rt, mtp, ids, o, stop, kv, vocab, resume: generate_tree_device(
        rt, mtp, ids, o.max_new_tokens, o.sampling, stop, o.draft_tokens, o.nodes,
        max_snapshot_bytes=o.max_snapshot_bytes, kv=kv, resume=resume),
    ("mtp_tree", False): lambda rt, mtp, ids, o, stop, kv, vocab, resume: generate_tree(
        rt, mtp, ids, o.max_new_tokens, o.sampling, stop, o.draft_tokens, o.nodes, o.verify,
        max_snapshot_bytes=o.max_snapshot_bytes, kv=kv, resume=resume),
}


def run(runtime: Runtime, mtp: MTPRuntime | None, ids: Sequence[int], opts: GenerateOptions,
        stop_ids: Collection[int] = (), kv: SnapKV | None = None, vocab: DraftVocab | None = None,
        resume: Resume | None = None) -> Generation:
    """Generate after ids with the loop `opts` selects (`opts.speculative`, `opts.device_loop`); mtp: the
    MTP head's runtime (None for MTP off), kv: SnapKV eviction, vocab: the draft vocabulary (chain),
    resume: a session's continued prefill (`session.Resume`)."""
    return LOOPS[(opts.speculative, opts.device_loop)](runtime, mtp, ids, opts, stop_ids, kv, vocab, resume)
