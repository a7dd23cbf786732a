"""Kernel backends through `sj.load(kernels=..., repack=...)` on a fixture model: every matrix in its GGUF
encoding, the Pallas kernels reachable (interpret mode on CPU), and what each backend promises."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import sharpi_jax as sj
from sharpi_jax.errors import InputError
from sharpi_jax.model.footprint import decode_floor_bytes, decode_read_bytes, held_bytes
from sharpi_jax.quant import QTensor
from tests.bitwise import assert_bitwise_equal
from tests.conftest import fixture_path, load_references
from tests.cuda_lowering import decode_step_cuda_text

NAME, VARIANT = "tiny-qwen35moe", "Q8_0"


def _load(**kw):
    return sj.load(fixture_path(NAME, f"{NAME}-{VARIANT}.gguf"), max_context=64, prefill_buckets=(32,), **kw)


def _prompt(n=12):
    return load_references(NAME)["variants"][f"{NAME}-{VARIANT}"]["tokens"][0][:n]


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_matrices_keep_their_gguf_encoding():
    e = _load(kernels="xla")
    f = e.gguf
    held = held_bytes(e.model)
    assert set(k for k in held if k.startswith("matrix:")) <= {"matrix:soa", "matrix:blocks", "matrix:float_t"}
    # the LM head is the file's output.weight bytes (Q8_0 here), and the embedding its token_embd bytes
    (head,) = e.model.lm_head.parts()
    assert head.qtype == int(f.tensor("output.weight").qtype) and head.nbytes == f.tensor("output.weight").nbytes
    emb = e.model.embed.table.get_value()
    assert isinstance(emb, QTensor) and emb.nbytes == f.tensor("token_embd.weight").nbytes
    # nothing is held twice: matrices + embedding + experts = their bytes in the file (+ float vectors)
    matrices = sum(v for k, v in held.items() if k.startswith("matrix:"))
    trunk_matrices = sum(t.nbytes for n, t in f.tensors.items()
                         if len(t.shape) == 2 and n != "token_embd.weight" and not n.startswith(f"blk.{e.config.mtp_layer}.")
                         and "_exps." not in n and "ssm_conv1d" not in n)
    assert matrices == trunk_matrices
    floor, ours = decode_floor_bytes(f, e.config), decode_read_bytes(e.model, f, e.config)
    assert floor <= ours <= floor * 1.05  # F32 norms / conv vectors are the only difference


def test_int8_repack_is_explicit_and_stated():
    e = _load(kernels="xla", repack="int8")
    held = held_bytes(e.model)
    assert "matrix:int8" in held and "matrix:soa" not in held and "matrix:blocks" not in held
    (head,) = e.model.lm_head.parts()
    assert head.layout == "int8" and head.nbytes == head.rows * head.cols + 4 * head.rows
    ref = _load(kernels="reference")
    toks = _prompt(24)
    # weights and activations rounded to 1/254 of their row maximum: a bounded, stated loss
    assert rel_l2(e.logits(toks), ref.logits(toks)) <= 2e-2


def test_reference_and_xla_backends_agree():
    toks = _prompt(24)
    a, b = _load(kernels="reference").logits(toks), _load(kernels="xla").logits(toks)
    assert rel_l2(a, b) <= 1e-6


def test_pallas_backend_runs_the_kernels_and_matches_the_reference():
    """kernels='pallas': dense matrices through the grouped-matmul kernel (one group), routed experts
    through the grouped kernel + weighted reduce; interpret mode on CPU. Greedy + MTP (3 drafts, 24
    tokens) == the reference backend's plain greedy tokens."""
    e = _load(kernels="pallas")
    assert {p.layout for p in e.model.lm_head.parts()} == {"kernel"}
    experts = e.model.layers[0].ffn.experts.weights()  # laid out once at load, not inside the step
    assert {(m.layout, m.backend) for m in experts} == {("kernel", "pallas")}
    toks = _prompt(10)
    ref = _load(kernels="reference")
    assert rel_l2(e.logits(toks), ref.logits(toks)) <= 1e-6
    # MTP with 3 drafts over 24 tokens (EOS ignored): verify rows, rollbacks and drafts all run the kernels.
    out = e.generate(toks, max_new_tokens=24, speculative="mtp", draft_tokens=3, stop_on_eos=False)
    assert out.tokens == ref.generate(toks, max_new_tokens=24, stop_on_eos=False).tokens
    assert len(out.tokens) == 24 and 0 < out.stats.speculation.accepted < out.stats.speculation.drafted


def test_pallas_decode_step_lowers_for_triton(monkeypatch):
    """The whole jitted decode step of kernels='pallas' lowers for CUDA with Triton kernels (what a GPU
    runs); tracing as if on a GPU switches the kernels out of interpret mode."""
    text = decode_step_cuda_text(_load(kernels="pallas"), monkeypatch)
    assert "__gpu$xla.gpu.triton" in text and "grouped_matmul_q8_0" in text and "weighted_reduce" in text


def test_bad_backend_options_are_clear_errors():
    with pytest.raises(InputError, match="kernels must be one of"):
        _load(kernels="cuda")
    with pytest.raises(InputError, match="repack"):
        _load(repack="int4")
    with pytest.raises(InputError, match="does not combine"):
        _load(kernels="pallas", repack="int8")


@pytest.mark.parametrize("name", ["tiny-qwen35moe", "tiny-qwen35"])
def test_ggml_skips_bucket_padding_rows(name):
    """kernels="ggml": a verify bucket's padding rows (and decode's second row) are not multiplied (their
    logits are +0.0), and the valid rows keep the bits they have when every row is valid."""
    e = sj.load(fixture_path(name, f"{name}-Q8_0.gguf"), max_context=64, prefill_buckets=(32,), kernels="ggml")
    rt = e.runtime
    prompt = load_references(name)["variants"][f"{name}-Q8_0"]["tokens"][0][:10]
    _, _, state = rt.prefill(rt.new_state(), prompt)
    tokens = np.asarray(prompt[:5], np.int32)
    full, full_h, _, _ = rt.verify_step(jax.tree.map(jax.numpy.copy, state), tokens, len(prompt))
    part, part_h, _, _ = rt.verify_step(state, tokens, len(prompt), n_valid=2)
    assert_bitwise_equal(np.asarray(part)[:2], np.asarray(full)[:2])
    assert_bitwise_equal(np.asarray(part_h)[:2], np.asarray(full_h)[:2])
    assert_bitwise_equal(np.asarray(part)[2:], np.zeros_like(np.asarray(full)[2:]))
