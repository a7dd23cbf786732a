"""Synthetic GGUF writer: files our reader, gguf's reader and llama.cpp's tensor table accept."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gguf import GGUFReader

from sharpi_jax.config import qwen36_35b_a3b
from sharpi_jax.gguf import GGUFFile, model_tensor_specs, read_model_config
from sharpi_jax.gguf.tokenizer import Tokenizer
from sharpi_jax.testing import write_synthetic_gguf
from tests.conftest import REPO_ROOT, fixture_path


def _fixture_config(name: str):
    with GGUFFile(fixture_path(name, f"{name}-F32.gguf")) as f:
        return read_model_config(f), {t.name: t.shape for t in f}


@pytest.mark.parametrize("name", ["tiny-qwen35moe", "tiny-qwen35", "tiny-qwen3next"])
def test_same_tensor_table_as_llamacpp_converter(tmp_path, name):
    """A synthetic file of a fixture's config has exactly the tensors llama.cpp's converter wrote."""
    config, fixture_shapes = _fixture_config(name)
    p = write_synthetic_gguf(tmp_path / "s.gguf", config, qtype="Q8_0", seed=1)
    with GGUFFile(p) as f:
        assert {t.name: t.shape for t in f} == fixture_shapes
        assert read_model_config(f) == config


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K",
                                   "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"])
def test_every_qtype_roundtrips_and_is_finite(tmp_path, qtype):
    config = qwen36_35b_a3b(n_layer=2).replace(
        n_vocab=512, d_model=256, n_head=2, n_head_kv=1, head_dim=256, n_rot=64, ssm_d_state=64,
        ssm_n_group=2, ssm_dt_rank=4, ssm_d_inner=256, n_expert=4, n_expert_used=2, expert_ff=256,
        shared_expert_ff=256, recurrent_layers=(True, False, False))
    p = write_synthetic_gguf(tmp_path / f"{qtype}.gguf", config, qtype=qtype, seed=3)
    ref = GGUFReader(p)  # gguf's own reader accepts the file
    with GGUFFile(p) as f:
        assert read_model_config(f) == config
        assert f.tensor("blk.0.ffn_gate_exps.weight").qtype.name == qtype
        for t in ref.tensors:
            x = np.asarray(f.dequantize(t.name))
            assert np.isfinite(x).all(), t.name
            if t.name.endswith("_exps.weight"):
                assert 0 < np.std(x) < 1, (t.name, np.std(x))
        tok = Tokenizer.from_gguf_fields(f.metadata)
        assert tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x):\n    return x"


def test_35b_a3b_tensor_shapes_match_spec():
    """Spec sections 0 and 2: the real Qwen3.6-35B-A3B shapes (numpy order = reversed ggml ne)."""
    c = qwen36_35b_a3b(n_layer=40)
    specs = {s.name: s.shape for s in model_tensor_specs(c)}
    assert c.n_layer == 40 and c.n_layer_all == 41 and c.conv_dim == 8192
    assert specs["token_embd.weight"] == (248320, 2048)
    assert specs["blk.0.attn_qkv.weight"] == (8192, 2048)
    assert specs["blk.0.attn_gate.weight"] == (4096, 2048)
    assert specs["blk.0.ssm_conv1d.weight"] == (8192, 4)
    assert specs["blk.0.ssm_out.weight"] == (2048, 4096)
    assert specs["blk.0.ssm_beta.weight"] == (32, 2048)
    assert specs["blk.3.attn_q.weight"] == (8192, 2048)  # q and gate interleaved: 2*16*256
    assert specs["blk.3.attn_k.weight"] == (512, 2048)
    assert specs["blk.3.attn_output.weight"] == (2048, 4096)
    assert specs["blk.3.ffn_gate_exps.weight"] == (256, 512, 2048)
    assert specs["blk.3.ffn_down_exps.weight"] == (256, 2048, 512)
    assert specs["blk.40.nextn.eh_proj.weight"] == (2048, 4096)
    assert "blk.40.attn_q.weight" in specs and "blk.40.attn_qkv.weight" not in specs
    assert sum(c.recurrent_layers) == 30  # layers 3, 7, ..., 39 are full attention


@pytest.fixture(scope="session")
def big_synthetic(tmp_path_factory):
    """A 35B-A3B-shaped 4-layer (+MTP) Q4_K file (~3 GB on disk), written once per session."""
    path = tmp_path_factory.mktemp("big") / "qwen36-35b-a3b-4L-Q4_K.gguf"
    write_synthetic_gguf(path, qwen36_35b_a3b(n_layer=4), qtype="Q4_K", seed=0)
    return path


def test_35b_shaped_load_is_mmap_not_read(big_synthetic):
    """Opening + validating + viewing every tensor costs header-sized memory, not file-sized."""
    code = textwrap.dedent(f"""
        import json, resource
        import numpy as np
        from sharpi_jax.gguf import GGUFFile, read_model_config
        from sharpi_jax.gguf import quants  # import jax before measuring
        def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        before = rss()
        f = GGUFFile({str(big_synthetic)!r})
        c = read_model_config(f)
        views = [f.raw(t.name) for t in f]
        largest = max(t.nbytes for t in f)
        opened = rss()
        x = f.raw("blk.0.ffn_gate_exps.weight")[7]          # one expert, asked for by the caller
        y = np.asarray(quants.dequantize(x, f.tensor("blk.0.ffn_gate_exps.weight").qtype, (512, 2048)))
        done = rss()
        print(json.dumps(dict(before=before, opened=opened, done=done, largest=largest, file=f.file_size,
                              materialized=x.nbytes + y.nbytes, n_layer=c.n_layer)))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["n_layer"] == 4 and m["file"] > 2_500_000_000
    # Header (248k-token vocab as Python strings) costs tens of MB; tensor data is never read.
    assert m["opened"] - m["before"] < 128 * 2**20, m
    assert m["opened"] - m["before"] < m["largest"], m
    # Materializing one dequantized expert costs about that expert, plus jit scratch.
    assert m["done"] - m["before"] <= m["largest"] + m["materialized"] + 128 * 2**20, m
