"""expert_budget as a researcher writes it: bytes, "8GiB"-style sizes, or a share like "25%"."""

from __future__ import annotations

import functools

import pytest

import sharpi_jax as sj
from sharpi_jax.assets import default_model_path
from sharpi_jax.errors import InputError
from sharpi_jax.experts import residency
from sharpi_jax.gguf import GGUFFile, read_model_config


@pytest.fixture(scope="module")
def model():
    with GGUFFile(default_model_path()) as f:
        yield f, read_model_config(f)


@pytest.mark.parametrize("text,want", [
    ("1GiB", 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("123456", 123456),
    ("64kib", 65536), ("2 B", 2), (4096, 4096), (None, None),
])
def test_sizes(model, text, want):
    assert residency.parse_expert_budget(text, *model) == want


def test_share_is_budget_for_fraction(model):
    f, c = model
    for pct in (10, 25, 50, 100):
        assert residency.parse_expert_budget(f"{pct}%", f, c) == residency.budget_for_fraction(f, c, pct / 100)


@pytest.mark.parametrize("bad", ["lots", "0%", "150%", "8 parsecs", "GiB", 1.5, True, "-%", "inf", "nan"])
def test_bad_budget_is_named(model, bad):
    with pytest.raises(InputError, match="expert_budget must be"):
        residency.parse_expert_budget(bad, *model)


def test_load_with_a_share_matches_bytes():
    path = default_model_path()
    with GGUFFile(path) as f:
        want = residency.budget_for_fraction(f, read_model_config(f), 0.5)
    a = sj.load(path, max_context=64, expert_budget="50%", expert_policy="lru")
    b = sj.load(path, max_context=64, expert_budget=want, expert_policy="lru")
    assert a.residency.plan.budget == b.residency.plan.budget == want
    ids = a.tokenizer.encode("def f(x):\n")
    assert a.generate(ids, max_new_tokens=4).tokens == b.generate(ids, max_new_tokens=4).tokens


_MTP_PROMPT = "import os\nimport sys\n\n\nclass "


@functools.lru_cache(maxsize=None)
def _all_resident_runs():
    """The all-resident reference of the budget cells (plain, then MTP k = 3), computed once."""
    full = sj.load(default_model_path(), max_context=256)
    return (full.generate(_MTP_PROMPT, max_new_tokens=24),
            full.generate(_MTP_PROMPT, max_new_tokens=24, speculative="mtp", draft_tokens=3))


@pytest.mark.parametrize("policy,budget,cold", [("static", "50%", "host"), ("lru", "25%", "stream"),
                                                 ("frequency", "30%", "auto")])
def test_mtp_under_a_budget_is_the_all_resident_run(policy, budget, cold):
    """MTP speculation with an expert budget: the same tokens, drafts and acceptance as all-resident
    (verify batches of k+1 rows go through the residency path; host-computed pairs ride along a
    used expert in the device dispatch, so a row may repeat an id there)."""
    path = default_model_path()
    prompt = _MTP_PROMPT
    ref, ref_mtp = _all_resident_runs()
    e = sj.load(path, max_context=256, expert_budget=budget, expert_policy=policy, expert_cold=cold)
    for verify in ("batched", "sequential"):
        out = e.generate(prompt, max_new_tokens=24, speculative="mtp", draft_tokens=3, verify=verify)
        assert out.tokens == ref.tokens
        spec, ref_spec = out.stats.speculation, ref_mtp.stats.speculation
        assert (spec.accepted, spec.drafted) == (ref_spec.accepted, ref_spec.drafted)
        assert out.stats.experts["hit_rate"] < 1.0  # the budget was really exercised
    assert e.generate(prompt, max_new_tokens=24).tokens == ref.tokens
