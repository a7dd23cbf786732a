"""The options of one generation as types, each validated once at construction with one-line
`InputError`s naming the field:

- `Chain(k, draft_vocab, p_min)`: MTP speculative decoding, a chain of k drafts per trunk pass;
- `Tree(depth, nodes, max_snapshot_bytes, draft_vocab)`: MTP speculative decoding, a draft tree per trunk
  pass;
- `GenerateOptions(max_new_tokens, sampling, stop_on_eos, speculation, verify, loop, kv)`: everything
  else, `speculation` one of the two above or None (MTP off).

A mode's options exist only on the mode's type, so no field is checked against another mode's.
`GenerateOptions.from_keywords` builds the same objects from the flat keyword shortcuts
(`engine.generate(prompt, speculative="mtp", draft_tokens=3)`); the CLI builds them from its flags.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import numpy as np

from sharpi_jax.errors import InputError, shown
from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime.sampling import SamplingParams

VERIFY_MODES = ("batched", "sequential")  # the one definition (the decoders assert it)
LOOP_CHOICES = ("device", "host")
DEFAULT_TREE_NODES = 8
ENGINE_KV = "engine"  # GenerateOptions.kv: the engine's KV eviction setting (`sj.load(kv=...)`)
SPECULATIVE_NAMES = (None, "mtp", "mtp_tree")  # the keyword shortcut `speculative=`


def _positive(name: str, v: Any, allow_none: bool = True) -> int | None:
    if v is None and allow_none:
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
        raise InputError(f"{name} must be a positive integer, got {shown(v)}")
    return int(v)


def _choice(name: str, v: Any, choices: tuple) -> None:
    if not isinstance(v, str) or v not in choices:
        raise InputError(f"{name} must be one of {choices}, got {shown(v)}")


@dataclasses.dataclass(frozen=True)
class Chain:
    """MTP speculative decoding with a chain of drafts per trunk pass, verified in one pass.

    k: drafts per pass (>= 1). draft_vocab: the MTP head drafts over the N best-ranked token ids only
    (`Engine.calibrate_draft_vocab`'s ranking, else token id order); verification uses the full head, so
    the tokens are unchanged. p_min in [0, 1): an adaptive chain length (llama.cpp's --draft-p-min), a
    pass stops drafting before the first draft whose MTP probability is below p_min; 0 = always k."""

    k: int = 3
    draft_vocab: int | None = None
    p_min: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", _positive("Chain.k (draft_tokens)", self.k, allow_none=False))
        object.__setattr__(self, "draft_vocab", _positive("Chain.draft_vocab", self.draft_vocab))
        p = self.p_min
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.floating, np.integer)) \
                or not 0 <= p < 1:
            raise InputError(f"Chain.p_min (draft_p_min) must be a probability in [0, 1), got {shown(p)}")
        object.__setattr__(self, "p_min", float(p))


@dataclasses.dataclass(frozen=True)
class Tree:
    """MTP speculative decoding with a draft tree per trunk pass (always holding the greedy chain),
    verified in one pass (`sharpi_jax.runtime.tree`).

    depth: the tree's depth (>= 1). nodes: draft nodes per pass (default max(8, depth); >= depth).
    max_snapshot_bytes: a cap on the GDN snapshots a pass keeps (one per node), met by lowering nodes.
    draft_vocab: every drafting call's head over the N best-ranked token ids only, as `Chain.draft_vocab`
    (N >= the tree's children per node, min(8, nodes - depth + 1)); the tokens are unchanged."""

    depth: int = 3
    nodes: int | None = None
    max_snapshot_bytes: int | None = None
    draft_vocab: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "depth", _positive("Tree.depth (draft_tokens)", self.depth, allow_none=False))
        nodes = _positive("Tree.nodes (tree_nodes)", self.nodes)
        object.__setattr__(self, "nodes", max(DEFAULT_TREE_NODES, self.depth) if nodes is None else nodes)
        if self.nodes < self.depth:
            raise InputError(f"a tree needs depth <= nodes (draft_tokens <= tree_nodes), got depth={self.depth}, "
                             f"nodes={self.nodes}")
        object.__setattr__(self, "max_snapshot_bytes",
                           _positive("Tree.max_snapshot_bytes", self.max_snapshot_bytes))
        object.__setattr__(self, "draft_vocab", _positive("Tree.draft_vocab", self.draft_vocab))


Speculation = Union[Chain, Tree, None]


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """max_new_tokens (>= 0); sampling (`SamplingParams`: greedy at temperature 0, else seeded);
    stop_on_eos; speculation (`Chain`, `Tree` or None: MTP off; speculative output equals MTP off's
    tokens bit for bit); verify ("batched": one trunk pass for the drafts | "sequential": token by token,
    the reference; host loop); loop ("device": the decode loop as one jitted program | "host": one jitted
    call per step or pass, driven from Python; same tokens); kv ("engine": the engine's KV eviction,
    `sj.load(kv=...)` | None: none | a `SnapKV`)."""

    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop_on_eos: bool = True
    speculation: Speculation = None
    verify: str = "batched"
    loop: str = "device"
    kv: Any = ENGINE_KV

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
            raise InputError(f"max_new_tokens must be a non-negative integer, got {shown(n)}")
        object.__setattr__(self, "max_new_tokens", int(n))
        if not isinstance(self.sampling, SamplingParams):
            raise InputError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if not isinstance(self.stop_on_eos, (bool, np.bool_)):
            raise InputError(f"stop_on_eos must be True or False, got {shown(self.stop_on_eos)}")
        if self.speculation is not None and not isinstance(self.speculation, (Chain, Tree)):
            raise InputError(f"speculation must be a Chain, a Tree or None, got {shown(self.speculation)}")
        _choice("verify", self.verify, VERIFY_MODES)
        _choice("loop", self.loop, LOOP_CHOICES)
        if not (self.kv is None or self.kv == ENGINE_KV or isinstance(self.kv, SnapKV)):
            raise InputError(f"kv must be {ENGINE_KV!r}, None or a SnapKV, got {shown(self.kv)}")

    @classmethod
    def from_keywords(cls, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                      min_p: float = 0.0, seed: int = 0, stop_on_eos: bool = True, speculative: str | None = None,
                      draft_tokens: int = 3, verify: str = "batched", tree_nodes: int | None = None,
                      max_snapshot_bytes: int | None = None, loop: str = "device", draft_vocab: int | None = None,
                      draft_p_min: float = 0.0, kv: Any = ENGINE_KV) -> "GenerateOptions":
        """The keyword shortcuts of `Engine.generate` as the typed options: speculative None | "mtp" (a
        `Chain(draft_tokens, draft_vocab, draft_p_min)`) | "mtp_tree" (a `Tree(draft_tokens, tree_nodes,
        max_snapshot_bytes, draft_vocab)`); a mode's keyword given with another mode is an error."""
        if speculative not in SPECULATIVE_NAMES:
            raise InputError(f"speculative must be one of {SPECULATIVE_NAMES}, got {shown(speculative)}")
        if speculative != "mtp_tree" and (tree_nodes is not None or max_snapshot_bytes is not None):
            raise InputError("tree_nodes and max_snapshot_bytes apply to speculative='mtp_tree' only")
        if speculative != "mtp" and not _is_zero(draft_p_min):
            raise InputError("draft_p_min applies to speculative='mtp' (the chain) only")
        if speculative is None and draft_vocab is not None:
            raise InputError("draft_vocab applies to speculative='mtp' or 'mtp_tree' only")
        spec: Speculation = None
        if speculative == "mtp":
            spec = Chain(draft_tokens, draft_vocab, draft_p_min)
        elif speculative == "mtp_tree":
            spec = Tree(draft_tokens, tree_nodes, max_snapshot_bytes, draft_vocab)
        else:
            _positive("draft_tokens", draft_tokens, allow_none=False)
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        return cls(max_new_tokens=max_new_tokens, sampling=sampling, stop_on_eos=stop_on_eos, speculation=spec,
                   verify=verify, loop=loop, kv=kv)

    # ----- what the loops read -----
    @property
    def speculative(self) -> str | None:
        """The mode's name: None, "mtp" (a Chain) or "mtp_tree" (a Tree); stats and logs use it."""
        return {Chain: "mtp", Tree: "mtp_tree"}.get(type(self.speculation))

    @property
    def draft_tokens(self) -> int:
        """The chain's k or the tree's depth (0 with MTP off)."""
        s = self.speculation
        return s.k if isinstance(s, Chain) else s.depth if isinstance(s, Tree) else 0

    @property
    def device_loop(self) -> bool:
        """Whether the run takes the device loop: loop="device" for MTP off and batched verify (chain, tree)."""
        return self.loop == "device" and (self.speculation is None or self.verify == "batched")


def drafter_p_min(opts: GenerateOptions) -> float | None:
    """The chain's p_min as the drafter takes it: None when 0 or not a chain (every pass drafts k)."""
    s = opts.speculation
    return s.p_min if isinstance(s, Chain) and s.p_min > 0 else None


def _is_zero(p: Any) -> bool:
    try:
        return not isinstance(p, (bool, np.bool_)) and float(p) == 0.0
    except (TypeError, ValueError):
        return False
