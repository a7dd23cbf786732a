"""The research API on the fixtures: greedy continuations vs transformers, outputs, bad input."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

import sharpi_jax as sj
from sharpi_jax.errors import InputError, SharpiError

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
ARCHS = ("tiny-qwen35moe", "tiny-qwen35", "tiny-qwen3next")
MAX_CONTEXT = 512


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"reference fixture {path} is absent (expected ../shared/fixtures beside the repo)")
    return path


@functools.lru_cache(maxsize=None)
def engine(name: str, variant: str = "F32"):
    return sj.load(_need(FIXTURES / name / f"{name}-{variant}.gguf"), max_context=MAX_CONTEXT)


@functools.lru_cache(maxsize=None)
def references(name: str) -> dict:
    return json.loads(_need(FIXTURES / name / "references.json").read_text())


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_matches_transformers(name):
    """48 greedy tokens after each llama.cpp-tokenized prompt == transformers' greedy continuation."""
    ref = references(name)
    e = engine(name)
    for i, toks in enumerate(ref["variants"][f"{name}-F32"]["tokens"]):
        out = e.generate(toks, max_new_tokens=48, stop_on_eos=False)
        assert out.tokens == ref["transformers"]["greedy"][i], f"prompt {i}"
        assert out.text == e.tokenizer.decode(out.tokens)
    print(f"{name}: decode {out.stats['decode_tok_s']:.0f} tok/s, prefill {out.stats['prefill_tok_s']:.0f} tok/s "
          f"(last prompt, T={out.stats['prompt_tokens']})")


def test_generate_text_prompt_and_stats():
    name = "tiny-qwen35moe"
    e = engine(name)
    prompt = references(name)["prompts"][0]
    out = e.generate(prompt, max_new_tokens=8, stop_on_eos=False)
    same = e.generate(e.tokenizer.encode(prompt), max_new_tokens=8, stop_on_eos=False)
    assert out.tokens == same.tokens and len(out.tokens) == 8  # generated part only
    assert isinstance(out.text, str) and out.text == e.tokenizer.decode(out.tokens)
    for key in ("prompt_tokens", "generated_tokens", "prefill_tok_s", "decode_tok_s", "stop_reason"):
        assert key in out.stats
    assert out.stats["prompt_tokens"] == len(e.tokenizer.encode(prompt))
    assert out.stats["stop_reason"] == "max_new_tokens"
    assert e.generate(prompt, max_new_tokens=0).tokens == []


def test_stops_on_eos_and_context():
    name = "tiny-qwen35moe"
    e = engine(name)
    eos = e.tokenizer.eos_id
    assert eos is not None
    logits = e.logits([eos])
    assert logits.shape == (1, e.config.n_vocab)
    prompt = references(name)["variants"][f"{name}-F32"]["tokens"][3]
    long_prompt = (prompt * 2)[: MAX_CONTEXT - 5]
    out = e.generate(long_prompt, max_new_tokens=20, stop_on_eos=False)
    assert out.stats["stop_reason"] == "max_context" and len(out.tokens) == 6
    # Force an EOS: a prompt whose greedy next token is EOS is not guaranteed, so check the rule directly.
    out = e.generate(prompt[:5], max_new_tokens=48)
    if eos in out.tokens:
        assert out.tokens[-1] == eos and out.stats["stop_reason"] == "eos"
        assert out.tokens.count(eos) == 1


def test_bad_input():
    e = engine("tiny-qwen35moe")
    V = e.config.n_vocab
    cases = [
        ([], "empty"),
        ("", "empty"),
        ([1] * (MAX_CONTEXT + 1), "max_context"),
        ([1, 2, V], "outside the vocabulary"),
        ([1, -1, 2], "outside the vocabulary"),
        ([1.5, 2.0], "integer"),
        ([[1, 2]], "1-D"),
    ]
    for ids, msg in cases:
        with pytest.raises(InputError, match=msg):
            e.logits(ids) if not isinstance(ids, str) else e.generate(ids)
        with pytest.raises(InputError, match=msg):
            e.generate(ids, max_new_tokens=2)
    assert e.generate([1, 2], max_new_tokens=4, speculative="mtp", draft_tokens=7).tokens == \
        e.generate([1, 2], max_new_tokens=4).tokens
    for kw in (dict(speculative="eagle"), dict(verify="tree"), dict(draft_tokens=0), dict(max_new_tokens=-1),
               dict(temperature=-0.5), dict(top_p=0.0)):
        with pytest.raises(InputError):
            e.generate([1, 2], **kw)
    with pytest.raises(InputError):
        sj.load(FIXTURES / "tiny-qwen35moe" / "tiny-qwen35moe-F32.gguf", max_context=0)
    with pytest.raises(InputError, match="float32"):
        sj.load(FIXTURES / "tiny-qwen35moe" / "tiny-qwen35moe-F32.gguf", dtype="bfloat16")


def test_load_default_model():
    """load(None) runs the embedded default model, or says clearly that it is missing."""
    from sharpi_jax.assets import DEFAULT_MODEL

    if not DEFAULT_MODEL.exists():
        with pytest.raises(SharpiError, match="default model"):
            sj.load()
        return
    e = sj.load(max_context=64)
    out = e.generate("def f(x):", max_new_tokens=4, stop_on_eos=False)
    assert len(out.tokens) == 4 and np.isfinite(e.logits(out.tokens)).all()
