"""RunConfig: a frozen, validated run configuration threaded from `sj.load` to the modules."""

from __future__ import annotations

import dataclasses

import chex
import numpy as np
import pytest

import sharpi_jax as sj
from sharpi_jax.config import RunConfig
from sharpi_jax.errors import InputError

PROMPT = "import os\nimport sys\n\n\nclass "


def test_defaults_and_normalisation():
    run = RunConfig(prefill_buckets=[256, 128, 32, 32])
    assert run.prefill_buckets == (32, 128, 256) and run == RunConfig()
    assert hash(run) == hash(RunConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.expert_mode = "per_token"  # type: ignore[misc]
    assert run.replace(row_kernel=None, gdn_chunk=16) == RunConfig(gdn_chunk=16)


@pytest.mark.parametrize("field,bad", [("expert_mode", "pallax"), ("row_kernel", "gemx"), ("prefill_buckets", ()),
                                       ("prefill_buckets", (0, 32)), ("prefill_buckets", 32), ("gdn_chunk", 0),
                                       ("gdn_chunk", True)])
def test_bad_values_are_named(field, bad):
    with pytest.raises(InputError, match=field):
        RunConfig(**{field: bad})
    with pytest.raises(InputError, match=field):
        sj.load(max_context=64, **{field: bad})


def test_gdn_solve_is_validated():
    assert RunConfig(gdn_solve="inverse").gdn_solve == "inverse" and RunConfig().gdn_solve == "substitution"
    with pytest.raises(InputError, match="gdn_solve"):
        RunConfig(gdn_solve="lu")


def test_load_threads_the_run_config():
    e = sj.load(max_context=64, run_config=RunConfig(prefill_buckets=(16,), row_kernel="gemv"), expert_mode="per_token")
    assert e.run_config == RunConfig(prefill_buckets=(16,), row_kernel="gemv", expert_mode="per_token")
    assert e.runtime.prefill_buckets == (16,)
    experts = e.model.layers[0].ffn.experts
    assert (experts.mode, experts.row_kernel) == ("per_token", "gemv")
    with pytest.raises(InputError, match="run_config"):
        sj.load(max_context=64, run_config={"row_kernel": "gemv"})


def test_gemv_rows_keep_every_parity():
    """With the single-row expert kernel: batched MTP verify == sequential == plain decoding, and an
    expert budget (streamed experts) == all resident, bit for bit."""
    full = sj.load(max_context=256, row_kernel="gemv", prefill_buckets=(16,))
    ids = full.tokenizer.encode(PROMPT)
    ref = full.generate(ids, max_new_tokens=16)
    for verify in ("batched", "sequential"):
        assert full.generate(ids, max_new_tokens=16, speculative="mtp", draft_tokens=3, verify=verify).tokens == ref.tokens
    budget = sj.load(max_context=256, row_kernel="gemv", prefill_buckets=(16,), expert_budget="25%",
                     expert_policy="lru")
    chex.assert_trees_all_equal(budget.logits(ids), full.logits(ids))
    out = budget.generate(ids, max_new_tokens=16)
    assert out.tokens == ref.tokens and out.stats.experts["hit_rate"] < 1.0
    gemm = sj.load(max_context=256, prefill_buckets=(16,)).logits(ids)
    np.testing.assert_allclose(gemm, full.logits(ids), rtol=1e-4, atol=1e-4)
