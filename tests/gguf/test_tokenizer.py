"""Tests of sharpi_jax.gguf.tokenizer: llama.cpp's ids on the fixtures, roundtrips, splits, bad vocabs."""

from __future__ import annotations

import json
import unicodedata
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, pre_tokenizers

from sharpi_jax.errors import GGUFError, InputError
from sharpi_jax.gguf.tokenizer import (CONTROL, NORMAL, QWEN2_SPLIT_REGEX, QWEN35_SPLIT_REGEX, UNUSED,
                                       USER_DEFINED, Tokenizer, byte_symbols, train_byte_level_bpe)
from tests.conftest import fixture_path

MODEL_DIRS = ("tiny-qwen35moe", "tiny-qwen35", "tiny-qwen3next")
PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@lru_cache(maxsize=None)
def _fixture_fields(model_dir: str) -> dict:
    import gguf

    path = fixture_path(model_dir, f"{model_dir}-F32.gguf")
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


@lru_cache(maxsize=None)
def _fixture_tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer.from_gguf_fields(_fixture_fields(model_dir), source=model_dir)


# A vocab that needs no fixtures: the 256 byte symbols, a few merges, control and user-defined tokens.
_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ", "d e", "de f"]
_SPECIALS = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<think>", USER_DEFINED),
             ("é✓", USER_DEFINED), ("[PAD275]", UNUSED)]


def _minimal_vocab() -> tuple[list[str], list[str], list[int]]:
    tokens = byte_symbols()
    for m in _MERGES:
        a, b = m.split(" ")
        if a + b not in tokens:
            tokens.append(a + b)
    types = [NORMAL] * len(tokens)
    for t, ty in _SPECIALS:
        tokens.append(t)
        types.append(ty)
    return tokens, list(_MERGES), types


@lru_cache(maxsize=None)
def _minimal_tokenizer(pre: str) -> Tokenizer:
    tokens, merges, types = _minimal_vocab()
    return Tokenizer.from_vocab(tokens, merges, types, pre=pre, eos_id=tokens.index("<|endoftext|>"))


# Text that stresses the split: contractions, combining marks, CJK, emoji (ZWJ sequences), digits of
# several scripts, Unicode whitespace, control characters, and special-token spellings.
_INTERESTING = [
    *"'sStTdDlLvVeErRmM aé\u0301\u0308\u093f\u0e31中文日本語한국😀👍🏽\u200d❤1٣½!.,€$_-",
    *"\t\n\r\x0b\x0c\x85\xa0\u2003\u3000\u2028\x00\x1c\x7f",
    "<|endoftext|>", "<|im_start|>", "<think>", "é✓", "[PAD275]", "  ", "\n\n", "'ll", "'S",
]
# Any Unicode text: every code point but lone surrogates (Cs), which are not encodable as UTF-8
# (encode() raises InputError for them; tested separately).
TEXT = st.one_of(
    st.text(alphabet=st.characters(exclude_categories=("Cs",))),
    st.lists(st.one_of(st.sampled_from(_INTERESTING), st.characters(exclude_categories=("Cs",))),
             max_size=40).map("".join),
)


# ----- llama.cpp's token ids on the reference fixtures -----

@pytest.mark.parametrize("model_dir", MODEL_DIRS)
def test_fixture_prompts_match_llamacpp(model_dir):
    tok = _fixture_tokenizer(model_dir)
    refs = json.loads(fixture_path(model_dir, "references.json").read_text())
    assert refs["variants"], "references.json lists no variants"
    for variant, data in refs["variants"].items():
        for i, prompt in enumerate(refs["prompts"]):
            ids = tok.encode(prompt)
            assert ids == data["tokens"][i], f"{model_dir} {variant}: prompt {i} tokenizes differently"
            assert tok.decode(ids) == prompt


@pytest.mark.parametrize("model_dir", MODEL_DIRS)
def test_fixture_metadata(model_dir):
    fields = _fixture_fields(model_dir)
    tok = _fixture_tokenizer(model_dir)
    assert tok.vocab_size == len(fields["tokenizer.ggml.tokens"])
    assert tok.eos_id == fields["tokenizer.ggml.eos_token_id"]
    assert tok.id_to_token(tok.eos_id) == "<|endoftext|>"
    assert tok.token_to_id("<|im_end|>") in tok.eog_ids and tok.eos_id in tok.eog_ids
    assert tok.bos_id is None and not tok.add_bos
    # Our byte-joining decode agrees with HF's ByteLevel decoder on normal tokens.
    ids = tok.encode("def f(x):\n    return x  # ünïcödé ✓\n")
    assert tok.decode(ids) == tok.hf_tokenizer.decode(ids)


# ----- roundtrips -----

@PROPS
@given(TEXT)
def test_roundtrip_fixture_vocab(s):
    tok = _fixture_tokenizer("tiny-qwen35moe")
    ids = tok.encode(s)
    assert tok.decode(ids) == s
    assert all(i not in tok.special_ids for i in ids)  # parse_special=False: control text stays text
    assert tok.decode(tok.encode(s, parse_special=True)) == s


@PROPS
@given(TEXT, st.sampled_from(["qwen35", "qwen2"]))
def test_roundtrip_minimal_vocab(s, pre):
    tok = _minimal_tokenizer(pre)
    ids = tok.encode(s)
    assert tok.decode(ids) == s
    assert b"".join(tok.token_bytes(i) for i in ids) == s.encode("utf-8")
    assert tok.decode(tok.encode(s, parse_special=True)) == s


def test_special_tokens_in_text():
    """Control tokens are parsed only with parse_special; user-defined ones always; decode keeps both."""
    tok = _minimal_tokenizer("qwen35")
    eot, ims, think = (tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<think>"))
    text = "<|im_start|>the<think>x<|endoftext|>"
    plain = tok.encode(text)
    assert eot not in plain and ims not in plain and think in plain
    parsed = tok.encode(text, parse_special=True)
    assert parsed[0] == ims and parsed[-1] == eot and think in parsed
    assert tok.decode(plain) == tok.decode(parsed) == text
    assert tok.decode(parsed, skip_special=True) == "the<think>x"
    # Non-ASCII user-defined tokens decode to their text (HF's ByteLevel decoder would mangle "é").
    assert tok.decode(tok.encode("aé✓b")) == "aé✓b" and tok.token_to_id("é✓") in tok.encode("aé✓b")
    # Unused (padding) tokens: shown by default, dropped by skip_special.
    pad = tok.token_to_id("[PAD275]")
    assert tok.decode([pad]) == "[PAD275]" and tok.decode([pad], skip_special=True) == ""
    assert pad not in tok.encode("[PAD275]")


def test_partial_utf8_and_bad_ids():
    tok = _minimal_tokenizer("qwen35")
    ids = tok.encode("€")  # 3 byte tokens
    assert len(ids) == 3 and tok.decode(ids) == "€"
    assert tok.decode(ids[:2]) == "\ufffd" and tok.decode_bytes(ids[:2]) == "€".encode()[:2]
    for bad in (-1, tok.vocab_size, 1.5, "x"):
        with pytest.raises(InputError):
            tok.decode([bad])
    with pytest.raises(InputError):
        tok.encode("a\ud800b")
    assert tok.encode("") == [] and tok.decode([]) == ""


def test_merges_and_bos():
    tokens, merges, types = _minimal_vocab()
    tok = Tokenizer.from_vocab(tokens, merges, types, pre="qwen35", bos_id=tokens.index("<|im_start|>"),
                               add_bos=True)
    ids = tok.encode(" the def")
    assert ids[0] == tok.bos_id and [tok.id_to_token(i) for i in ids[1:]] == ["Ġthe", "Ġ", "def"]
    assert tok.encode(" the", add_bos=False) == [tok.token_to_id("Ġthe")]


# ----- the split matches llama.cpp's scanner -----

_WS = frozenset(map(chr, [*range(9, 14), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                          0x202F, 0x205F, 0x3000]))  # Unicode White_Space, as llama.cpp's unicode_set_whitespace


def llamacpp_split(text: str, marks: bool) -> list[str]:
    """Port of llama.cpp's unicode_regex_split_custom_qwen35 (marks=True) / _qwen2 (marks=False)."""
    n, out, prev, pos = len(text), [], 0, 0

    def f(p):  # (letter, number, mark, whitespace, in range) -- out of range: all false
        if not 0 <= p < n:
            return (False, False, False, False, False)
        c = unicodedata.category(text[p])[0]
        return (c == "L", c == "N", c == "M", text[p] in _WS, True)

    def word(fl):
        return fl[0] or fl[1] or fl[3] or (marks and fl[2])

    def add(end):
        nonlocal prev
        length = end - prev
        if length > 0:
            out.append(text[prev:end])
        prev = end
        return length

    while pos < n:
        c, fl = text[pos], f(pos)
        if c == "'" and pos + 1 < n:
            nx = text[pos + 1]
            if nx in "sStTmMdD":
                pos += add(pos + 2)
                continue
            pair = text[pos + 1:pos + 3]
            if len(pair) == 2 and pair.isascii() and pair.lower() in ("re", "ve", "ll"):
                pos += add(pos + 3)
                continue
        if not (c in "\r\n" or fl[1]):
            nf = f(pos + 1)
            if fl[0] or nf[0] or (marks and (fl[2] or nf[2])):
                pos += 1
                while f(pos)[0] or (marks and f(pos)[2]):
                    pos += 1
                add(pos)
                continue
        if fl[1]:
            pos += 1
            add(pos)
            continue
        fl2 = f(pos + 1) if c == " " else fl
        if not word(fl2) and fl[4]:
            pos += c == " "
            while not word(fl2) and fl2[4]:
                pos += 1
                fl2 = f(pos)
            while pos < n and text[pos] in "\r\n":
                pos += 1
            add(pos)
            continue
        num, last = 0, 0
        while f(pos + num)[3]:
            if text[pos + num] in "\r\n":
                last = pos + num + 1
            num += 1
        if last > 0:
            pos = last
        elif num > 1 and pos + num < n:
            pos += num - 1
        elif num > 0:
            pos += num
        else:
            pos += 1
        add(pos)
    return out


# Characters assigned in Python's Unicode version: there Oniguruma (in `tokenizers`), Python and
# llama.cpp agree on the L/N/M/White_Space classes (newer characters are a known difference).
SPLIT_TEXT = st.lists(st.one_of(st.sampled_from(_INTERESTING),
                                st.characters(exclude_categories=("Cs", "Cn"))), max_size=40).map("".join)


@PROPS
@given(SPLIT_TEXT)
def test_split_matches_llamacpp_scanner(s):
    for regex, marks in ((QWEN35_SPLIT_REGEX, True), (QWEN2_SPLIT_REGEX, False)):
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
        pieces = [p for p, _ in split.pre_tokenize_str(s)]
        assert pieces == llamacpp_split(s, marks), f"marks={marks}"


def test_qwen35_vs_qwen2_marks():
    s = "cafe\u0301s na\u0308ive \u0915\u093f"  # decomposed accents, Devanagari vowel sign
    split = lambda rx: [p for p, _ in pre_tokenizers.Split(Regex(rx), behavior="isolated").pre_tokenize_str(s)]
    assert split(QWEN35_SPLIT_REGEX) == ["cafe\u0301s", " na\u0308ive", " \u0915\u093f"]
    assert split(QWEN2_SPLIT_REGEX) == ["cafe", "\u0301s", " na", "\u0308ive", " \u0915", "\u093f"]
    assert split(QWEN35_SPLIT_REGEX) == llamacpp_split(s, True)
    assert split(QWEN2_SPLIT_REGEX) == llamacpp_split(s, False)


# ----- bad vocabularies -----

def _fields(**overrides):
    tokens, merges, types = _minimal_vocab()
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types,
              "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>")}
    for k, v in overrides.items():
        key = "tokenizer.ggml." + k
        if v is None:
            fields.pop(key)
        else:
            fields[key] = v
    return fields


@pytest.mark.parametrize("overrides, match", [
    ({"model": "llama"}, r"tokenizer\.ggml\.model = 'llama' is not supported \(supported: gpt2\)"),
    ({"pre": "llama-bpe"}, r"tokenizer\.ggml\.pre = 'llama-bpe' is not supported \(supported: qwen2, qwen35\)"),
    ({"model": None}, r"missing required key 'tokenizer\.ggml\.model'"),
    ({"pre": None}, r"missing required key 'tokenizer\.ggml\.pre'"),
    ({"tokens": None}, r"missing required key 'tokenizer\.ggml\.tokens'"),
    ({"merges": None}, r"missing required key 'tokenizer\.ggml\.merges'"),
    ({"tokens": []}, r"tokenizer\.ggml\.tokens is empty"),
    ({"token_type": [1, 1]}, r"tokenizer\.ggml\.token_type has 2 entries"),
    ({"eos_token_id": 10**6}, r"tokenizer\.ggml\.eos_token_id = 1000000 is outside"),
    ({"merges": ["Ġ t", "q zz"]}, r"tokenizer\.ggml\.merges\[1\] = 'q zz': 'zz' is not in"),
    ({"merges": ["Ġt"]}, r"tokenizer\.ggml\.merges\[0\] = 'Ġt' is not of the form"),
    ({"add_bos_token": True}, r"bos_token_id is missing"),
])
def test_bad_fields(overrides, match):
    with pytest.raises(GGUFError, match=match):
        Tokenizer.from_gguf_fields(_fields(**overrides))


def test_bad_fields_name_the_source():
    with pytest.raises(GGUFError, match=r"^model\.gguf: tokenizer\.ggml\.pre = 'llama-bpe'"):
        Tokenizer.from_gguf_fields(_fields(pre="llama-bpe"), source="model.gguf")


def test_merge_with_unknown_result_is_an_error_not_a_panic():
    tokens, _, types = _minimal_vocab()
    with pytest.raises(GGUFError, match=r"'ab' is not in tokenizer\.ggml\.tokens"):
        Tokenizer.from_vocab(tokens, ["a b"], types, pre="qwen35")


# ----- training a vocab for synthetic models -----

_CORPUS = [
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, name, value=None):\n"
    "        self.name = name\n",
    "Les élèves n'ont pas vu l'été. 中文文本测试。 Emoji 😀 and café\u0301 — it's done.\n",
] * 3


def test_train_byte_level_bpe():
    tokens, merges, types = train_byte_level_bpe(_CORPUS, vocab_size=600)
    assert len(tokens) == len(types) == 600 and len(set(tokens)) == 600
    assert set(byte_symbols()) <= set(tokens)
    assert merges and all(len(m.split(" ")) == 2 for m in merges)
    eot = tokens.index("<|endoftext|>")
    assert types[eot] == CONTROL
    n_learned = 256 + len(merges)
    assert types[:n_learned] == [NORMAL] * n_learned
    assert all(types[i] == UNUSED and tokens[i] == f"[PAD{i}]" for i in range(eot + 1, 600))
    assert train_byte_level_bpe(_CORPUS, vocab_size=600) == (tokens, merges, types)  # deterministic

    tok = Tokenizer.from_vocab(tokens, merges, types, pre="qwen35", eos_id=eot)
    for text in _CORPUS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert len(ids) < len(text.encode()) / 2  # the merges are used
    assert tok.encode("<|endoftext|>", parse_special=True) == [eot]


def test_train_exact_sizes():
    tokens, merges, types = train_byte_level_bpe(["ab ab ab"], vocab_size=257)
    assert len(tokens) == 257 and merges == [] and types[-1] == CONTROL
    tokens, merges, types = train_byte_level_bpe(["ab"], vocab_size=300, special_tokens=("<a>", "<b>"))
    assert len(tokens) == 300 and [types[tokens.index(s)] for s in ("<a>", "<b>")] == [CONTROL, CONTROL]
    with pytest.raises(InputError):
        train_byte_level_bpe(["ab"], vocab_size=256)


@settings(max_examples=30, deadline=None)
@given(TEXT)
def test_roundtrip_trained_vocab(s):
    tok = _trained_tokenizer()
    assert tok.decode(tok.encode(s)) == s


@lru_cache(maxsize=None)
def _trained_tokenizer() -> Tokenizer:
    tokens, merges, types = train_byte_level_bpe(_CORPUS, vocab_size=500)
    return Tokenizer.from_vocab(tokens, merges, types, pre="qwen35")


def test_lone_surrogate_is_a_clear_error():
    tok = Tokenizer.from_vocab(byte_symbols(), [], None, pre="qwen35")
    with pytest.raises(InputError, match="cannot be tokenized"):
        tok.encode("abc\ud800def")
