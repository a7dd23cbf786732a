"""What one generation reports: `GenerateStats`, `GenerateOutput.stats`.

The generation loops build a flat, string-keyed dict; `Engine.generate` / `generate_batch` turn it into
a `GenerateStats` once (`GenerateStats.from_dict`, which refuses a key no field holds, so a new stat
cannot be dropped silently). `to_dict()` gives the flat dict back, key for key and value for value:
the JSON records the experiments write keep their keys. Groups a run does not have are None (MTP off:
no `speculation`; no expert budget: no `experts`; ...). A group's field holds the flat key named in
its `key` metadata where the two names differ (`Speculation.mode` is the key "speculative").
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping


def _key(flat_key: str, default: Any = dataclasses.MISSING) -> Any:
    """A field stored under another flat key than its name."""
    return dataclasses.field(default=default, metadata={"key": flat_key})


@dataclasses.dataclass(frozen=True)
class Speed:
    """Sizes, timings and the stop of one run."""

    prompt_tokens: int  # the prompt's tokens (a session's: the whole conversation)
    generated_tokens: int  # tokens generated (a final end-of-generation token included)
    prefill_s: float  # prefill seconds (MTP: trunk and MTP head prompt processing)
    prefill_tok_s: float  # prompt_tokens / prefill_s (inf for a zero time)
    stop_reason: str  # "eos" | "max_new_tokens" | "max_context"
    loop: str  # the loop that ran: "device" (one jitted program) or "host" (one jitted call per step or pass)
    # Decode seconds after the prefill (sampling included), and generated_tokens / decode_s (0.0 when
    # nothing was generated). None from `generate_batch`, whose decode is shared: see `Batch`.
    decode_s: float | None = None
    decode_tok_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Speculation:
    """The MTP passes of a speculative run (a chain: mode "mtp"; a tree: mode "mtp_tree")."""

    mode: str = _key("speculative")  # "mtp" (the chain) or "mtp_tree" (the tree)
    draft_tokens: int  # the chain's length k, or the tree's depth
    verify: str  # "batched" (one trunk pass) or "sequential" (row by row, the host reference)
    drafted: int  # draft tokens (tree: draft nodes) verified, summed over passes
    accepted: int  # drafts accepted, summed over passes
    verify_passes: int  # trunk (verify) passes
    acceptance_rate: float  # accepted / drafted (0.0 without drafts)
    mean_accept_len: float  # mean over passes of accepted drafts + 1: tokens per trunk pass
    # Chain: k fractions, position i accepted over the passes that drafted it.
    accept_per_position: list[float] | None = None
    # Tree: per depth i, the fraction of the passes whose tree reached depth i that accepted >= i tokens.
    accept_per_depth: list[float] | None = None
    # Host loop only (one device program cannot split them): MTP drafting vs trunk verify seconds;
    # the rest of decode_s is host bookkeeping.
    draft_s: float | None = None
    verify_s: float | None = None
    # The draft vocabulary's size N (None: the full vocabulary; chain and tree) and the chain's adaptive
    # length p_min (None: off; a pass stops drafting before the first draft whose MTP probability is
    # below it). Both always reported on a chain, None included.
    draft_vocab: int | None = None
    draft_p_min: float | None = None
    draft_vocab_ranking: str | None = None  # with a draft vocabulary: the ranking's file, or the fallback's name
    tree_nodes: int | None = None  # tree: the most nodes a pass drafts (after the snapshot memory cap)
    drafted_nodes: list[int] | None = None  # tree: the nodes each pass actually drafted and verified
    snapshot_bytes_per_node: int | None = None  # tree: the GDN snapshot bytes a pass keeps per node

    KEEP_NONE: ClassVar[tuple[str, ...]] = ("draft_vocab", "draft_p_min")  # the chain's keys even when None


@dataclasses.dataclass(frozen=True)
class KV:
    """The trunk's KV cache at the end of the run (`kv_eviction.kv_stats`)."""

    slots: int = _key("kv_slots")  # KV slots in use at the end
    evicted: int = _key("kv_evicted")  # prompt positions SnapKV dropped per attention layer and KV head
    capacity: int = _key("kv_capacity")  # slots allocated per attention cache


@dataclasses.dataclass(frozen=True)
class Backends:
    """Where the matrices ran (`Engine.matrix_backends` adds type, shape and why one is off the selected
    backend)."""

    counts: dict[str, int] = _key("backends")  # matrices per backend they actually run on, e.g. {"pallas": 61}
    matrices: dict[str, str] | None = _key("matrix_backends", None)  # {matrix: backend}; None from generate_batch


@dataclasses.dataclass(frozen=True)
class SessionStats:
    """A session's turn (`Engine.session()`)."""

    reused_tokens: int = _key("session_reused_tokens")  # conversation tokens the kept state already held
    prefilled_tokens: int = _key("session_prefilled_tokens")  # tokens this turn prefilled (the rest)


@dataclasses.dataclass(frozen=True)
class Batch:
    """A sequence of `Engine.generate_batch`: the batch's shared decode, and the sequence's seed."""

    size: int = _key("batch")  # sequences in the batch
    decode_s: float = _key("batch_decode_s")  # the batch's decode seconds (one device loop for all)
    decode_tok_s: float = _key("batch_decode_tok_s")  # all sequences' tokens / decode_s
    seed: int  # this sequence's sampling seed


# (GenerateStats field, its group's type); the group is present when any of its keys is.
_GROUPS: tuple[tuple[str, type], ...] = (("speed", Speed), ("speculation", Speculation), ("kv", KV),
                                         ("backends", Backends), ("session", SessionStats), ("batch", Batch))
EXPERTS_KEY = "experts"


def _flat_keys(group: type) -> dict[str, str]:
    """{flat key: field name} of a group type."""
    return {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(group)}


@dataclasses.dataclass(frozen=True)
class GenerateStats:
    """One generation's stats, grouped; a group the run does not have is None."""

    speed: Speed
    speculation: Speculation | None = None  # None with MTP off
    kv: KV | None = None  # None from generate_batch
    # With an expert budget: this run's residency cost, the dict of `residency.stats.run_stats` (hit_rate,
    # bytes_streamed_per_token, experts_host_computed, bytes_demand, bytes_prefetched, ...; its keys depend
    # on the policy and lookahead, so it stays a dict). None without a budget.
    experts: dict[str, Any] | None = None
    backends: Backends | None = None  # set by every Engine run
    session: SessionStats | None = None  # None outside a session
    batch: Batch | None = None  # None outside generate_batch

    @classmethod
    def from_dict(cls, flat: Mapping[str, Any]) -> "GenerateStats":
        """The groups of a loop's flat stats dict. Raises ValueError on a key no field holds, or on a
        group with a key missing."""
        known = {k for _, group in _GROUPS for k in _flat_keys(group)} | {EXPERTS_KEY}
        unknown = sorted(k for k in flat if k not in known)
        if unknown:
            raise ValueError(f"stats keys {unknown} have no GenerateStats field: add one (runtime/stats.py)")
        groups: dict[str, Any] = {}
        for name, group in _GROUPS:
            keys = _flat_keys(group)
            given = {field: flat[k] for k, field in keys.items() if k in flat}
            if given or name == "speed":
                try:
                    groups[name] = group(**given)
                except TypeError as e:
                    raise ValueError(f"stats group {name}: {e}") from None
        return cls(**groups, experts=flat.get(EXPERTS_KEY))

    def to_dict(self) -> dict[str, Any]:
        """The flat, JSON-ready dict the loops built: the same keys and values (`from_dict`'s inverse)."""
        flat: dict[str, Any] = {}
        for name, _ in _GROUPS:
            group = getattr(self, name)
            if group is None:
                continue
            keep = group.KEEP_NONE if name == "speculation" and group.mode == "mtp" else ()
            for f in dataclasses.fields(group):
                value = getattr(group, f.name)
                if value is not None or f.name in keep:
                    flat[f.metadata.get("key", f.name)] = value
        if self.experts is not None:
            flat[EXPERTS_KEY] = self.experts
        return flat
