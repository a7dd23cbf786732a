"""Training data that exists on any machine: the running interpreter's standard-library Python sources.

Files are ordered by a hash of their relative path (stable, and a mix of modules rather than the
alphabetical first few), read up to a byte budget, and split at file level into train and validation
(every round(1 / val_fraction)-th file). A byte-level BPE vocab (qwen35 split) is trained on the train
files; each file's tokens are followed by `<|endoftext|>` and the files are concatenated into one stream
from which [B, T] windows are drawn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from sharpi_jax.gguf.tokenizer import Tokenizer, train_byte_level_bpe

EOS_TEXT = "<|endoftext|>"
# Tests, installed packages, and codec modules (mostly generated charmap tables, not Python as written).
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"})


def stdlib_dir() -> Path:
    """The standard-library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The .py files under `root` (default: the stdlib), minus tests and installed packages, in hash order."""
    root = Path(root) if root is not None else stdlib_dir()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for f in sorted(filenames):
            if f.endswith(".py"):
                files.append(Path(dirpath) / f)
    key = lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest()
    return sorted(files, key=key)


def corpus_selection(byte_budget: int = 3_000_000, root: str | os.PathLike[str] | None = None,
                     max_file_bytes: int = 200_000) -> list[tuple[Path, str]]:
    """(path, text) of whole source files (UTF-8, non-empty, at most max_file_bytes each) in hash order
    until byte_budget bytes are collected: the files a corpus of that budget trains on."""
    out, total = [], 0
    for path in corpus_files(root):
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        if not raw.strip() or len(raw) > max_file_bytes:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append((path, text))
        total += len(raw)
        if total >= byte_budget:
            break
    return out


def load_corpus(byte_budget: int = 3_000_000, root: str | os.PathLike[str] | None = None,
                max_file_bytes: int = 200_000) -> list[str]:
    """The texts of `corpus_selection`."""
    return [text for _, text in corpus_selection(byte_budget, root, max_file_bytes)]


@dataclasses.dataclass
class Corpus:
    """Tokenized corpus: the GGUF vocab (tokens, merges, types), its tokenizer and the token streams."""

    vocab: tuple[list[str], list[str], list[int]]
    tokenizer: Tokenizer
    train: np.ndarray  # int32 token stream
    val: np.ndarray
    n_files: tuple[int, int]  # (train, val)
    n_bytes: tuple[int, int]

    @property
    def eos_id(self) -> int:
        return self.vocab[0].index(EOS_TEXT)


def _encode_stream(tok: Tokenizer, texts: Sequence[str], eos: int) -> np.ndarray:
    ids: list[int] = []
    for enc in tok.hf_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, np.int32)


def build_corpus(byte_budget: int = 3_000_000, vocab_size: int = 2048, val_fraction: float = 0.05,
                 root: str | os.PathLike[str] | None = None) -> Corpus:
    """Read the corpus, train the BPE vocab on the train files, tokenize both splits."""
    texts = load_corpus(byte_budget, root)
    if len(texts) < 2:
        raise ValueError(f"corpus too small: {len(texts)} files under {root or stdlib_dir()}")
    every = max(2, round(1.0 / val_fraction))
    is_val = [i % every == every - 1 for i in range(len(texts))]
    if not any(is_val):
        is_val[-1] = True
    train_texts = [t for t, v in zip(texts, is_val) if not v]
    val_texts = [t for t, v in zip(texts, is_val) if v]
    vocab = train_byte_level_bpe(train_texts, vocab_size, special_tokens=(EOS_TEXT,))
    tokens, merges, types = vocab
    eos = tokens.index(EOS_TEXT)
    tok = Tokenizer.from_vocab(tokens, merges, types, pre="qwen35", eos_id=eos, pad_id=eos)
    nb = lambda ts: sum(len(t.encode()) for t in ts)
    return Corpus(vocab=vocab, tokenizer=tok, train=_encode_stream(tok, train_texts, eos),
                  val=_encode_stream(tok, val_texts, eos), n_files=(len(train_texts), len(val_texts)),
                  n_bytes=(nb(train_texts), nb(val_texts)))


def random_batches(stream: np.ndarray, batch: int, seq_len: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Endless [batch, seq_len] int32 windows at uniformly random offsets of `stream` (seeded)."""
    if len(stream) <= seq_len:
        raise ValueError(f"stream of {len(stream)} tokens is too short for windows of {seq_len}")
    rng = np.random.default_rng(seed)
    idx = np.arange(seq_len)
    while True:
        starts = rng.integers(0, len(stream) - seq_len, size=batch)
        yield stream[starts[:, None] + idx[None, :]]


def eval_batches(stream: np.ndarray, batch: int, seq_len: int, max_batches: int | None = None) -> list[np.ndarray]:
    """Consecutive non-overlapping [batch, seq_len] windows from the start of `stream` (the tail that
    does not fill a batch is dropped)."""
    n = len(stream) // seq_len
    windows = stream[: n * seq_len].reshape(n, seq_len)
    out = [windows[i: i + batch] for i in range(0, n - batch + 1, batch)]
    return out[:max_batches] if max_batches is not None else out


__all__ = ["Corpus", "EOS_TEXT", "build_corpus", "corpus_files", "corpus_selection", "eval_batches", "load_corpus",
           "random_batches", "stdlib_dir"]
