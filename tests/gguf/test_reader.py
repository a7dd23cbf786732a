"""GGUFFile: metadata and zero-copy tensor views vs gguf.GGUFReader; clear errors on bad files."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from sharpi_jax.config import ModelConfig
from sharpi_jax.errors import GGUFError, UnsupportedArchitectureError, UnsupportedQuantError
from sharpi_jax.gguf import GGUFFile, read_model_config
from tests.bitwise import assert_bitwise_equal
from tests.conftest import FIXTURES, fixture_path

ALL_FIXTURE_GGUFS = sorted(FIXTURES.glob("*/*.gguf")) if FIXTURES.exists() else []
TINY_Q4 = ("tiny-qwen35moe", "tiny-qwen35moe-Q4_K_M.gguf")


@pytest.mark.parametrize("path", ALL_FIXTURE_GGUFS, ids=lambda p: p.name)
def test_tensor_views_equal_gguf_reader(path: Path):
    ref = GGUFReader(path)
    with GGUFFile(path) as f:
        assert len(f.tensors) == len(ref.tensors)
        for t in ref.tensors:
            info = f.tensor(t.name)
            assert info.qtype == t.tensor_type
            assert info.shape == tuple(int(d) for d in reversed(t.shape))
            view = f.raw(t.name)
            assert not view.flags.writeable and not view.flags.owndata  # zero-copy, read-only
            assert_bitwise_equal(view.reshape(-1), t.data.view(np.uint8).reshape(-1))
        # f.dequantize is gguf.quants bit for bit (every tensor of every file: tests/gguf/test_quants.py;
        # here the wrapper, on the file's largest tensor).
        big = max(ref.tensors, key=lambda t: int(t.n_bytes))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            want = np.asarray(gguf.quants.dequantize(big.data, big.tensor_type), np.float32)
        assert_bitwise_equal(np.asarray(f.dequantize(big.name)), want.reshape(f.tensor(big.name).shape), big.name)
        for key, field in ref.fields.items():
            if key.startswith("GGUF."):
                continue
            ours = f.metadata[key]
            theirs = field.contents()
            if isinstance(theirs, float):
                assert np.float32(ours) == np.float32(theirs), key
            else:
                assert ours == theirs, key


@pytest.mark.parametrize("path", ALL_FIXTURE_GGUFS, ids=lambda p: p.name)
def test_model_config_from_fixtures(path: Path):
    with GGUFFile(path) as f:
        c = read_model_config(f)
    hf_path = path.parent / "hf-config.json"
    if path.parent.name == "quant-zoo":
        assert c.n_layer == 2 and c.recurrent_layers == (True, False)
        return
    import json

    hf = json.loads(hf_path.read_text())
    assert c.arch == {"tiny-qwen35moe": "qwen35moe", "tiny-qwen35": "qwen35", "tiny-qwen3next": "qwen3next"}[
        path.parent.name]
    assert c.n_layer == hf["num_hidden_layers"] and c.n_nextn == hf.get("mtp_num_hidden_layers", 1)
    assert c.d_model == hf["hidden_size"] and c.n_vocab == hf["vocab_size"]
    assert c.recurrent_layers[: c.n_layer] == tuple(t == "linear_attention" for t in hf["layer_types"])
    assert c.recurrent_layers[c.n_layer:] == (False,) * c.n_nextn
    assert (c.n_head, c.n_head_kv, c.head_dim) == (hf["num_attention_heads"], hf["num_key_value_heads"],
                                                   hf["head_dim"])
    rope = hf.get("rope_parameters", hf)
    assert c.n_rot == int(hf["head_dim"] * rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1)))
    assert (c.ssm_n_group, c.ssm_dt_rank, c.ssm_d_state) == (hf["linear_num_key_heads"],
                                                             hf["linear_num_value_heads"], hf["linear_key_head_dim"])
    assert c.gdn_head_pairing == ("grouped" if c.arch == "qwen3next" else "tiled")
    if c.is_moe:
        assert (c.n_expert, c.n_expert_used, c.expert_ff, c.shared_expert_ff) == (
            hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"],
            hf["shared_expert_intermediate_size"])
    else:
        assert c.dense_ff == hf["intermediate_size"]
    assert c.tied_embeddings == hf.get("tie_word_embeddings", False)


def test_full_attention_interval_fallback():
    md = {k: v for k, v in _tiny_metadata().items() if not k.endswith("attention.recurrent_layers")}
    md["qwen35moe.full_attention_interval"] = 2
    c = ModelConfig.from_metadata(md)
    assert c.recurrent_layers == (True, False, True, False, False)  # MTP block (index 4) never recurrent


def _tiny_metadata() -> dict:
    with GGUFFile(fixture_path(*TINY_Q4)) as f:
        return dict(f.metadata)


def _patched(tmp_path: Path, transform, name: str = "patched.gguf") -> Path:
    data = bytearray(fixture_path(*TINY_Q4).read_bytes())
    data = transform(data)
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return out


def _kv_value_offset(data: bytearray, key: str) -> int:
    """Offset of the value of a scalar metadata entry (after its key and type)."""
    needle = struct.pack("<Q", len(key)) + key.encode()
    i = bytes(data).index(needle)
    return i + len(needle) + 4


def test_truncated_file(tmp_path):
    src = fixture_path(*TINY_Q4).read_bytes()
    with GGUFFile(fixture_path(*TINY_Q4)) as f:
        data_offset, last = f.data_offset, max(t.offset + t.nbytes for t in f)
    for cut in (10, 200, data_offset - 3, last - 1):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(src[:cut])
        with pytest.raises(GGUFError, match="truncated|too small") as e:
            GGUFFile(p)
        assert str(p) in str(e.value)


def test_wrong_magic(tmp_path):
    p = _patched(tmp_path, lambda d: b"GGML" + d[4:])
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(p)


def test_unknown_architecture(tmp_path):
    p = _patched(tmp_path, lambda d: bytearray(bytes(d).replace(b"qwen35moe", b"qwen99moe")))
    with GGUFFile(p) as f, pytest.raises(UnsupportedArchitectureError, match="'qwen99moe' is not supported"):
        read_model_config(f)


def test_missing_required_key(tmp_path):
    key = b"qwen35moe.ssm.conv_kernel"
    p = _patched(tmp_path, lambda d: bytearray(bytes(d).replace(key, b"qwen35moe.ssm.conv_kernex")))
    with GGUFFile(p) as f, pytest.raises(GGUFError, match="missing required key 'qwen35moe.ssm.conv_kernel'"):
        read_model_config(f)


def test_shape_contradicts_metadata(tmp_path):
    def halve_expert_ff(d):
        off = _kv_value_offset(d, "qwen35moe.expert_feed_forward_length")
        assert struct.unpack_from("<I", d, off)[0] == 64
        struct.pack_into("<I", d, off, 32)
        return d

    p = _patched(tmp_path, halve_expert_ff)
    with GGUFFile(p) as f, pytest.raises(GGUFError, match=r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape"):
        read_model_config(f)


def test_missing_tensor(tmp_path):
    p = _patched(tmp_path, lambda d: bytearray(bytes(d).replace(b"blk.1.ssm_out.weight", b"blk.1.ssm_xxx.weight")))
    with GGUFFile(p) as f, pytest.raises(GGUFError, match=r"missing required tensor 'blk\.1\.ssm_out\.weight'"):
        read_model_config(f)


def test_unknown_tensor_type_id(tmp_path):
    def set_type(d):
        name = b"output_norm.weight"
        i = bytes(d).index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
        n_dims = struct.unpack_from("<I", d, i)[0]
        struct.pack_into("<I", d, i + 4 + 8 * n_dims, 99)
        return d

    with pytest.raises(UnsupportedQuantError, match=r"'output_norm\.weight' has unknown ggml type id 99"):
        GGUFFile(_patched(tmp_path, set_type))


def test_unsupported_quant_type_names_it(tmp_path):
    p = tmp_path / "q8k.gguf"
    w = GGUFWriter(p, "qwen35moe")
    raw = np.zeros((4, 292), dtype=np.uint8)  # one Q8_K block (292 bytes / 256 values) per row
    w.add_tensor("blk.0.weird.weight", raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.Q8_K)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with GGUFFile(p) as f:
        assert f.tensor("blk.0.weird.weight").shape == (4, 256)
        with pytest.raises(UnsupportedQuantError, match="Q8_K"):
            f.dequantize("blk.0.weird.weight")


def test_huge_counts_are_rejected_without_allocating(tmp_path):
    def huge_kv_count(d):
        struct.pack_into("<Q", d, 16, 2**62)
        return d

    with pytest.raises(GGUFError, match="more than the file can hold"):
        GGUFFile(_patched(tmp_path, huge_kv_count))


def test_not_a_file(tmp_path):
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile(tmp_path / "nope.gguf")
