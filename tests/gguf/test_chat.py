"""Chat templates: our sandboxed rendering equals transformers' apply_chat_template (strings rendered
once by tests/gguf/chat/make_references.py and kept), the template sees the thinking switch, and a
template reaching outside the sandbox is refused with an InputError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sharpi_jax as sj
from sharpi_jax.errors import InputError
from sharpi_jax.gguf import GGUFFile
from sharpi_jax.gguf.tokenizer import Tokenizer

HERE = Path(__file__).parent / "chat"
TEMPLATE = (HERE / "qwen35_style.jinja").read_text()
CASES = json.loads((HERE / "cases.json").read_text())
RENDERED = json.loads((HERE / "transformers_rendered.json").read_text())["rendered"]
DEFAULT = Path(sj.__file__).parent / "assets" / "default.gguf"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The default model's tokenizer, built from GGUF fields that carry the template."""
    with GGUFFile(DEFAULT) as f:
        return Tokenizer.from_gguf_fields({**f.metadata, "tokenizer.chat_template": TEMPLATE})


def test_cases_cover_the_claim():
    kinds = {(bool(c.get("tools")), any(m["role"] == "system" for m in c["messages"]),
              sum(m["role"] == "user" for m in c["messages"]) > 1, c.get("kwargs", {}).get("enable_thinking"))
             for c in CASES.values()}
    assert {k[0] for k in kinds} == {True, False} and {k[1] for k in kinds} == {True, False}
    assert {k[3] for k in kinds} == {None, True, False} and any(k[2] for k in kinds)
    assert set(RENDERED) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_transformers(tokenizer, name):
    case = CASES[name]
    ours = tokenizer.apply_chat_template(case["messages"], case.get("add_generation_prompt", True),
                                         tools=case.get("tools"), **case.get("kwargs", {}))
    assert ours == RENDERED[name]


def test_thinking_switch_reaches_the_template(tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    on = tokenizer.apply_chat_template(msgs, enable_thinking=True)
    off = tokenizer.apply_chat_template(msgs, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n<think>\n") and off.endswith("<think>\n\n</think>\n\n")
    assert tokenizer.apply_chat_template(msgs, tokenize=True) == tokenizer.encode(on, parse_special=True)


@pytest.mark.parametrize("template, what", [
    ("{{ ''.__class__.__mro__ }}", "sandbox"),
    ("{{ messages.__class__.__init__.__globals__ }}", "sandbox"),
    ("{{ cycler.__init__.__globals__.os }}", "sandbox"),
    ("{% set x = messages.append({'role': 'user'}) %}", "sandbox"),  # immutable: no mutation of inputs
    ("{{ raise_exception('bad order') }}", "chat template: bad order"),
    ("{% for m in messages %}", "does not parse"),
])
def test_bad_templates_are_input_errors(tokenizer, template, what):
    with pytest.raises(InputError, match=what) as e:
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template)
    assert "\n" not in str(e.value)


def test_bad_messages_and_no_template():
    with GGUFFile(DEFAULT) as f:
        plain = Tokenizer.from_gguf_fields(f.metadata)
    assert plain.chat_template is None
    with pytest.raises(InputError, match="no tokenizer.chat_template"):
        plain.apply_chat_template([{"role": "user", "content": "x"}])
    for bad in ("hello", [], [{"content": "no role"}], {"role": "user"}):
        with pytest.raises(InputError, match="message"):
            plain.apply_chat_template(bad, chat_template=TEMPLATE)


def test_generate_messages_is_the_rendered_prompt():
    engine = sj.load(max_context=256)
    engine.tokenizer.chat_template = TEMPLATE
    msgs = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "def fib(n):"}]
    for thinking in (True, False):
        ids = engine.tokenizer.apply_chat_template(msgs, tokenize=True, enable_thinking=thinking)
        out = engine.generate(messages=msgs, max_new_tokens=6, enable_thinking=thinking)
        assert out.stats.speed.prompt_tokens == len(ids)  # the prompt is the rendered chat, switch included
        assert out.tokens == engine.generate(ids, max_new_tokens=6).tokens
    with pytest.raises(InputError, match="not both"):
        engine.generate("x", messages=msgs)
    with pytest.raises(InputError, match="messages=\\[...\\] only"):
        engine.generate("x", enable_thinking=False)


def _with_template(src: Path, out: Path) -> Path:
    """A copy of `src` whose metadata carries TEMPLATE as tokenizer.chat_template (gguf-py's writer)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    with GGUFFile(src) as f:
        w = gguf.GGUFWriter(out, f.architecture)
        for key, field in reader.fields.items():
            if not key.startswith("GGUF.") and key != "general.architecture":
                sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(key, field.contents(), field.types[0], sub)
        w.add_key_value("tokenizer.chat_template", TEMPLATE, gguf.GGUFValueType.STRING)
        for name, t in f.tensors.items():
            w.add_tensor(name, np.array(f.raw(name)), raw_shape=f.raw(name).shape, raw_dtype=t.qtype)
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return out


def test_cli_chat(tmp_path):
    from tests.experiments.entry_point import ok, run_entry_point

    res = run_entry_point("generate", "--chat", "--prompt=hi", "--max_new_tokens=2", cache=tmp_path)
    assert res.returncode == 2 and "no tokenizer.chat_template" in res.stderr.strip().splitlines()[-1]
    path = _with_template(DEFAULT, tmp_path / "chat.gguf")
    res = ok(run_entry_point("generate", f"--gguf={path}", "--chat", "--system=Be brief.", "--prompt=def f(x):",
                             "--noenable_thinking", "--max_new_tokens=3", "--json", cache=tmp_path))
    out = json.loads(res.stdout.strip().splitlines()[-1])
    with GGUFFile(path) as f:
        tok = Tokenizer.from_gguf_fields(f.metadata)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]
    assert out["stats"]["prompt_tokens"] == len(tok.apply_chat_template(msgs, tokenize=True, enable_thinking=False))
    assert out["stats"]["prompt_tokens"] != len(tok.apply_chat_template(msgs, tokenize=True))
