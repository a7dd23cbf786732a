"""The GGUF vocab as a tokenizer that reproduces llama.cpp's token ids (byte-level BPE, Qwen splits).

A GGUF carries its tokenizer as metadata: `tokenizer.ggml.model` ("gpt2" = byte-level BPE),
`tokenizer.ggml.pre` (which pre-tokenizer split llama.cpp applies), the token strings, their types and
the BPE merges. We rebuild it with the Hugging Face `tokenizers` library: a BPE model from the vocab and
merges, a pre-tokenizer `Split(regex, isolated)` + `ByteLevel(use_regex=False)`, and a ByteLevel decoder.

Fidelity to llama.cpp (`src/llama-vocab.cpp`, `src/unicode.cpp`):

- The split regexes are llama.cpp's, verbatim (`LLAMA_VOCAB_PRE_TYPE_QWEN2` / `_QWEN35`): the
  case-insensitive `(?i:'s|...)` of tokenizer.json is spelled `(?:'[sS]|...)`. Recent llama.cpp does
  not run these regexes but hand-written scanners (`unicode_regex_split_custom_qwen2/qwen35`; older
  builds used std::regex over category-collapsed text); tests/gguf/test_tokenizer.py checks our
  regex split against a port of those scanners.
- No normalizer: llama.cpp does not apply the NFC normalizer of the HF tokenizer.json, so neither do we
  (and `decode(encode(s)) == s` holds for every string).
- Known residual difference: character classes come from different Unicode versions. Oniguruma in
  `tokenizers` 0.23 knows Unicode 16; llama.cpp's `unicode-data.cpp` is Unicode 15.x. Characters
  assigned in between (e.g. U+1C89, U+0897) are letters/marks/digits here and "undefined" (split
  like punctuation) in llama.cpp, so text containing them may tokenize differently.
- Special tokens: control tokens (type 3) are only recognised in text with `parse_special=True`
  (llama.cpp's `llama_tokenize(..., parse_special)`). Our default is False, the safe choice for raw
  text (a prompt containing "<|im_end|>" literally is tokenized as that text); note the
  `llama-tokenize` CLI defaults to parsing them (`--no-parse-special` turns it off), so pass
  parse_special=True to reproduce it on chat-templated text. User-defined tokens (type 4) are always
  recognised, as in llama.cpp and HF.
- decode() joins each token's bytes: byte-level decoding for normal tokens, the literal text for
  control/user-defined tokens (as llama.cpp's `token_to_piece`). We don't call HF's decode for this
  because it byte-level-decodes added tokens' text too, which mangles non-ASCII user-defined tokens.
"""

from __future__ import annotations

import json
import threading
from functools import cached_property
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from sharpi_jax.errors import GGUFError, InputError
from sharpi_jax.gguf import chat

# llama.cpp token types (enum llama_token_type / gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# From ggml-org/llama.cpp src/llama-vocab.cpp, llm_tokenizer_bpe constructor.
QWEN2_SPLIT_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: letter runs also take combining marks ([\p{L}\p{M}]+), and marks leave the punctuation class.
QWEN35_SPLIT_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_REGEXES = {"qwen2": QWEN2_SPLIT_REGEX, "qwen35": QWEN35_SPLIT_REGEX}
SUPPORTED_MODELS = ("gpt2",)

# Texts of control tokens llama.cpp treats as end-of-generation (besides the EOS id).
_EOG_TEXTS = frozenset({"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                        "<end_of_turn>", "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>"})


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-symbol table (the alphabet of byte-level BPE vocabs)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_TO_SYMBOL: dict[int, str] = _bytes_to_unicode()
SYMBOL_TO_BYTE: dict[str, int] = {s: b for b, s in BYTE_TO_SYMBOL.items()}


def byte_symbols() -> list[str]:
    """The 256 byte-level symbols in byte order (token strings of a minimal byte-level vocab)."""
    return [BYTE_TO_SYMBOL[b] for b in range(256)]


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEXES[pre]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def _unsupported(key: str, value: Any, supported: Iterable[str]) -> GGUFError:
    return GGUFError(f"{key} = {value!r} is not supported (supported: {', '.join(sorted(supported))})")


class Tokenizer:
    """Byte-level BPE tokenizer of a GGUF vocab; `encode` gives llama.cpp's ids (no BOS unless add_bos)."""

    def __init__(self, hf: HFTokenizer, tokens: list[str], token_types: list[int], *, pre: str, model: str,
                 eos_id: int | None, bos_id: int | None, pad_id: int | None, add_bos: bool):
        # Use from_vocab / from_gguf_fields; this only stores what they validated.
        self._hf = hf  # encode_special_tokens=True: control tokens in text are plain text
        self._hf_special: HFTokenizer | None = None  # built on first parse_special=True call
        self._lock = threading.Lock()
        self._tokens = tokens
        self._types = token_types
        self._token_to_id = {t: i for i, t in enumerate(tokens)}  # duplicates: last wins, as llama.cpp
        self.pre, self.model = pre, model
        self._eos_id, self._bos_id, self._pad_id, self.add_bos = eos_id, bos_id, pad_id, add_bos
        self.chat_template: str | None = None  # the GGUF's tokenizer.chat_template (Jinja), if any
        self.source: str | None = None  # the file the tokenizer was read from (named in errors)

    # ----- construction -----

    @classmethod
    def from_vocab(cls, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None,
                   pre: str, model: str = "gpt2", eos_id: int | None = None, bos_id: int | None = None,
                   pad_id: int | None = None, add_bos: bool = False) -> "Tokenizer":
        """Build from GGUF-form vocab: token strings, "a b" merges (rank = index), llama.cpp token types."""
        if model not in SUPPORTED_MODELS:
            raise _unsupported("tokenizer.ggml.model", model, SUPPORTED_MODELS)
        if pre not in PRE_TOKENIZER_REGEXES:
            raise _unsupported("tokenizer.ggml.pre", pre, PRE_TOKENIZER_REGEXES)
        tokens = [_as_str(t, "tokenizer.ggml.tokens", i) for i, t in enumerate(tokens)]
        if not tokens:
            raise GGUFError("tokenizer.ggml.tokens is empty")
        n = len(tokens)
        if token_types is None:
            types = [NORMAL] * n
        else:
            types = [int(t) for t in token_types]
            if len(types) != n:
                raise GGUFError(f"tokenizer.ggml.token_type has {len(types)} entries but "
                                f"tokenizer.ggml.tokens has {n}")
        for key, tid in (("tokenizer.ggml.eos_token_id", eos_id), ("tokenizer.ggml.bos_token_id", bos_id),
                         ("tokenizer.ggml.padding_token_id", pad_id)):
            if tid is not None and not 0 <= int(tid) < n:
                raise GGUFError(f"{key} = {tid} is outside the vocabulary (size {n})")
        if add_bos and bos_id is None:
            raise GGUFError("tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing")

        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = _parse_merges(merges, vocab)
        hf = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=False))
        hf.pre_tokenizer = _pre_tokenizer(pre)
        hf.decoder = decoders.ByteLevel()
        # Control (and unknown) tokens are HF "special" tokens, user-defined ones plain added tokens:
        # that split matches llama.cpp's parse_special semantics through HF's encode_special_tokens.
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN) and t]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == USER_DEFINED and t]
        if special:
            hf.add_special_tokens(special)
        if user:
            hf.add_tokens(user)
        hf.encode_special_tokens = True
        return cls(hf, tokens, types, pre=pre, model=model,
                   eos_id=None if eos_id is None else int(eos_id), bos_id=None if bos_id is None else int(bos_id),
                   pad_id=None if pad_id is None else int(pad_id), add_bos=bool(add_bos))

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], source: str | None = None) -> "Tokenizer":
        """Build from decoded GGUF metadata (key -> str/int/bool/list), e.g. GGUFFile.metadata."""
        where = f"{source}: " if source else ""

        def required(key: str) -> Any:
            if key not in fields or fields[key] is None:
                raise GGUFError(f"{where}missing required key {key!r}")
            return fields[key]

        try:
            model = required("tokenizer.ggml.model")
            if model not in SUPPORTED_MODELS:
                raise _unsupported("tokenizer.ggml.model", model, SUPPORTED_MODELS)
            pre = required("tokenizer.ggml.pre")
            if pre not in PRE_TOKENIZER_REGEXES:
                raise _unsupported("tokenizer.ggml.pre", pre, PRE_TOKENIZER_REGEXES)
            tok = cls.from_vocab(
                tokens=list(required("tokenizer.ggml.tokens")),
                merges=list(required("tokenizer.ggml.merges")),
                token_types=fields.get("tokenizer.ggml.token_type"),
                pre=pre, model=model,
                eos_id=fields.get("tokenizer.ggml.eos_token_id"),
                bos_id=fields.get("tokenizer.ggml.bos_token_id"),
                pad_id=fields.get("tokenizer.ggml.padding_token_id"),
                add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            )
            template = fields.get(chat.CHAT_TEMPLATE_KEY)
            if template is not None and not isinstance(template, str):
                raise GGUFError(f"{chat.CHAT_TEMPLATE_KEY} must be a string, got {type(template).__name__}")
            tok.chat_template = template
            tok.source = source
            return tok
        except GGUFError as e:
            if where and not str(e).startswith(where):
                raise GGUFError(f"{where}{e}") from None
            raise

    # ----- properties -----

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def token_types(self) -> list[int]:
        return list(self._types)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of control and unknown tokens (what decode(skip_special=True) drops, with unused ones)."""
        return frozenset(i for i, t in enumerate(self._types) if t in (CONTROL, UNKNOWN))

    @cached_property
    def eog_ids(self) -> frozenset[int]:
        """End-of-generation ids: the EOS plus control tokens llama.cpp also stops on (<|im_end|>, ...)."""
        ids = {i for i in self.special_ids | {i for i, t in enumerate(self._types) if t == USER_DEFINED}
               if self._tokens[i] in _EOG_TEXTS}
        if self._eos_id is not None:
            ids.add(self._eos_id)
        return frozenset(ids)

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The underlying HF tokenizer (control tokens not parsed in text)."""
        return self._hf

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (vocab form, e.g. 'Ġthe'), or None."""
        return self._token_to_id.get(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocab string of an id (byte-level symbols for normal tokens)."""
        return self._tokens[self._check_id(token_id)]

    def __len__(self) -> int:
        return len(self._tokens)

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id})")

    # ----- encode / decode -----

    def encode(self, text: str, *, parse_special: bool = False, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`, as llama.cpp's llama_tokenize(text, add_special=add_bos, parse_special).

        parse_special=False (default): control tokens written in the text ("<|im_start|>") are
        tokenized as plain text; True: they become their ids. add_bos=None uses the GGUF's flag.
        """
        if not isinstance(text, str):
            raise InputError(f"encode() takes a str, got {type(text).__name__}")
        hf = self._special_hf() if parse_special else self._hf
        try:
            ids = hf.encode(text, add_special_tokens=False).ids
        except (TypeError, ValueError, UnicodeError) as e:
            # Lone surrogates (not encodable as UTF-8) are the only str that fails here.
            raise InputError(f"text cannot be tokenized (not valid Unicode?): {e}") from None
        if self.add_bos if add_bos is None else add_bos:
            if self._bos_id is None:
                raise InputError("add_bos requested but the vocab has no BOS token")
            ids.insert(0, self._bos_id)
        return ids

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                            tokenize: bool = False, chat_template: str | None = None, **kwargs: Any) -> str | list[int]:
        """The prompt text for chat `messages`, rendered from the file's chat template (or `chat_template`)
        in a sandboxed Jinja environment as transformers renders it (`sharpi_jax.gguf.chat`). Extra
        keywords are template variables (tools=[...], enable_thinking=False for Qwen3.5's switch).
        tokenize=True: the ids of that text, its special tokens parsed (`encode(parse_special=True)`)."""
        source = self.chat_template if chat_template is None else chat_template
        if not source:
            raise InputError("this GGUF has no tokenizer.chat_template: pass chat_template=TEXT")
        special = {k: self.id_to_token(i) for k, i in (("bos_token", self._bos_id), ("eos_token", self._eos_id),
                                                        ("pad_token", self._pad_id)) if i is not None}
        name = chat.CHAT_TEMPLATE_KEY + (f" of {self.source}" if self.source else "")
        text = chat.render(source, messages, add_generation_prompt=add_generation_prompt, special_tokens=special,
                           template_name=name if chat_template is None else "chat_template=TEXT", **kwargs)
        return self.encode(text, parse_special=True) if tokenize else text

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of `ids`. Control tokens are kept as their text unless skip_special (which also drops
        unused/padding tokens); byte sequences cut mid-character decode to U+FFFD."""
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        """Raw bytes of `ids` (for streaming: hold back an incomplete UTF-8 tail across calls)."""
        pieces = self._piece_bytes
        ids = [self._check_id(i) for i in ids]
        if skip_special:
            types = self._types
            ids = [i for i in ids if types[i] not in (CONTROL, UNKNOWN, UNUSED)]
        return b"".join([pieces[i] for i in ids])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for."""
        return self._piece_bytes[self._check_id(token_id)]

    # ----- internals -----

    @cached_property
    def _piece_bytes(self) -> list[bytes]:
        out = []
        for tok, ty in zip(self._tokens, self._types):
            if ty in (CONTROL, UNKNOWN, USER_DEFINED):
                out.append(tok.encode("utf-8"))
            else:
                try:
                    out.append(bytes([SYMBOL_TO_BYTE[c] for c in tok]))
                except KeyError:  # not byte-level (malformed vocab): keep its text, as HF's decoder does
                    out.append(tok.encode("utf-8"))
        return out

    def _special_hf(self) -> HFTokenizer:
        with self._lock:
            if self._hf_special is None:
                hf = HFTokenizer.from_str(self._hf.to_str())
                hf.encode_special_tokens = False
                self._hf_special = hf
            return self._hf_special

    def _check_id(self, token_id: Any) -> int:
        try:
            i = int(token_id)
        except (TypeError, ValueError):
            raise InputError(f"token id {token_id!r} is not an integer") from None
        if i != token_id or not 0 <= i < len(self._tokens):
            raise InputError(f"token id {token_id!r} is outside the vocabulary (size {len(self._tokens)})")
        return i


def _as_str(v: Any, key: str, i: int) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, (bytes, bytearray)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{key}[{i}] is not valid UTF-8") from None
    raise GGUFError(f"{key}[{i}] is a {type(v).__name__}, expected a string")


def _parse_merges(merges: Sequence[Any], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """GGUF "a b" merges -> (a, b) pairs, checked against the vocab (HF's BPE would panic otherwise)."""
    pairs: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for i, m in enumerate(merges):
        m = _as_str(m, "tokenizer.ggml.merges", i)
        pos = m.find(" ", 1)  # as llama.cpp: the left part may itself start with a space
        if pos < 0:
            raise GGUFError(f"tokenizer.ggml.merges[{i}] = {m!r} is not of the form 'left right'")
        a, b = m[:pos], m[pos + 1:]
        for part in (a, b, a + b):
            if part not in vocab:
                raise GGUFError(f"tokenizer.ggml.merges[{i}] = {m!r}: {part!r} is not in tokenizer.ggml.tokens")
        if (a, b) in seen:  # llama.cpp keeps the first rank of a repeated merge; HF would keep the last
            continue
        seen.add((a, b))
        pairs.append((a, b))
    return pairs


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = ("<|endoftext|>",)
                         ) -> tuple[list[str], list[str], list[int]]:
    """Train a byte-level BPE (qwen35 split) and return it in GGUF form: (tokens, merges, token_types).

    Layout as Qwen's converted vocabs: the 256 byte symbols and learned tokens (type 1), then the
    special tokens (type 3, control), then "[PAD<id>]" tokens (type 5, unused) up to exactly
    `vocab_size`. Merges are "a b" strings in rank order. Deterministic for a given corpus.
    """
    specials = list(dict.fromkeys(special_tokens))
    n_normal = vocab_size - len(specials)
    if n_normal < 256:
        raise InputError(f"vocab_size {vocab_size} is too small for a byte-level vocab "
                         f"(256 byte symbols + {len(specials)} special tokens)")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = _pre_tokenizer("qwen35")
    trainer = trainers.BpeTrainer(vocab_size=n_normal, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer=trainer)

    learned = hf.get_vocab()
    tokens = sorted(learned, key=learned.__getitem__)
    merges = []
    for m in json.loads(hf.to_str())["model"]["merges"]:
        merges.append(m if isinstance(m, str) else f"{m[0]} {m[1]}")
    types = [NORMAL] * len(tokens)
    for s in specials:
        if s in learned:
            raise InputError(f"special token {s!r} was also learned as a normal token")
        tokens.append(s)
        types.append(CONTROL)
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(UNUSED)
    if len(set(tokens)) != len(tokens):
        raise InputError("trained vocab has duplicate token strings (a learned token looks like [PADn])")
    return tokens, merges, types


__all__ = ["BYTE", "CONTROL", "NORMAL", "PRE_TOKENIZER_REGEXES", "QWEN2_SPLIT_REGEX", "QWEN35_SPLIT_REGEX",
           "Tokenizer", "UNKNOWN", "UNUSED", "USER_DEFINED", "byte_symbols", "train_byte_level_bpe"]
