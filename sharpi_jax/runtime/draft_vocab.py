"""Draft vocabulary (FR-Spec-like): the MTP head drafts over the N highest-ranked token ids only.

The draft step's LM head product is restricted to N gathered rows of the head (gathered ONCE per N into
their own QTensor rows, `DraftVocab`), its argmax mapped back to a token id. Verification always uses
the full head, so the output is unchanged; only the acceptance can drop.

Ranking: token ids by calibrated frequency (`Engine.calibrate_draft_vocab`, `count_accepted`: how often
the MTP head's full-vocabulary draft equals the target's greedy token, over each prompt and its greedy
continuation: the drafts a subset can keep or lose), saved beside the model as
`<model>.gguf.draft-vocab.json` (or in $SHARPI_CACHE, default
~/.cache/sharpi-jax, when its directory is read-only) and found there automatically; ids never seen
follow in id order. The embedded model ships one (`experiments.draft_vocab_quality --install`).
Fallback when nothing is saved: token id order, which for a byte-level BPE vocabulary is the merge
order (earlier merges are the more frequent pairs).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharpi_jax.errors import InputError
from sharpi_jax.paths import calibration_paths, save_json
from sharpi_jax.quant import QTensor, matmul
from sharpi_jax.runtime.sampling import argmax

SUFFIX = ".draft-vocab.json"
FORMAT = "sharpi-draft-vocab/1"
FALLBACK = "token id order (BPE merge order)"


def vocab_paths(model_path: str | os.PathLike[str]) -> list[Path]:
    """Where a saved ranking is looked for: beside the model, then in the cache dir."""
    return calibration_paths(model_path, "draft-vocab", SUFFIX)


def ranking(counts: Mapping[int, int] | None, n_vocab: int) -> np.ndarray:
    """All token ids, best first: by count (descending, ties by id), then the unseen ones in id order."""
    score = np.zeros(n_vocab, np.int64)
    for i, c in (counts or {}).items():
        score[int(i)] = int(c)
    return np.lexsort((np.arange(n_vocab), -score)).astype(np.int32)


def load_ranking(model_path: str | os.PathLike[str], n_vocab: int) -> tuple[np.ndarray, str]:
    """(ranking, source): the saved calibration's, else the fallback (token id order). A file is parsed
    once per version (its path, mtime and size), not on every generate call."""
    for p in vocab_paths(model_path):
        if p.exists():
            st = p.stat()
            return _file_ranking(str(p), st.st_mtime_ns, st.st_size, n_vocab), str(p)
    return np.arange(n_vocab, dtype=np.int32), FALLBACK


@functools.lru_cache(maxsize=8)
def _file_ranking(path: str, mtime_ns: int, size: int, n_vocab: int) -> np.ndarray:
    """The ranking in a saved file (read-only; mtime_ns and size key the cache: a rewritten file is read
    again)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        counts = {int(i): int(c) for i, c in data["counts"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"draft vocabulary file {p}: {e}") from None
    if any(not 0 <= i < n_vocab for i in counts):
        raise InputError(f"draft vocabulary file {p}: token ids outside [0, {n_vocab})")
    rank = ranking(counts, n_vocab)
    rank.setflags(write=False)
    return rank


def save(counts: Mapping[int, int], model_path: str | os.PathLike[str], tokens: int,
         path: str | os.PathLike[str] | None = None) -> Path:
    """Write the counts beside the model (or the cache dir when that is not writable)."""
    data = {"format": FORMAT, "model": Path(model_path).name, "tokens": int(tokens),
            "counts": {str(i): int(c) for i, c in sorted(counts.items())}}
    return save_json(data, [Path(path)] if path is not None else vocab_paths(model_path), "the draft vocabulary")


def count_accepted(counts: dict[int, int], target: np.ndarray, draft: np.ndarray) -> None:
    """Adds to `counts` the tokens where the MTP head's full-vocabulary draft equals the target's greedy
    token: target[p - 1] is the target's token at p + 1 and draft[p - 1] the head's (teacher-forced over
    one sequence, `Engine.calibrate_draft_vocab`). A draft vocabulary keeps exactly the accepted drafts
    whose token it holds, so these are the ids worth holding; tokens the head never drafts correctly
    (rare identifiers) count for nothing, where plain output frequency ranked them high."""
    for t in np.asarray(target)[np.asarray(draft) == np.asarray(target)].tolist():
        counts[int(t)] = counts.get(int(t), 0) + 1


def take_rows(w: QTensor, ids: np.ndarray) -> QTensor:
    """Rows `ids` of a 2-D QTensor, in its own layout (a copy: gathered once, not per step)."""
    ids = jnp.asarray(ids, jnp.int32)
    if w.layout == "float_t":
        return QTensor({"w": w.data["w"][:, ids]}, w.qtype, (int(ids.shape[0]), w.cols), w.layout)
    return w.take(ids)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["parts", "ids"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DraftVocab:
    """The draft LM head over N token ids: `parts` (QTensor row blocks, rows = ids in ascending order)
    and `ids` [N] int32 (ascending), so an argmax over the subset maps back by ids[argmax]."""

    parts: tuple
    ids: jax.Array

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def logits(self, h2: jax.Array, rows: jax.Array | int = 1) -> jax.Array:
        """The subset's logits [N] of row 0 of a 2-row bucket h2 [2, D] (in `ids` order); rows=0: row 0 is
        padding too (a finished sequence of a batch)."""
        return self.logits_rows(h2, rows)[0]  # row 1 is padding

    def logits_rows(self, h: jax.Array, rows: jax.Array | int) -> jax.Array:
        """The subset's logits [R, N] of rows h [R >= 2, D] (in `ids` order); only rows [0, rows) are needed
        (the tree drafter's level calls: a beam of rows)."""
        ys = [matmul(h, p, rows=rows) for p in self.parts]
        return ys[0] if len(ys) == 1 else jnp.concatenate(ys, axis=-1)

    def token(self, logits: jax.Array) -> jax.Array:
        """The token id of the subset's argmax (the lowest id on ties, as the full head's argmax)."""
        return self.ids[argmax(logits)].astype(jnp.int32)

    def greedy(self, h2: jax.Array) -> jax.Array:
        """The draft token of row 0 of a 2-row bucket h2 [2, D]: argmax over the subset's logits."""
        return self.token(self.logits(h2))


def build(head_parts: Sequence[QTensor], rank: np.ndarray, n: int) -> DraftVocab:
    """The top-n ids of `rank` gathered from the head's row blocks (`Linear.parts()`), ascending ids."""
    ids = np.sort(np.asarray(rank[:n], np.int32))
    parts, off = [], 0
    for p in head_parts:
        sel = ids[(ids >= off) & (ids < off + p.rows)] - off
        if sel.size:
            parts.append(take_rows(p, sel))
        off += p.rows
    return DraftVocab(tuple(parts), jnp.asarray(ids))
