"""The host side of speculative passes, shared by the chain and the tree (a chain is a tree of one path):
a pass's named result, the emit loop, and the acceptance stats of a run's passes."""

from __future__ import annotations

from typing import Any, Callable, Collection, NamedTuple, Sequence


class PassResult(NamedTuple):
    """One speculative pass: the accepted drafts, the target's next token, the draft nodes verified and
    the drafts' depth (a chain: both its length)."""

    accepted: list[int]
    next: int
    nodes: int
    depth: int


def emit_passes(first: list[int], max_new_tokens: int, stop_ids: Collection[int], max_context: int,
                position: Callable[[], int], one_pass: Callable[[list[int]], list[int]]) -> tuple[list[int], str]:
    """The emit loop of speculative generation (chain and tree): emit a pass's tokens in order up to
    an EOS or max_new_tokens, then run the next pass from them (`one_pass(out)` -> its accepted tokens
    plus the target's next one) while the certain token's position is inside the context.
    Returns (tokens, stop reason: "eos" | "max_new_tokens" | "max_context")."""
    stop_ids = frozenset(stop_ids)
    out: list[int] = []
    emit = first
    while emit:
        for tok in emit:
            out.append(tok)
            if tok in stop_ids:
                return out, "eos"
            if len(out) == max_new_tokens:
                return out, "max_new_tokens"
        if position() >= max_context:
            return out, "max_context"
        emit = one_pass(out)
    return out, "max_new_tokens"


def pass_counts(k: int, passes: Sequence[tuple[int, int, int]]) -> dict[str, Any]:
    """The counts `pass_stats` reads, from (draft nodes verified, depth, accepted) per pass."""
    return dict(passes=len(passes), drafted=sum(n for n, _, _ in passes), accepted=sum(a for _, _, a in passes),
                tried=[sum(d >= i for _, d, _ in passes) for i in range(1, k + 1)],
                hit=[sum(d >= i and a >= i for _, d, a in passes) for i in range(1, k + 1)])


def pass_stats(k: int, counts: dict | None, per: str) -> dict[str, Any]:
    """Acceptance stats from pass counts: passes, drafted, accepted (sums over passes), tried[i-1] /
    hit[i-1] (passes whose drafts reached depth i / accepted i or more), i = 1..k; None: no pass.
    per: the name of the per-depth list ("accept_per_position" for the chain, "accept_per_depth" for
    the tree)."""
    if counts is None:
        counts = dict(passes=0, drafted=0, accepted=0, tried=[0] * k, hit=[0] * k)
    passes, drafted, accepted = int(counts["passes"]), int(counts["drafted"]), int(counts["accepted"])
    return {
        "drafted": drafted,
        "accepted": accepted,
        "verify_passes": passes,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accept_len": (accepted + passes) / passes if passes else 0.0,
        per: [int(h) / int(t) if int(t) else 0.0 for t, h in zip(counts["tried"][:k], counts["hit"][:k])],
    }
