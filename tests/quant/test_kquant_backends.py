"""kernels='pallas' on a K-quant mix: no silent fallback, and a whole decode step of a small Q4_K_M-like
model (Q4_K, Q5_K, Q6_K and Q8_0 matrices) lowers for CUDA with every matrix on the Pallas kernels.

The model is synthetic (random valid blocks) with dimensions of 256 so that K-quants fit, and the type
mix of llama-quantize's Q4_K_M on the 35B-A3B-shaped slice (WORKSPACE, "Type mix of K-quant files"):
Q6_K LM head, attn_v and ffn_down_exps, Q4_K elsewhere, plus Q5_K (as in Q5_K_M files) and Q8_0
matrices (rows of 128: the writer falls back to Q8_0, as llama-quantize does).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import sharpi_jax as sj
from sharpi_jax.config import tiny_qwen35moe
from sharpi_jax.gguf.reader import GGUFFile
from sharpi_jax.model.footprint import backend_summary, matrix_backends
from sharpi_jax.quant import MatrixFormat, ggml
from sharpi_jax.testing import write_synthetic_gguf
from tests.conftest import fixture_path
from tests.cuda_lowering import decode_step_cuda_text

MIX = (("output.weight", "Q6_K"), ("attn_v", "Q6_K"), ("ffn_down_exps", "Q6_K"), ("ssm_out", "Q5_K"),
       ("ffn_up_shexp", "Q5_K"), ("ssm_alpha", "Q8_0"), ("ssm_beta", "Q8_0"))


@pytest.fixture(scope="module")
def mix_path(tmp_path_factory):
    c = tiny_qwen35moe(n_layer=4).replace(d_model=256, ssm_d_state=64, ssm_d_inner=256, expert_ff=256,
                                        shared_expert_ff=256)
    return write_synthetic_gguf(tmp_path_factory.mktemp("kmix") / "kmix-Q4_K_M.gguf", c, "Q4_K",
                                type_overrides=MIX)


def test_the_registry_decides_in_one_place():
    """`MatrixFormat.backend_for` (`registry.serving`) holds each tensor, `why_not` says why it falls back."""
    from gguf import GGMLQuantizationType as T

    pal = MatrixFormat("pallas", None)
    for t in (T.F32, T.F16, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K):
        assert pal.backend_for(t, (257, 2048)) == "pallas"  # dense rows are padded: any N tiles
        assert pal.why_not(t, (257, 2048)) is None
    assert pal.backend_for(T.Q5_0, (64, 128)) == "reference"
    assert "Q5_0 has no Pallas kernel" in pal.why_not(T.Q5_0, (64, 128))
    assert pal.backend_for(T.Q4_K, (8, 48, 256)) == "reference"  # one expert's N must tile
    assert "48x256 does not tile" in pal.why_not(T.Q4_K, (8, 48, 256))
    assert pal.backend_for(T.Q4_K, (8, 512, 2048)) == "pallas"
    assert pal.layout(T.Q6_K, (8, 512, 2048)) == "kernel"
    assert MatrixFormat("xla", None).backend_for(T.Q5_0, (64, 128)) == "xla"
    assert MatrixFormat("reference", None).why_not(T.Q6_K, (8, 256)) is None


@pytest.mark.skipif(not ggml.available(), reason="ggml's native extension is not built")
def test_ggml_names_why_a_k_quant_row_falls_back():
    """ggml multiplies whole blocks: a K-quant row of 384 (not a multiple of 256) falls back to xla."""
    from gguf import GGMLQuantizationType as T

    g = MatrixFormat("ggml", None)
    assert g.backend_for(T.Q4_K, (64, 512)) == "ggml" and g.why_not(T.Q4_K, (64, 512)) is None
    assert g.backend_for(T.Q4_K, (64, 384)) == "xla"
    assert g.why_not(T.Q4_K, (64, 384)) == "row length 384 is not a multiple of the Q4_K block (256)"


def test_the_mix_holds_every_k_quant_type(mix_path):
    types = {t.qtype.name for t in GGUFFile(mix_path).tensors.values()}
    assert {"Q4_K", "Q5_K", "Q6_K", "Q8_0"} <= types


def test_no_fallback_left_and_the_decode_step_lowers_for_cuda(mix_path, monkeypatch):
    """Every matrix of the Q4_K_M-like model runs on the Pallas kernels (recorded backends; no warning),
    and the whole jitted decode step lowers for CUDA with a Triton kernel per type."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warning would fail here
        e = sj.load(mix_path, max_context=64, prefill_buckets=(16,), kernels="pallas")
    kinds = {v["type"] for v in e.matrix_backends.values()}
    assert {"Q4_K", "Q5_K", "Q6_K", "Q8_0"} <= kinds
    assert backend_summary(e.matrix_backends) == {"pallas": len(e.matrix_backends)}
    assert all(v["why"] is None for v in e.matrix_backends.values())
    assert any(k.endswith("experts.down") and v["type"] == "Q6_K" for k, v in e.matrix_backends.items())
    text = decode_step_cuda_text(e, monkeypatch)
    assert "__gpu$xla.gpu.triton" in text
    for t in ("q4_k", "q5_k", "q6_k", "q8_0", "f32"):
        assert f"grouped_matmul_{t}" in text, t


@pytest.mark.slow
def test_mix_pallas_logits_match_the_reference(mix_path):
    """Interpret mode: the kernels' K order (32-column steps) differs from XLA's dot, so a bound."""
    toks = [5, 17, 300, 42]
    a = sj.load(mix_path, max_context=64, prefill_buckets=(16,), kernels="pallas").logits(toks)
    b = sj.load(mix_path, max_context=64, prefill_buckets=(16,), kernels="reference").logits(toks)
    assert float(np.linalg.norm(a - b) / np.linalg.norm(b)) <= 1e-5


def test_fallback_is_named_once_and_recorded():
    """tiny-qwen35moe Q4_K_M holds Q5_0 matrices (rows of 128 do not fit K-quants): kernels='pallas'
    says so in one warning naming tensor and type, and the recorded backends say "reference" with why."""
    path = fixture_path("tiny-qwen35moe", "tiny-qwen35moe-Q4_K_M.gguf")
    with pytest.warns(UserWarning) as record:
        e = sj.load(path, max_context=64, prefill_buckets=(16,), kernels="pallas")
    msgs = [str(w.message) for w in record if "matrices fall back" in str(w.message)]
    assert len(msgs) == 1
    assert "layers.0.mixer.w_in.w (Q5_0 392x128 on reference: ggml type Q5_0 has no Pallas kernel)" in msgs[0]
    off = {k: v for k, v in e.matrix_backends.items() if v["backend"] != "pallas"}
    assert off and all(v["backend"] == "reference" for v in off.values())
    assert all(v["type"] == "Q5_0" or "fall back (one grouped op)" in v["why"] for v in off.values())
    on = {k for k, v in e.matrix_backends.items() if v["backend"] == "pallas"}
    assert "lm_head.w" in on  # (Q8_0 here)
    assert matrix_backends(e.model, "pallas") == {k: v for k, v in e.matrix_backends.items()}


def test_generate_stats_record_the_backends():
    path = fixture_path("tiny-qwen35moe", "tiny-qwen35moe-Q8_0.gguf")
    e = sj.load(path, max_context=64, prefill_buckets=(16,), kernels="xla")
    out = e.generate([5, 17, 300], max_new_tokens=1)
    assert out.stats.backends.counts == {"xla": len(e.matrix_backends)}
    assert out.stats.backends.matrices["lm_head.w"] == "xla"
    assert set(out.stats.backends.matrices) == set(e.matrix_backends)


@pytest.mark.parametrize("kernels", ["xla", "reference"])
def test_other_backends_serve_every_matrix_without_a_warning(kernels):
    path = fixture_path("tiny-qwen35moe", "tiny-qwen35moe-Q4_K_M.gguf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        e = sj.load(path, max_context=64, prefill_buckets=(16,), kernels=kernels)
    assert backend_summary(e.matrix_backends) == {kernels: len(e.matrix_backends)}


def test_type_overrides_match_whole_name_fields():
    """gpu_check's Q4_K_M mix names 7 tensors of the 4-layer slice (the measured llama-quantize Q4_K_M
    choice): "output.weight" must not catch blk.N.attn_output.weight, "blk.2.ffn_down_exps" only that."""
    from gguf import GGMLQuantizationType as T

    from sharpi_jax.config import shape_preset
    from sharpi_jax.gguf.writer import model_tensor_plan
    from sharpi_jax.testing.synthetic import _override

    from experiments.presets import Q4_K_M_MIX_4L as mix

    plan = [(s.name, _override(s, t, mix)) for s, t in model_tensor_plan(shape_preset("qwen36-35b-a3b", 4), T.Q4_K)]
    assert sorted(n for n, t in plan if t == T.Q6_K) == sorted(
        ["output.weight", "blk.2.attn_qkv.weight", "blk.2.ffn_down_exps.weight", "blk.2.ffn_down_shexp.weight",
         "blk.4.attn_v.weight", "blk.4.ffn_down_exps.weight", "blk.4.ffn_down_shexp.weight"])
    assert {t for n, t in plan if t != T.Q6_K} == {T.Q4_K, T.F32}


@pytest.mark.skipif(not ggml.available(), reason="ggml's native extension is not built")
def test_ggml_fallback_is_named_once_and_recorded(monkeypatch):
    """The warning is not Pallas's alone: kernels='ggml' on a build without Q5_0 (SERVED_TYPES narrowed
    here) holds the Q5_0 matrices on "xla" and says so once, naming them."""
    from gguf import GGMLQuantizationType as T

    monkeypatch.setattr(ggml, "SERVED_TYPES", ggml.SERVED_TYPES - {T.Q5_0})
    path = fixture_path("tiny-qwen35moe", "tiny-qwen35moe-Q4_K_M.gguf")
    with pytest.warns(UserWarning) as record:
        e = sj.load(path, max_context=64, prefill_buckets=(16,), kernels="ggml")
    msgs = [str(w.message) for w in record if "matrices fall back" in str(w.message)]
    assert len(msgs) == 1 and msgs[0].count("ggml has no CPU kernel for ggml type Q5_0") >= 1
    assert "layers.0.mixer.w_in.w (Q5_0 392x128 on xla: ggml has no CPU kernel for ggml type Q5_0)" in msgs[0]
    off = {k: v for k, v in e.matrix_backends.items() if v["backend"] != "ggml"}
    assert off and all(v["backend"] == "xla" for v in off.values())
    assert all(v["type"] == "Q5_0" or "fall back (one grouped op)" in v["why"] for v in off.values())
    assert backend_summary(e.matrix_backends)["ggml"] == len(e.matrix_backends) - len(off)
