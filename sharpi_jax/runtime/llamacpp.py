"""Acceptance counted as llama.cpp counts it (`llama-speculative-simple --spec-type draft-mtp`), on our
chain decoder: to put our MTP acceptance beside llama.cpp's logged figures."""

from __future__ import annotations

from typing import Any, Sequence

from sharpi_jax.errors import InputError
from sharpi_jax.runtime.mtp import MTPRuntime
from sharpi_jax.runtime.sampling import SamplingParams
from sharpi_jax.runtime.speculative import MTPDecoder
from sharpi_jax.runtime.steps import Runtime


def llamacpp_protocol(runtime: Runtime, mtp: MTPRuntime, prompt: Sequence[int], draft_tokens: int,
                      n_predict: int = 48, replay: bool = False, budget_cap: bool = False,
                      width: int | None = None, zero_h_first: bool = True) -> dict[str, Any]:
    """Acceptance counted as llama.cpp's `llama-speculative-simple --spec-type draft-mtp` (greedy).

    As there: the prompt minus its last token is prefilled, the first pass starts from the last prompt
    token, every pass counts n_drafted += drafts, n_accept += accepted, n_predict += accepted + 1, and
    the loop ends once n_predict > `n_predict`. budget_cap: cap each draft at n_predict - done - 1 (newer
    llama.cpp). replay: count as llama.cpp does for archs it cannot roll back partially (qwen3next): a
    partially accepted pass is not counted; its accepted tokens plus the target's token are verified
    again as a draft (all accepted) and the bonus token follows. Our decoder still rolls back by
    snapshot; only the counting (and pass structure) is mirrored. zero_h_first: llama.cpp's MTP
    position-0 convention (`runtime.mtp`).
    """
    if len(prompt) < 2:
        raise InputError("llamacpp_protocol needs a prompt of at least 2 tokens")
    dec = MTPDecoder(runtime, mtp, draft_tokens, "batched", width, zero_h_first=zero_h_first)
    greedy = SamplingParams()
    dec.prefill(prompt[:-1])
    t = int(prompt[-1])
    n_drafted = n_accept = done = 0
    tokens: list[int] = []
    while True:
        n_max = draft_tokens if not budget_cap else max(0, min(draft_tokens, n_predict - done - 1))
        accepted, nxt, _, _ = dec.step(t, n_max, greedy, 0)
        if replay and len(accepted) < n_max:
            # llama.cpp: restore, then verify [t, accepted..., nxt] as a draft: all accepted, plus a bonus.
            bonus = dec.step(nxt, 0, greedy, 0).next
            n_drafted += len(accepted) + 1
            n_accept += len(accepted) + 1
            done += len(accepted) + 2
            tokens += accepted + [nxt, bonus]
            t = bonus
        else:
            n_drafted += n_max
            n_accept += len(accepted)
            done += len(accepted) + 1
            tokens += accepted + [nxt]
            t = nxt
        if done > n_predict:
            break
    return {"n_drafted": n_drafted, "n_accept": n_accept, "n_predict": done,
            "accept_pct": 100.0 * n_accept / n_drafted if n_drafted else 0.0, "tokens": tokens}
