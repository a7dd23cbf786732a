"""The MTP head vs the transformers reference MTP logits, its loading, and row stability.

Figures are printed (run with -s to see them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharpi_jax.model.weights import load_mtp
from tests.bitwise import assert_bitwise_equal
from tests.conftest import fixture_engine, fixture_path, load_references

ARCHS = ("tiny-qwen35moe", "tiny-qwen35", "tiny-qwen3next")
MAX_CONTEXT = 512  # as the other fixture tests: compiled steps are shared with them
# F32 MTP logits vs transformers, relative L2 per prompt: measured 2.2e-7 .. 3.2e-7 (every architecture);
# the README's bound, 1e-6, leaves 3x.
F32_REL_L2 = 1e-6
# Relative L2 bounds vs the F32 transformers reference for quantized files (weights quantized, so this is
# mostly quantization error; measured maxima over prompts and files: BF16 1.1e-3, Q8_0 6.0e-3, Q4_K_M
# 2.9e-2; the README table has them per file).
QUANT_BOUNDS = {"BF16": 2e-3, "Q8_0": 1e-2, "Q4_K_M": 4e-2}


def engine(name: str, variant: str):
    return fixture_engine(name, variant, MAX_CONTEXT, (32,))


references = load_references


@functools.lru_cache(maxsize=None)
def transformers_npz(name: str):
    return np.load(fixture_path(name, "transformers.npz"))


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", ARCHS)
def test_mtp_logits_match_transformers(name):
    """engine.mtp_logits (pairs (ids[p], h[p-1]), p = 1..T-1) == transformers' MTP logits, rel L2 <= 1e-6,
    every prompt. llama.cpp's extra (ids[0], h = 0) row at MTP position 0 is measurably different."""
    e = engine(name, "F32")
    ref = references(name)
    z = transformers_npz(name)
    errs = []
    for i, toks in enumerate(ref["variants"][f"{name}-F32"]["tokens"]):
        got = e.mtp_logits(toks)
        want = z[f"mtp_logits_{i}"]
        assert got.shape == want.shape == (len(toks) - 1, e.config.n_vocab)
        errs.append(rel_l2(got, want))
        assert errs[-1] <= F32_REL_L2, f"prompt {i}: rel L2 {errs[-1]:.3e} > {F32_REL_L2:.0e}"
    llama_conv = rel_l2(e.mtp_logits(ref["variants"][f"{name}-F32"]["tokens"][0], zero_h_first=True), z["mtp_logits_0"])
    assert llama_conv > 1e-3
    print(f"{name}: MTP logits rel L2 per prompt {', '.join(f'{x:.2e}' for x in errs)}; "
          f"with llama.cpp's (x0, h=0) row: {llama_conv:.1e}")


@pytest.mark.parametrize("name,variant", [("tiny-qwen35moe", "BF16"), ("tiny-qwen35moe", "Q8_0"),
                                          ("tiny-qwen35moe", "Q4_K_M"), ("tiny-qwen35", "Q8_0"),
                                          ("tiny-qwen35", "Q4_K_M"), ("tiny-qwen3next", "Q8_0")])
def test_mtp_logits_quantized(name, variant):
    """Quantized files stay within the quantization error of the F32 reference."""
    e = engine(name, variant)
    z = transformers_npz(name)
    errs = [rel_l2(e.mtp_logits(t), z[f"mtp_logits_{i}"])
            for i, t in enumerate(references(name)["variants"][f"{name}-{variant}"]["tokens"])]
    print(f"{name}-{variant}: MTP logits rel L2 {', '.join(f'{x:.2e}' for x in errs)}")
    assert max(errs) <= QUANT_BOUNDS[variant], f"rel L2 per prompt {errs} > {QUANT_BOUNDS[variant]:.0e}"


def test_mtp_shares_trunk_arrays():
    """The head uses the trunk's embedding and LM head arrays (no copies) and its own norms/projection."""
    e = engine("tiny-qwen35moe", "F32")
    h = load_mtp(e.gguf, e.config, e.model, e.experts)
    same = lambda a, b: all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))  # noqa: E731
    assert same(h.embed.table.get_value(), e.model.embed.table.get_value())
    assert same(h.lm_head.w.get_value(), e.model.lm_head.w.get_value())
    p = f"blk.{e.config.mtp_layer}"
    assert_bitwise_equal(np.asarray(h.shared_head_norm.weight[...]), e.gguf.array(f"{p}.nextn.shared_head_norm.weight"))
    assert_bitwise_equal(np.asarray(h.eh_proj.dequantize()), e.gguf.array(f"{p}.nextn.eh_proj.weight"))
    standalone = load_mtp(e.gguf, e.config, experts=e.experts)  # no trunk: loaded from the file, same bits
    assert_bitwise_equal(standalone.lm_head.dequantize(), h.lm_head.dequantize())


@pytest.mark.parametrize("name", ["tiny-qwen35moe", "tiny-qwen35"])
def test_mtp_rows_are_row_stable(name):
    """A 9-row MTP call (the widest fused catch-up + draft bucket, k = 7) == 9 single-row steps (2-row
    buckets), bit for bit: outputs and the KV cache, for a MoE (grouped experts) and a dense head.

    (Row stability on XLA CPU has a limit: for these shapes some products change kernels at ~50 rows,
    e.g. the attention p.v product at G*T >= 52, so a 32-row bucket is NOT bitwise a 2-row one. The
    speculative paths stay far below it: verify <= 8 rows, draft <= 9.)"""
    e = engine(name, "F32")
    mtp = e.mtp
    toks = references(name)["variants"][f"{name}-F32"]["tokens"][2][:9]
    _, hidden = e.forward(toks)
    hs = jnp.asarray(hidden)
    many, cache_many, _ = mtp.rows(mtp.new_cache(), toks, hs, 0, 9)
    cache = mtp.new_cache()
    single = []
    for i, t in enumerate(toks):
        hp, cache, _ = mtp.rows(cache, [t, t], jnp.stack([hs[i], hs[i]]), i, 1)
        single.append(np.asarray(hp[0]))
    assert_bitwise_equal(np.asarray(many), np.stack(single))
    assert_bitwise_equal(cache_many, cache)
