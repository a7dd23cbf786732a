"""Split GGUFs: a model re-written by gguf-py's writer into 2 and 3 parts loads to the same logits, bit
for bit, as the one file; a missing, extra, renamed, mismatched or truncated part is a one-line
GGUFError naming the part."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

import sharpi_jax as sj
from sharpi_jax.errors import GGUFError
from sharpi_jax.gguf import GGUFFile
from tests.bitwise import assert_bitwise_equal
from tests.conftest import fixture_path

MODEL = ("tiny-qwen35moe", "tiny-qwen35moe-Q8_0.gguf")
PROMPT = [151, 11, 1879, 0, 576, 397, 1387, 38, 342]  # any in-vocabulary ids (2048 here)


def write_split(src: Path, out: Path, n_parts: int) -> list[Path]:
    """Re-write `src` with gguf-py's GGUFWriter split into `n_parts` parts (its split_max_tensors
    support: split.no / split.count / split.tensors.count, gguf-split's names). Returns the part paths."""
    reader = gguf.GGUFReader(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    with GGUFFile(src) as f:
        names = list(f.tensors)
        w = gguf.GGUFWriter(out, f.architecture, split_max_tensors=math.ceil(len(names) / n_parts))
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue  # the header's own counts; the writer adds the architecture
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub)
        for name in names:
            t = f.tensor(name)
            w.add_tensor(name, np.array(f.raw(name)), raw_shape=f.raw(name).shape, raw_dtype=t.qtype)
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    parts = sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
    assert len(parts) == n_parts and parts[0].name == f"{out.stem}-00001-of-{n_parts:05d}.gguf"
    return parts


@pytest.fixture(scope="module")
def one_file():
    path = fixture_path(*MODEL)
    return path, sj.load(path, max_context=64).logits(PROMPT)


@pytest.mark.parametrize("n_parts, open_part", [(2, 0), (3, 2)])
def test_split_loads_bitwise_like_one_file(tmp_path, one_file, n_parts, open_part):
    path, want = one_file
    parts = write_split(path, tmp_path / "model.gguf", n_parts)
    with GGUFFile(path) as whole, GGUFFile(parts[open_part]) as f:
        assert f.parts == [str(p) for p in parts] and f.metadata["split.count"] == n_parts
        assert {t.part for t in f} == set(range(n_parts))  # every part holds tensors
        assert list(f.tensors) == list(whole.tensors)
        for name, t in whole.tensors.items():
            assert (f.tensor(name).qtype, f.tensor(name).shape) == (t.qtype, t.shape)
            assert np.array_equal(f.raw(name), whole.raw(name)), name
            off = f.offset_of(f.raw(name))  # offsets run over the parts end to end
            assert off - sum(p.stat().st_size for p in parts[:f.tensor(name).part]) == f.tensor(name).offset
            f.advise_willneed(off, f.tensor(name).nbytes)  # the streamer's prefetch lands in the right part
        assert {k: v for k, v in f.metadata.items() if not k.startswith("split.")} == whole.metadata
    assert_bitwise_equal(sj.load(parts[open_part], max_context=64).logits(PROMPT), want)


@pytest.mark.slow
def test_split_streams_cold_experts_bitwise(tmp_path, one_file):
    """Expert residency on a split file: cold experts streamed (and prefetched) from every part's mmap."""
    path, want = one_file
    parts = write_split(path, tmp_path / "model.gguf", 3)
    engine = sj.load(parts[1], max_context=64, expert_budget="25%", expert_policy="lru")
    assert_bitwise_equal(engine.logits(PROMPT), want)
    assert engine.generate(PROMPT, max_new_tokens=4).stats.experts["bytes_streamed"] > 0


@pytest.fixture
def three_parts(tmp_path):
    return write_split(fixture_path(*MODEL), tmp_path / "model.gguf", 3)


def _one_line_error(path: Path, match: str) -> str:
    with pytest.raises(GGUFError, match=match) as e:
        GGUFFile(path).close()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_missing_part(three_parts):
    three_parts[1].unlink()
    msg = _one_line_error(three_parts[0], "part 2 of the 3-part split GGUF is missing")
    assert msg.startswith(str(three_parts[1]))
    _one_line_error(three_parts[2], "part 2 of the 3-part split GGUF is missing")


def test_renamed_parts(three_parts):
    a, b, c = three_parts
    away = b.rename(b.with_name("model-part2.gguf"))  # renamed away: missing
    _one_line_error(a, r"model-00002-of-00003\.gguf: part 2 of the 3-part split GGUF is missing")
    c.rename(b), away.rename(c)  # parts 2 and 3 swapped: the headers disagree with the names
    _one_line_error(a, r"model-00002-of-00003\.gguf: its header says part 3 of 3.*named part 2 of 3")
    _one_line_error(b, r"model-00002-of-00003\.gguf: the name says part 2 of 3, the header says part 3 of 3")
    plain = b.rename(b.with_name("model.gguf"))  # a part opened under a plain name
    _one_line_error(plain, r"model\.gguf: part of a 3-part split GGUF.*its name is not")


def test_truncated_part(three_parts):
    p = three_parts[2]
    p.write_bytes(p.read_bytes()[:-100])
    _one_line_error(three_parts[0], rf"^{p}: truncated: tensor")


def test_extra_parts(three_parts, tmp_path):
    extra = tmp_path / "model-00004-of-00003.gguf"
    shutil.copy(three_parts[2], extra)
    _one_line_error(three_parts[0], rf"^{extra}: an extra part beside the 3-part split")
    extra.unlink()
    other = write_split(fixture_path(*MODEL), tmp_path / "sub" / "model.gguf", 2)  # a 2-part set
    moved = tmp_path / other[0].name
    other[0].rename(moved)
    _one_line_error(three_parts[1], rf"^{moved}: an extra part.*part 1 of 2")


def test_part_from_another_split_is_a_mismatch(three_parts, tmp_path):
    other = write_split(fixture_path(*MODEL), tmp_path / "sub" / "model.gguf", 2)
    # Part 1 of a 2-part set named as part 1 of the 3: header counts disagree with the name.
    shutil.copy(other[0], three_parts[0])
    _one_line_error(three_parts[1], r"model-00001-of-00003\.gguf: its header says part 1 of 2")
