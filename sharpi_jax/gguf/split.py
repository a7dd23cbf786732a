"""Split GGUFs (`NAME-00001-of-0000N.gguf`, written by llama.cpp's gguf-split or gguf-py's writer).

Each part is a complete GGUF holding its own tensors' data; the first carries the model's metadata,
every part carries `split.no` (0-based), `split.count` and `split.tensors.count`. This module finds the
parts of a set from any one of them and checks them against each other; `GGUFFile` opens them.
Every problem is a one-line `GGUFError` naming the part.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from sharpi_jax.errors import GGUFError

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_PARTS = 99999  # the name format's 5 digits


def part_name(prefix: str, no: int, count: int) -> str:
    """gguf-split's file name of part `no` (1-based) of `count`."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def split_count(metadata: dict[str, Any], source: str) -> int:
    """The file's `split.count` (1 when absent), checked to be an integer in [1, 99999]."""
    n = metadata.get(SPLIT_COUNT, 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PARTS:
        raise GGUFError(f"{source}: metadata {SPLIT_COUNT!r} = {n!r} is not a part count in 1..{MAX_PARTS}")
    return n


def part_paths(path: Path, metadata: dict[str, Any]) -> list[Path]:
    """The paths of every part of the split set `path` belongs to, first to last (checked against its
    name and header: the name must be gguf-split's and agree with `split.no` / `split.count`), after
    making sure no part is missing and no part of another count or beyond the last sits beside them."""
    source = str(path)
    count = split_count(metadata, source)
    m = _NAME.match(path.name)
    if m is None:
        raise GGUFError(f"{source}: part of a {count}-part split GGUF (split.count), but its name is not "
                        f"NAME-0000k-of-{count:05d}.gguf, so the other parts cannot be found")
    no = _split_no(metadata, count, source)
    if int(m["count"]) != count or int(m["no"]) != no + 1:
        raise GGUFError(f"{source}: the name says part {int(m['no'])} of {int(m['count'])}, the header says "
                        f"part {no + 1} of {count} (split.no = {no}, split.count = {count}): a renamed part?")
    prefix = m["prefix"]
    paths = [path.with_name(part_name(prefix, i + 1, count)) for i in range(count)]
    for i, p in enumerate(paths):
        if not p.exists():
            raise GGUFError(f"{p}: part {i + 1} of the {count}-part split GGUF is missing")
    for other in sorted(path.parent.glob(f"{_glob_escape(prefix)}-?????-of-?????.gguf")):
        o = _NAME.match(other.name)
        if o and o["prefix"] == prefix and other not in paths:
            raise GGUFError(f"{other}: an extra part beside the {count}-part split GGUF {paths[0].name} "
                            f"(part {int(o['no'])} of {int(o['count'])}); remove or move it")
    return paths


def check_part(metadata: dict[str, Any], index: int, count: int, source: str) -> None:
    """Part `index` (0-based) of `count` must say so in its header."""
    n = split_count(metadata, source)
    no = _split_no(metadata, n, source)
    if n != count or no != index:
        raise GGUFError(f"{source}: its header says part {no + 1} of {n} (split.no, split.count), but it is "
                        f"named part {index + 1} of {count}: a mismatched or renamed part")


def check_tensor_count(metadata: dict[str, Any], n_tensors: int, sources: Sequence[str]) -> None:
    """The first part's `split.tensors.count` must equal the tensors found in all parts together."""
    want = metadata.get(SPLIT_TENSORS)
    if want is None:
        raise GGUFError(f"{sources[0]}: split GGUF without {SPLIT_TENSORS!r}")
    if isinstance(want, bool) or not isinstance(want, int) or want != n_tensors:
        raise GGUFError(f"{sources[0]}: {SPLIT_TENSORS} = {want!r} but its {len(sources)} parts hold "
                        f"{n_tensors} tensors: a part is stale or from another split")


def _split_no(metadata: dict[str, Any], count: int, source: str) -> int:
    no = metadata.get(SPLIT_NO)
    if isinstance(no, bool) or not isinstance(no, int) or not 0 <= no < count:
        raise GGUFError(f"{source}: metadata {SPLIT_NO!r} = {no!r} is not a part index in 0..{count - 1}")
    return no


def _glob_escape(s: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", s)
