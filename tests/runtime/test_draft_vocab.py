"""Draft vocabulary: the draft head over N ranked ids equals the full head restricted to those ids, output
is unchanged (both loops), the calibrated ranking is saved beside the file and found again, bad values
raise one-line InputErrors."""

from __future__ import annotations

import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import sharpi_jax as sj
from sharpi_jax.assets import default_model_path
from sharpi_jax.errors import InputError
from sharpi_jax.quant import matmul
from sharpi_jax.runtime import draft_vocab

PROMPT = "def fibonacci(n):\n"
CALIBRATION = ["import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
               "def read(path):\n    with open(path) as f:\n        return f.read()\n"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The default model from a private copy (calibration writes beside the file)."""
    path = tmp_path_factory.mktemp("dv") / "default.gguf"
    shutil.copy(default_model_path(), path)
    return sj.load(path, max_context=256)


def test_ranking_and_fallback():
    assert draft_vocab.ranking({5: 3, 2: 3, 7: 1}, 8).tolist() == [2, 5, 7, 0, 1, 3, 4, 6]
    rank, source = draft_vocab.load_ranking("/nonexistent/model.gguf", 6)
    assert rank.tolist() == list(range(6)) and source == draft_vocab.FALLBACK


def test_the_embedded_model_ships_its_ranking():
    """sj.load()'s draft_vocab=N ranks by the shipped calibration beside the embedded file
    (`experiments.draft_vocab_quality --install`), not the fallback."""
    shipped = draft_vocab.vocab_paths(default_model_path())[0]
    assert shipped.exists()
    engine = sj.load(max_context=64)
    rank, source = draft_vocab.load_ranking(default_model_path(), engine.config.n_vocab)
    assert source == str(shipped) and sorted(rank.tolist()) == list(range(engine.config.n_vocab))
    assert rank[:512].tolist() != list(range(512))
    out = engine.generate(PROMPT, max_new_tokens=4, speculative="mtp", draft_vocab=512)
    assert out.stats.speculation.draft_vocab_ranking == str(shipped)


def test_subset_head_is_the_full_head_restricted(engine):
    """The gathered rows' logits are the full head's at those ids (to 1e-5: an N-row product may round
    its columns differently from the full one); the draft token is the subset's argmax mapped back to
    its id."""
    mtp = engine.mtp
    V = engine.config.n_vocab
    rank = np.random.default_rng(0).permutation(V).astype(np.int32)
    vocab = draft_vocab.build(mtp._head_parts, rank, 300)
    ids = np.asarray(vocab.ids)
    assert ids.tolist() == sorted(rank[:300].tolist())
    h = jnp.asarray(np.random.default_rng(1).standard_normal((2, engine.config.d_model)), jnp.float32)
    full = np.asarray(mtp.logits(h))[0]
    sub = np.concatenate([np.asarray(matmul(h, p)) for p in vocab.parts], axis=-1)[0]
    np.testing.assert_allclose(sub, full[ids], rtol=1e-5, atol=1e-5)
    assert int(vocab.greedy(h)) == int(ids[np.argmax(sub)])


def test_output_unchanged_and_calibration_saved(engine, monkeypatch, tmp_path):
    monkeypatch.setenv("SHARPI_CACHE", str(tmp_path / "cache"))
    ref = engine.generate(PROMPT, max_new_tokens=32)
    full = engine.generate(PROMPT, max_new_tokens=32, speculative="mtp", loop="host")
    fallback = engine.generate(PROMPT, max_new_tokens=32, speculative="mtp", loop="host", draft_vocab=512)
    counts = engine.calibrate_draft_vocab(CALIBRATION)
    saved = draft_vocab.vocab_paths(engine.path)[0]
    assert saved.exists()
    # The statistic: per position p >= 1 of each prompt + its greedy continuation, the target's greedy
    # token at p + 1 when the MTP head's teacher-forced draft (from ids[p] and h[p-1]) equals it.
    want: dict[int, int] = {}
    positions = missed = 0
    for p in CALIBRATION:
        ids = engine.tokenizer.encode(p)
        seq = ids + engine.generate(ids, max_new_tokens=64, loop="host").tokens
        logits, mtp = engine.logits(seq), engine.mtp_logits(seq)
        for pos in range(1, len(seq)):
            t = int(np.argmax(logits[pos]))
            positions += 1
            if int(np.argmax(mtp[pos - 1])) == t:
                want[t] = want.get(t, 0) + 1
            else:
                missed += 1
    assert counts == want and missed > 0 and sum(want.values()) > positions // 4
    rank, source = draft_vocab.load_ranking(engine.path, engine.config.n_vocab)
    assert source == str(saved) and rank[0] == max(counts, key=lambda i: (counts[i], -i))
    for loop in ("host", "device"):
        out = engine.generate(PROMPT, max_new_tokens=32, speculative="mtp", loop=loop, draft_vocab=512)
        assert out.tokens == ref.tokens == full.tokens == fallback.tokens
        assert out.stats.speculation.draft_vocab == 512 and out.stats.speculation.draft_vocab_ranking == str(saved)
    assert full.stats.speculation.draft_vocab is None and full.stats.speculation.draft_vocab_ranking is None
    assert fallback.stats.speculation.draft_vocab_ranking == draft_vocab.FALLBACK
    assert fallback.stats.speculation.drafted > 0


@pytest.mark.parametrize("kw,match", [(dict(draft_vocab=0), "Chain.draft_vocab must be a positive integer"),
                                      (dict(draft_vocab=10 ** 9), "draft_vocab must be an integer in"),
                                      (dict(draft_vocab=1.5), "Chain.draft_vocab must be a positive integer"),
                                      (dict(draft_vocab=64, speculative=None),
                                       "draft_vocab applies to speculative='mtp' or 'mtp_tree' only"),
                                      (dict(draft_vocab=0, speculative="mtp_tree"),
                                       "Tree.draft_vocab must be a positive integer"),
                                      (dict(draft_vocab=2, speculative="mtp_tree", draft_tokens=3, tree_nodes=8),
                                       "draft_vocab=2 is below the tree's 6 children per node")])
def test_bad_values(engine, kw, match):
    kw = {"speculative": "mtp", **kw}
    with pytest.raises(InputError, match=match):
        engine.generate(PROMPT, max_new_tokens=2, **kw)
