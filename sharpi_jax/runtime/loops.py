"""The six generation loops (MTP off, the MTP chain, the MTP tree; each on the device or the host) behind
one signature: `run(runtime, mtp, ids, opts, stop_ids, kv, vocab, resume)`, the loop chosen by `GenerateOptions`
(validated there; nothing is checked again here)."""

from __future__ import annotations

from typing import Collection, Sequence

from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime.device_loop import generate_ids_device, generate_mtp_device, generate_tree_device
from sharpi_jax.runtime.draft_vocab import DraftVocab
from sharpi_jax.runtime.generate import Generation, generate_ids
from sharpi_jax.runtime.options import Chain, GenerateOptions, drafter_p_min
from sharpi_jax.runtime.mtp import MTPRuntime
from sharpi_jax.runtime.session import Resume
from sharpi_jax.runtime.speculative import generate_mtp
from sharpi_jax.runtime.steps import Runtime
from sharpi_jax.runtime.tree import generate_tree

def run(runtime: Runtime, mtp: MTPRuntime | None, ids: Sequence[int], opts: GenerateOptions,
        stop_ids: Collection[int] = (), kv: SnapKV | None = None, vocab: DraftVocab | None = None,
        resume: Resume | None = None) -> Generation:
    """Generate after ids with the loop `opts` selects (`opts.speculative`, `opts.device_loop`); mtp: the
    MTP head's runtime (None for MTP off), kv: SnapKV eviction, vocab: the draft vocabulary (chain),
    resume: a session's continued prefill (`session.Resume`)."""
    o, spec, device = opts, opts.speculation, opts.device_loop
    if spec is None:
        loop = generate_ids_device if device else generate_ids
        return loop(runtime, ids, o.max_new_tokens, o.sampling, stop_ids, kv, resume)
    if isinstance(spec, Chain):
        if device:
            return generate_mtp_device(runtime, mtp, ids, o.max_new_tokens, o.sampling, stop_ids, spec.k, kv=kv,
                                       vocab=vocab, p_min=drafter_p_min(o), resume=resume)
        return generate_mtp(runtime, mtp, ids, o.max_new_tokens, o.sampling, stop_ids, spec.k, o.verify, kv=kv,
                            vocab=vocab, p_min=drafter_p_min(o), resume=resume)
    if device:
        return generate_tree_device(runtime, mtp, ids, o.max_new_tokens, o.sampling, stop_ids, spec.depth, spec.nodes,
                                    max_snapshot_bytes=spec.max_snapshot_bytes, kv=kv, resume=resume)
    return generate_tree(runtime, mtp, ids, o.max_new_tokens, o.sampling, stop_ids, spec.depth, spec.nodes, o.verify,
                         max_snapshot_bytes=spec.max_snapshot_bytes, kv=kv, resume=resume)
