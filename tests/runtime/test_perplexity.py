"""Perplexity and KL divergence (`sharpi_jax.runtime.perplexity`) on the shipped stdlib corpus, checked
against llama-perplexity's figures recorded in llama_perplexity.json (made by the --record command in
experiments/perplexity.py's docstring; the llama.cpp binaries are not needed here) and against numpy
computations of the same figures from the engine's own teacher-forced logits.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from sharpi_jax.errors import InputError
from sharpi_jax.runtime import perplexity as P
from tests.conftest import REPO_ROOT, fixture_engine

CORPUS = REPO_ROOT / "experiments" / "data" / "perplexity" / "stdlib.txt"
RECORDED = json.loads(Path(__file__).with_name("llama_perplexity.json").read_text())
CTX = 512
FIRST = CTX // 2


def corpus_text() -> str:
    """The corpus as llama-perplexity -f reads it (one trailing newline dropped)."""
    text = CORPUS.read_bytes().decode("utf-8")
    return text[:-1] if text.endswith("\n") else text


def recorded(name: str, chunks: int) -> dict:
    return RECORDED[f"{name}.gguf|corpus:stdlib|ctx={CTX}|chunks={chunks}"]


@functools.lru_cache(maxsize=None)
def scored(name: str, variant: str, n_chunks: int | None, batch: int = 4):
    """(per-token scores of `variant` against the F32 file, chunks [N, CTX]) on the stdlib corpus."""
    engine = fixture_engine(name, variant, CTX)
    ref = fixture_engine(name, "F32", CTX)
    tok = engine.tokenizer
    ch = P.chunks(tok.encode(corpus_text()), CTX, n_chunks, tok.bos_id if tok.add_bos else None)
    return P.score_chunks(engine.runtime, ch, FIRST, batch, ref.runtime), ch


def check_against_llama(name: str, variant: str, n_chunks: int | None) -> None:
    scores, ch = scored(name, variant, n_chunks)
    got = P.summary(scores)
    want = recorded(f"{name}-{variant}", n_chunks if n_chunks is not None else len(ch))
    assert want["chunks"] == len(ch) and want["ctx"] == CTX
    rel = got["ppl"] / want["ppl"] - 1
    print(f"{name}-{variant}: PPL ours {got['ppl']:.4f}, llama-perplexity {want['ppl']:.4f} ({rel:+.4%}); "
          f"KL vs F32 ours {got['kl_mean']:.6f}, llama {want.get('kl_mean', 0.0):.6f}; top-1 agreement ours "
          f"{got['top1_agreement']:.4%}, llama {want.get('top1_agreement', 1.0):.4%}")
    assert abs(rel) < 0.005
    assert got["count"] == len(ch) * (CTX - 1 - FIRST)
    if variant == "F32":
        assert got["kl_mean"] == 0.0 and got["top1_agreement"] == 1.0
        return
    # llama.cpp stores the base log-probs as 16-bit integers and runs its own kernels: close, not equal
    assert got["kl_mean"] == pytest.approx(want["kl_mean"], rel=0.1, abs=1e-5)
    assert abs(got["top1_agreement"] - want["top1_agreement"]) < 0.01


@pytest.mark.parametrize("variant", ["F32", "Q4_K_M"])
def test_perplexity_and_kl_match_llama_perplexity(variant):
    """4 chunks of 512 tokens: perplexity within 0.5% of llama-perplexity's, the Q4_K_M file's KL
    divergence from the F32 file and top-1 agreement close to llama-perplexity --kl-divergence's."""
    check_against_llama("tiny-qwen35moe", variant, 4)


@pytest.mark.slow
@pytest.mark.parametrize("name,variant", [
    ("tiny-qwen35moe", "F32"), ("tiny-qwen35moe", "BF16"), ("tiny-qwen35moe", "Q8_0"), ("tiny-qwen35moe", "Q4_K_M"),
    ("tiny-qwen35", "F32"), ("tiny-qwen35", "Q8_0"), ("tiny-qwen35", "Q4_K_M"),
    ("tiny-qwen3next", "F32"), ("tiny-qwen3next", "Q8_0")])
def test_whole_corpus_matches_llama_perplexity(name, variant):
    """Every fixture file on the whole corpus (66 chunks of 512)."""
    check_against_llama(name, variant, None)


def test_batched_scores_equal_numpy_from_sequential_logits():
    """Chunk 0's scores from the batched pass against a float64 numpy computation (log-sum-exp, KL as a
    sum over the vocabulary, argmax) from `engine.logits` of the chunk alone (the prefill path). The two
    paths' logits differ by ~3e-4 relative on this file where the kernels quantize activations (ggml's
    Q8 rows round differently after the tiniest upstream change), hence the tolerances."""
    scores, ch = scored("tiny-qwen35moe", "Q4_K_M", 4)
    q = fixture_engine("tiny-qwen35moe", "Q4_K_M", CTX).logits(ch[0])[FIRST:CTX - 1].astype(np.float64)
    f = fixture_engine("tiny-qwen35moe", "F32", CTX).logits(ch[0])[FIRST:CTX - 1].astype(np.float64)
    targets = ch[0, FIRST + 1:]
    lq = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
    lf = f - np.logaddexp.reduce(f, axis=1, keepdims=True)
    rows = np.arange(len(targets))
    nll, ref_nll = -lq[rows, targets], -lf[rows, targets]
    kl = (np.exp(lf) * (lf - lq)).sum(axis=1)
    np.testing.assert_allclose(scores["nll"][0], nll, rtol=0, atol=1e-2)
    np.testing.assert_allclose(scores["ref_nll"][0], ref_nll, rtol=0, atol=1e-4)  # F32: no activation rounding
    np.testing.assert_allclose(scores["kl"][0], kl, rtol=0, atol=1e-3)
    assert P.ppl(scores["nll"][0])["ppl"] == pytest.approx(np.exp(nll.mean()), rel=1e-3)
    assert P.ppl(scores["ref_nll"][0])["ppl"] == pytest.approx(np.exp(ref_nll.mean()), rel=1e-5)
    assert scores["kl"][0].mean() == pytest.approx(kl.mean(), rel=0.05)
    assert np.mean(scores["same_top1"][0] == (q.argmax(1) == f.argmax(1))) > 0.98


def test_summary_and_buckets_equal_numpy():
    """`summary` / `by_position` on random logits against numpy written out here."""
    rng = np.random.default_rng(0)
    N, ctx, first, V = 3, 16, 8, 11
    S = ctx - 1 - first
    logits = rng.normal(size=(N, S, V)) * 3
    ref = logits + rng.normal(size=(N, S, V)) * 0.5
    targets = rng.integers(0, V, size=(N, S))
    s = P.token_scores(logits.astype(np.float32), targets, ref.astype(np.float32))
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    rp = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    nll = -np.take_along_axis(lp, targets[..., None], -1)[..., 0]
    kl = (np.exp(rp) * (rp - lp)).sum(-1)
    got = P.summary(s)
    assert got["ppl"] == pytest.approx(np.exp(nll.mean()), rel=1e-5)
    assert got["ppl_err"] == pytest.approx(np.exp(nll.mean()) * nll.std() / np.sqrt(nll.size - 1), rel=1e-4)
    assert got["kl_mean"] == pytest.approx(kl.mean(), rel=1e-5)
    assert got["kl_percentiles"]["50.0"] == pytest.approx(np.median(kl), rel=1e-5)
    assert got["kl_max"] == pytest.approx(kl.max(), rel=1e-5)
    assert got["top1_agreement"] == pytest.approx(np.mean(logits.argmax(-1) == ref.argmax(-1)))
    rows = P.by_position(s, first, ctx, 3)
    assert [r["positions"] for r in rows] == [[8, 10], [10, 13], [13, 15]]  # 7 positions, near-equal
    for r in rows:
        lo, hi = r["positions"]
        assert r["ppl"] == pytest.approx(np.exp(nll[:, lo - first:hi - first].mean()), rel=1e-5)
        assert r["kl_mean"] == pytest.approx(kl[:, lo - first:hi - first].mean(), rel=1e-5)


def test_chunks_follow_llama_perplexity():
    ids = list(range(100, 135))
    ch = P.chunks(ids, 8)
    assert ch.shape == (4, 8) and ch[1].tolist() == list(range(108, 116))  # tail of 3 dropped
    assert P.chunks(ids, 8, n_chunks=2).shape == (2, 8)
    with_bos = P.chunks(ids, 8, bos=1)
    assert with_bos[:, 0].tolist() == [1] * 4 and with_bos[:, 1:].tolist() == ch[:, 1:].tolist()


@pytest.mark.parametrize("args,match", [
    ((list(range(15)), 8), "needs at least 16"),
    ((list(range(40)), 2), "ctx must be an integer >= 4"),
    ((list(range(40)), 8, 0), "n_chunks must be >= 1"),
])
def test_bad_input_is_one_line(args, match):
    with pytest.raises(InputError, match=match) as e:
        P.chunks(*args)
    assert "\n" not in str(e.value)


def test_score_chunks_pads_the_last_pass(monkeypatch):
    """5 chunks, batch 3: every pass has 3 rows (the last padded), the scores are those of one chunk per
    pass, and the padding rows are dropped (a stand-in for the model: logits a function of each row)."""
    V, ctx, first = 7, 8, 4
    widths = []

    def fake_logits(runtime, tokens, first_):
        widths.append(len(tokens))
        rows = tokens[:, first_:-1].astype(np.float64)
        return np.sin(rows[..., None] * (np.arange(V) + runtime))  # runtime: a number here

    monkeypatch.setattr(P, "chunk_logits", fake_logits)
    ch = np.random.default_rng(1).integers(0, V, size=(5, ctx)).astype(np.int32)
    one = P.score_chunks(1, ch, first, 1, 2)
    widths.clear()
    three = P.score_chunks(1, ch, first, 3, 2)
    assert widths == [3, 3, 3, 3]  # model and reference, two passes each
    for k in ("nll", "kl", "same_top1", "ref_nll"):
        assert three[k].shape == (5, ctx - 1 - first)
        np.testing.assert_array_equal(three[k], one[k])
