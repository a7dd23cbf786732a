"""The research API on the fixtures: greedy continuations vs transformers, outputs, EOS and context
stops, bad input."""

from __future__ import annotations

import functools
import shutil

import gguf
import numpy as np
import pytest

import sharpi_jax as sj
from sharpi_jax.assets import DEFAULT_MODEL
from sharpi_jax.errors import InputError, SharpiError
from sharpi_jax.runtime.sampling import SamplingParams
from sharpi_jax.runtime.strategies.chain import generate_mtp
from tests.conftest import fixture_engine, fixture_path, load_references

ARCHS = ("tiny-qwen35moe", "tiny-qwen35", "tiny-qwen3next")
MAX_CONTEXT = 512


def engine(name: str, variant: str = "F32"):
    return fixture_engine(name, variant, MAX_CONTEXT)


references = load_references


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_matches_transformers(name):
    """48 greedy tokens after each llama.cpp-tokenized prompt == transformers' greedy continuation."""
    ref = references(name)
    e = engine(name)
    for i, toks in enumerate(ref["variants"][f"{name}-F32"]["tokens"]):
        out = e.generate(toks, max_new_tokens=48, stop_on_eos=False)
        assert out.tokens == ref["transformers"]["greedy"][i], f"prompt {i}"
        assert out.text == e.tokenizer.decode(out.tokens)
    speed = out.stats.speed
    print(f"{name}: decode {speed.decode_tok_s:.0f} tok/s, prefill {speed.prefill_tok_s:.0f} tok/s "
          f"(last prompt, T={speed.prompt_tokens})")


def test_generate_text_prompt_and_stats():
    name = "tiny-qwen35moe"
    e = engine(name)
    prompt = references(name)["prompts"][0]
    out = e.generate(prompt, max_new_tokens=8, stop_on_eos=False)
    same = e.generate(e.tokenizer.encode(prompt), max_new_tokens=8, stop_on_eos=False)
    assert out.tokens == same.tokens and len(out.tokens) == 8  # generated part only
    assert isinstance(out.text, str) and out.text == e.tokenizer.decode(out.tokens)
    speed = out.stats.speed
    assert speed.generated_tokens == 8 and speed.prefill_tok_s > 0 and speed.decode_tok_s > 0
    assert out.stats.speed.prompt_tokens == len(e.tokenizer.encode(prompt))
    assert out.stats.speed.stop_reason == "max_new_tokens"
    assert e.generate(prompt, max_new_tokens=0).tokens == []


def test_stops_on_context():
    name = "tiny-qwen35moe"
    e = engine(name)
    eos = e.tokenizer.eos_id
    assert eos is not None
    logits = e.logits([eos])
    assert logits.shape == (1, e.config.n_vocab)
    prompt = references(name)["variants"][f"{name}-F32"]["tokens"][3]
    long_prompt = (prompt * 2)[: MAX_CONTEXT - 5]
    out = e.generate(long_prompt, max_new_tokens=20, stop_on_eos=False)
    assert out.stats.speed.stop_reason == "max_context" and len(out.tokens) == 6


# ----- EOS stops through engine.generate, on the embedded default model (no fixtures needed) -----

@functools.lru_cache(maxsize=None)
def default_engine():
    return sj.load(DEFAULT_MODEL, max_context=256)


def _check_eos_stop(e, prompt, full: list[int], eos: int, **kw):
    """`full` is a stop_on_eos=False run whose first EOS is at index i > 0: generate (plain, MTP batched
    and sequential verify) returns full[:i + 1], stops with "eos", and its text leaves the EOS out."""
    i = full.index(eos)
    assert i > 0
    runs = {"plain": {}, **{f"mtp-{v}": dict(speculative="mtp", draft_tokens=3, verify=v)
                            for v in ("batched", "sequential")}}
    for what, extra in runs.items():
        out = e.generate(prompt, max_new_tokens=len(full), **kw, **extra)
        assert out.tokens == full[: i + 1], what
        assert out.stats.speed.stop_reason == "eos" and out.stats.speed.generated_tokens == i + 1, (what, out.stats)
        assert out.text == e.tokenizer.decode(full[:i]), what
    return i


def test_eos_produced_by_the_model_stops_generate():
    """The default model was trained with EOS between files: after a file's closing `main()` line it
    samples EOS (p ~ 0.3 at that step). The first seed whose sampled run contains an EOS: generation
    stops right after it, with and without MTP."""
    e = default_engine()
    eos = e.tokenizer.eos_id
    assert eos in e.tokenizer.eog_ids
    prompt = 'if __name__ == "__main__":\n    main()'
    sampling = dict(temperature=1.0, top_k=2)
    for seed in range(16):
        full = e.generate(prompt, max_new_tokens=12, stop_on_eos=False, seed=seed, **sampling)
        if eos in full.tokens[1:]:
            break
    else:
        pytest.fail("no seed in 0..15 sampled an EOS after the prompt")
    i = _check_eos_stop(e, prompt, full.tokens, eos, seed=seed, **sampling)
    assert full.stats.speed.stop_reason == "max_new_tokens" and len(full.tokens) > i + 1  # it went on without the stop


def test_eos_inside_accepted_drafts_stops_generate(tmp_path):
    """A constructed case for greedy decoding: a copy of the default model whose GGUF metadata names as
    EOS a token that greedy MTP decoding emits as an accepted draft (not the pass's last token), at its
    first occurrence. engine.generate (plain, MTP batched and sequential) stops exactly there."""
    e = default_engine()
    prompt = e.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):\n")
    trace: list = []
    out, _ = generate_mtp(e.runtime, e.mtp, prompt, 40, SamplingParams(), (), 3, "batched", trace=trace)
    emitted, pos = [], 1  # token 0 comes from the prefill; a pass emits its accepted drafts, then one more
    for t in trace:
        emitted += range(pos, pos + t["accepted"])
        pos += t["accepted"] + 1
    i = next((j for j in emitted if j >= 2 and out[j] not in out[:j]), None)
    assert i is not None, f"no first-occurrence token among the accepted drafts {emitted} of {out}"
    patched = tmp_path / "default-eos.gguf"
    shutil.copyfile(DEFAULT_MODEL, patched)
    reader = gguf.GGUFReader(patched, "r+")
    field = reader.fields["tokenizer.ggml.eos_token_id"]
    field.parts[field.data[0]][0] = out[i]
    reader.data.flush()
    del reader
    p = sj.load(patched, max_context=256)
    assert p.tokenizer.eos_id == out[i] and out[i] in p.tokenizer.eog_ids
    assert p.generate(prompt, max_new_tokens=40, stop_on_eos=False).tokens == out  # only the EOS id changed
    assert _check_eos_stop(p, prompt, out, out[i]) == i


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
        sj.load(fixture_path("tiny-qwen35moe", "tiny-qwen35moe-F32.gguf"), max_context=0)
    with pytest.raises(InputError, match="float32"):
        sj.load(fixture_path("tiny-qwen35moe", "tiny-qwen35moe-F32.gguf"), dtype="bfloat16")


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
