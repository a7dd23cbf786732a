"""The MTP head vs the transformers reference MTP logits, its loading, and row stability.

Figures are printed (run with -s to see them).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharpi_jax.model.weights import load_mtp
from tests.conftest import fixture_engine, fixture_path, load_references

ARCHS = ("tiny-qwen35moe", "tiny-qwen35", "tiny-qwen3next")
MAX_CONTEXT = 512  # as the other fixture tests: compiled steps are shared with them
# Relative L2 bounds vs the F32 transformers reference for quantized files (measured: BF16 1e-3,
# Q8_0 3e-3..6e-3, Q4_K_M 2.2e-2..3e-2; the trunk logits of the same files are as far from it).
QUANT_BOUNDS = {"BF16": 5e-3, "Q8_0": 2e-2, "Q4_K_M": 6e-2}


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
    """engine.mtp_logits (pairs (ids[p], h[p-1]), p = 1..T-1) == transformers' MTP logits, rel L2 <= 1e-4,
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
        assert errs[-1] <= 1e-4, f"prompt {i}: {errs[-1]}"
    llama_conv = rel_l2(e.mtp_logits(ref["variants"][f"{name}-F32"]["tokens"][0], zero_h_first=True), z["mtp_logits_0"])
    assert llama_conv > 1e-3
    print(f"{name}: MTP logits rel L2 per prompt {', '.join(f'{x:.1e}' for x in errs)}; "
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
    print(f"{name}-{variant}: MTP logits rel L2 {', '.join(f'{x:.1e}' for x in errs)}")
    assert max(errs) <= QUANT_BOUNDS[variant]


def test_mtp_shares_trunk_arrays():
    """The head uses the trunk's embedding and LM head arrays (no copies) and its own norms/projection."""
    e = engine("tiny-qwen35moe", "F32")
    h = load_mtp(e.gguf, e.config, e.model, e.experts)
    assert h.embed.raw[...] is e.model.embed.raw[...]
    assert h.lm_head.w[...] is e.model.lm_head.w[...]
    p = f"blk.{e.config.mtp_layer}"
    np.testing.assert_array_equal(np.asarray(h.shared_head_norm.weight[...]),
                                  e.gguf.array(f"{p}.nextn.shared_head_norm.weight"))
    np.testing.assert_array_equal(np.asarray(h.eh_proj.w[...]), e.gguf.array(f"{p}.nextn.eh_proj.weight").T)
    standalone = load_mtp(e.gguf, e.config, experts=e.experts)  # no trunk: loaded from the file, same values
    chex.assert_trees_all_equal(np.asarray(standalone.lm_head.w[...]), np.asarray(h.lm_head.w[...]))


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
    many, cache_many = mtp.rows(mtp.new_cache(), toks, hs, 0, 9)
    cache = mtp.new_cache()
    single = []
    for i, t in enumerate(toks):
        hp, cache = mtp.rows(cache, [t, t], jnp.stack([hs[i], hs[i]]), i, 1)
        single.append(np.asarray(hp[0]))
    chex.assert_trees_all_equal(np.asarray(many), np.stack(single))
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, cache_many), jax.tree.map(np.asarray, cache))
