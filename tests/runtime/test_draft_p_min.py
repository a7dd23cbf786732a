"""draft_p_min: an adaptive MTP chain length (a pass stops drafting before the first draft whose
probability under the head is below p_min). Lossless: the tokens are MTP off's, greedy and seeded, on
the host and the device loop, which agree pass for pass; the rule is exact at its ends (the argmax's
probability is at least 1 / vocab, so p_min below that drafts exactly as without it; near 1 it cuts);
bad values raise one-line InputErrors."""

from __future__ import annotations

import numpy as np
import pytest

import sharpi_jax as sj
from sharpi_jax.errors import InputError

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "
K = 3
N = 32  # new tokens


@pytest.fixture(scope="module")
def engine():
    return sj.load(max_context=256)


def _run(engine, loop, p_min, **kw):
    return engine.generate(PROMPT, max_new_tokens=N, speculative="mtp", draft_tokens=K, loop=loop,
                           draft_p_min=p_min, stop_on_eos=False, **kw)


def _same_passes(a, b):
    for field in ("drafted", "accepted", "verify_passes", "accept_per_position"):
        assert getattr(a.stats.speculation, field) == getattr(b.stats.speculation, field), field


@pytest.fixture(scope="module")
def greedy_runs(engine):
    return {"off": engine.generate(PROMPT, max_new_tokens=N, stop_on_eos=False),
            0.0: _run(engine, "device", 0.0), 0.9: _run(engine, "device", 0.9)}


def test_lossless_and_loops_agree(engine, greedy_runs):
    dev, host = greedy_runs[0.9], _run(engine, "host", 0.9)
    assert dev.tokens == host.tokens == greedy_runs["off"].tokens == greedy_runs[0.0].tokens
    _same_passes(dev, host)
    assert dev.stats.speculation.draft_p_min == 0.9 and host.stats.speculation.draft_p_min == 0.9
    assert dev.stats.speculation.drafted < K * dev.stats.speculation.verify_passes  # the chain is really cut


def test_lossless_seeded(engine):
    sampling = {"temperature": 0.8, "top_k": 20, "seed": 3}
    off = engine.generate(PROMPT, max_new_tokens=N, stop_on_eos=False, **sampling)
    dev = _run(engine, "device", 0.5, **sampling)
    assert dev.tokens == off.tokens and dev.stats.speculation.drafted < K * dev.stats.speculation.verify_passes


def test_rule_at_its_ends(engine, greedy_runs):
    """p_top >= 1 / n_vocab for the argmax, so p_min = 0.5 / n_vocab never stops a chain: the passes are
    those of p_min = 0; p_min just below 1 stops almost every chain at its first draft."""
    base = greedy_runs[0.0]
    _same_passes(_run(engine, "device", 0.5 / engine.config.n_vocab), base)
    cut = _run(engine, "device", 0.999999)
    assert cut.tokens == base.tokens and cut.stats.speculation.drafted < base.stats.speculation.drafted / 2


def test_first_draft_against_the_heads_probability(engine):
    """The first pass's first draft is kept exactly when its probability under the MTP head, computed
    independently from the teacher-forced head (`Engine.mtp_logits` on prompt + first token), is >= p_min."""
    ids = engine.tokenizer.encode(PROMPT)
    t = engine.generate(ids, max_new_tokens=1, stop_on_eos=False).tokens[0]
    logits = np.asarray(engine.mtp_logits(ids + [t])[-1], np.float64)
    p1 = float(1.0 / np.exp(logits - logits.max()).sum())
    assert 0.01 < p1 < 0.99  # a threshold on either side of it is a real test of the rule

    def first_pass_drafts(p_min):  # 2 tokens: the prefill's, then one pass
        out = engine.generate(ids, max_new_tokens=2, speculative="mtp", draft_tokens=1, draft_p_min=p_min,
                              stop_on_eos=False)
        assert out.stats.speculation.verify_passes == 1
        return out.stats.speculation.drafted

    assert first_pass_drafts(p1 * (1 - 1e-3)) == 1
    assert first_pass_drafts(min(p1 * (1 + 1e-3), 0.999)) == 0


@pytest.mark.slow
def test_with_draft_vocab_and_seeded_host(engine):
    """Over the draft vocabulary's ids (the head's probability over them); and the host loop seeded."""
    off = engine.generate(PROMPT, max_new_tokens=N, stop_on_eos=False).tokens
    kw = dict(draft_vocab=512)
    out, host = _run(engine, "device", 0.6, **kw), _run(engine, "host", 0.6, **kw)
    assert out.tokens == host.tokens == off
    _same_passes(out, host)
    sampling = {"temperature": 0.8, "top_k": 20, "seed": 3}
    dev, host = _run(engine, "device", 0.5, **sampling), _run(engine, "host", 0.5, **sampling)
    assert dev.tokens == host.tokens
    _same_passes(dev, host)


@pytest.mark.parametrize("kw, match", [
    (dict(speculative="mtp", draft_p_min=1.0), r"draft_p_min\) must be a probability"),
    (dict(speculative="mtp", draft_p_min=-0.1), r"draft_p_min\) must be a probability"),
    (dict(speculative="mtp", draft_p_min="0.5"), r"draft_p_min\) must be a probability"),
    (dict(draft_p_min=0.5), "draft_p_min applies to speculative='mtp'"),
    (dict(speculative="mtp_tree", draft_p_min=0.5), "draft_p_min applies to speculative='mtp'"),
])
def test_bad_values(engine, kw, match):
    with pytest.raises(InputError, match=match):
        engine.generate(PROMPT, max_new_tokens=2, **kw)
