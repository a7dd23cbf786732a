"""`GenerateOptions`: every option of one generation (how much, how to pick tokens, which speculation,
which loop), validated once at construction with one-line `InputError`s. `Engine.generate` builds one
from its keyword arguments; the CLI builds the same object from its flags.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sharpi_jax.errors import InputError
from sharpi_jax.runtime.sampling import SamplingParams

SPECULATIVE_MODES = (None, "mtp", "mtp_tree")
VERIFY_MODES = ("batched", "sequential")  # the one definition (the decoders assert it)
LOOPS = ("device", "host")
DEFAULT_TREE_NODES = 8


def _positive(name: str, v, allow_none: bool = True) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise InputError(f"{name} must be a positive integer, got {v!r}")


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """max_new_tokens (>= 0); sampling (`SamplingParams`); stop_on_eos; speculative (None | "mtp" |
    "mtp_tree"); draft_tokens (k, the chain length or tree depth); verify ("batched" | "sequential");
    tree_nodes, max_snapshot_bytes (mtp_tree only); loop ("device" | "host"); draft_vocab, draft_p_min
    (mtp only; draft_p_min in [0, 1), 0 = always draft_tokens drafts)."""

    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop_on_eos: bool = True
    speculative: str | None = None
    draft_tokens: int = 3
    verify: str = "batched"
    tree_nodes: int | None = None
    max_snapshot_bytes: int | None = None
    loop: str = "device"
    draft_vocab: int | None = None
    draft_p_min: float = 0.0

    def __post_init__(self):
        if self.speculative not in SPECULATIVE_MODES:
            raise InputError(f"speculative must be one of {SPECULATIVE_MODES}, got {self.speculative!r}")
        if self.verify not in VERIFY_MODES:
            raise InputError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if self.loop not in LOOPS:
            raise InputError(f"loop must be one of {LOOPS}, got {self.loop!r}")
        _positive("draft_tokens", self.draft_tokens, allow_none=False)
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise InputError(f"max_new_tokens must be a non-negative integer, got {n!r}")
        if self.speculative != "mtp_tree" and (self.tree_nodes is not None or self.max_snapshot_bytes is not None):
            raise InputError("tree_nodes and max_snapshot_bytes apply to speculative='mtp_tree' only")
        _positive("tree_nodes", self.tree_nodes)
        _positive("max_snapshot_bytes", self.max_snapshot_bytes)
        if self.speculative == "mtp_tree" and self.nodes < self.draft_tokens:
            raise InputError(f"tree speculation needs draft_tokens <= tree_nodes, got draft_tokens="
                             f"{self.draft_tokens}, tree_nodes={self.tree_nodes}")
        if self.draft_vocab is not None and self.speculative != "mtp":
            raise InputError("draft_vocab applies to speculative='mtp' (the chain) only")
        p = self.draft_p_min
        if isinstance(p, bool) or not isinstance(p, (int, float, np.floating, np.integer)) or not 0 <= p < 1:
            raise InputError(f"draft_p_min must be a probability in [0, 1), got {p!r}")
        if p > 0 and self.speculative != "mtp":
            raise InputError("draft_p_min applies to speculative='mtp' (the chain) only")
        if not isinstance(self.sampling, SamplingParams):
            raise InputError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")

    @property
    def p_min(self) -> float | None:
        """draft_p_min as the drafter takes it: None when 0 (every pass drafts draft_tokens)."""
        return float(self.draft_p_min) if self.draft_p_min > 0 else None

    @property
    def nodes(self) -> int:
        """The tree's draft nodes per pass: tree_nodes, default max(8, draft_tokens)."""
        return max(DEFAULT_TREE_NODES, int(self.draft_tokens)) if self.tree_nodes is None else int(self.tree_nodes)

    @property
    def device_loop(self) -> bool:
        """Whether the run takes the device loop: loop="device" for MTP off and batched verify (chain, tree)."""
        return self.loop == "device" and (self.speculative is None or self.verify == "batched")
