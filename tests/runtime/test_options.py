"""The typed options (`Chain`, `Tree`, `GenerateOptions`, `ExpertResidency`): validated once at construction
(one-line InputErrors naming the option), frozen; the keyword shortcuts of `generate` and `load` build
the same objects as the types written out."""

from __future__ import annotations

import dataclasses

import pytest

import sharpi_jax as sj
from sharpi_jax.api import load_shortcuts
from sharpi_jax.errors import InputError
from sharpi_jax.experts.residency.options import ExpertResidency
from sharpi_jax.model.snapkv import SnapKV
from sharpi_jax.runtime.options import ENGINE_KV, Chain, GenerateOptions, Tree
from sharpi_jax.runtime.sampling import SamplingParams


@pytest.mark.parametrize("build,match", [
    (lambda: Chain(k=0), r"Chain.k \(draft_tokens\) must be a positive integer"),
    (lambda: Chain(k=True), r"Chain.k \(draft_tokens\) must be a positive integer"),
    (lambda: Chain(draft_vocab=0), "Chain.draft_vocab must be a positive integer"),
    (lambda: Chain(p_min=1.0), r"Chain.p_min \(draft_p_min\) must be a probability"),
    (lambda: Chain(p_min="x"), r"Chain.p_min \(draft_p_min\) must be a probability"),
    (lambda: Tree(depth=0), r"Tree.depth \(draft_tokens\) must be a positive integer"),
    (lambda: Tree(nodes=0), r"Tree.nodes \(tree_nodes\) must be a positive integer"),
    (lambda: Tree(depth=3, nodes=2), "depth <= nodes"),
    (lambda: Tree(max_snapshot_bytes=-5), "Tree.max_snapshot_bytes must be a positive integer"),
    (lambda: GenerateOptions(verify="tree"), "verify must be one of"),
    (lambda: GenerateOptions(loop="gpu"), "loop must be one of"),
    (lambda: GenerateOptions(max_new_tokens=-1), "max_new_tokens must be a non-negative integer"),
    (lambda: GenerateOptions(max_new_tokens=2.0), "max_new_tokens must be a non-negative integer"),
    (lambda: GenerateOptions(speculation="mtp"), "speculation must be a Chain, a Tree or None"),
    (lambda: GenerateOptions(sampling={"temperature": 1.0}), "sampling must be a SamplingParams"),
    (lambda: GenerateOptions(stop_on_eos="yes"), "stop_on_eos must be True or False"),
    (lambda: GenerateOptions(kv="snapkv"), "kv must be 'engine', None or a SnapKV"),
    (lambda: GenerateOptions.from_keywords(speculative="eagle"), "speculative must be one of"),
    (lambda: GenerateOptions.from_keywords(tree_nodes=4), "apply to speculative='mtp_tree' only"),
    (lambda: GenerateOptions.from_keywords(draft_vocab=64), "draft_vocab applies to speculative='mtp' or 'mtp_tree'"),
    (lambda: GenerateOptions.from_keywords(speculative="mtp_tree", draft_p_min=0.5), "draft_p_min applies to"),
    (lambda: GenerateOptions.from_keywords(draft_p_min=0.5), "draft_p_min applies to speculative='mtp'"),
    (lambda: GenerateOptions.from_keywords(draft_tokens=0), "draft_tokens must be a positive integer"),
    (lambda: ExpertResidency(), "needs a budget"),
    (lambda: ExpertResidency("25%", policy="fifo"), "expert_policy must be one of"),
    (lambda: ExpertResidency("25%", staging=0), "expert_staging must be a positive integer"),
    (lambda: ExpertResidency("25%", ring=1.5), "expert_ring must be a fraction"),
    (lambda: ExpertResidency("25%", lookahead="sometimes"), "expert_lookahead must be one of"),
    (lambda: ExpertResidency(2.5), "expert_budget must be bytes"),
    (lambda: ExpertResidency("25%", device_budget=10), "not both"),
    (lambda: ExpertResidency.from_keywords(expert_ring=0.5), "need expert_budget"),
])
def test_bad_values_raise_one_line(build, match):
    with pytest.raises(InputError, match=match) as e:
        build()
    assert "\n" not in str(e.value)


def test_frozen_and_derived():
    o = GenerateOptions(speculation=Chain(4), sampling=SamplingParams(temperature=0.5, seed=3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.loop = "host"
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.speculation.k = 5
    assert o.speculative == "mtp" and o.draft_tokens == 4
    assert o.device_loop and not dataclasses.replace(o, loop="host").device_loop
    assert not dataclasses.replace(o, verify="sequential").device_loop
    assert GenerateOptions(verify="sequential").device_loop  # MTP off ignores verify
    tree = GenerateOptions(speculation=Tree(4))
    assert tree.speculative == "mtp_tree" and tree.draft_tokens == 4
    assert tree.device_loop and not dataclasses.replace(tree, verify="sequential").device_loop
    assert Tree(4).nodes == 8 and Tree(12).nodes == 12 and Tree(4, 5).nodes == 5
    with pytest.raises(InputError, match="speculation must be"):
        dataclasses.replace(o, speculation=3)  # replace validates again


def test_generate_shortcuts_build_the_typed_options():
    kw = GenerateOptions.from_keywords
    assert kw() == GenerateOptions()
    assert kw(max_new_tokens=9, temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=4, stop_on_eos=False,
              loop="host", verify="sequential") == GenerateOptions(
        9, SamplingParams(0.7, 5, 0.9, 0.1, 4), False, None, "sequential", "host")
    assert kw(speculative="mtp", draft_tokens=2, draft_vocab=64, draft_p_min=0.3).speculation == Chain(2, 64, 0.3)
    assert kw(speculative="mtp_tree", draft_tokens=5, tree_nodes=9, max_snapshot_bytes=10, draft_vocab=64).speculation \
        == Tree(5, 9, 10, 64)
    assert kw(speculative="mtp_tree").speculation == Tree(3, 8)


def test_load_shortcuts_build_the_typed_options():
    run, res, par, kv = load_shortcuts(kernels="xla", prefill_buckets=(16,), repack=None, expert_budget="25%",
                                       expert_policy="lru", expert_lookahead="both", expert_parallel=2,
                                       kv_policy="snapkv", kv_budget=40, kv_window=8)
    assert run == sj.RunConfig(kernels="xla", prefill_buckets=(16,), repack=None)
    assert res == ExpertResidency("25%", "lru", lookahead="both") and par == 2 and kv == SnapKV(40, 8)
    assert load_shortcuts() == (None, None, None, None)
    assert load_shortcuts(expert_policy="lru")[1] is None  # a policy without a budget: all resident
    base = sj.RunConfig(kernels="xla")
    assert load_shortcuts(base, row_kernel="gemv")[0] == sj.RunConfig(kernels="xla", row_kernel="gemv")
    for kw, match in [(dict(run=base, run_config=base), "run= or run_config="),
                      (dict(residency=ExpertResidency("25%"), expert_budget="50%"), "residency= or its keywords"),
                      (dict(parallel=2, expert_parallel=2), "parallel= or expert_parallel="),
                      (dict(kv=SnapKV(40), kv_budget=30), "kv= or kv_policy"),
                      (dict(no_such_option=1), "unknown load option"),
                      (dict(dtype="bfloat16"), "dtype 'bfloat16' is not supported")]:
        with pytest.raises(InputError, match=match):
            load_shortcuts(**kw)


def test_engine_options_resolve_kv_against_the_engine():
    """kv_policy="default" keeps the engine's setting ("engine"), sizes given merge with it; None drops it."""
    with sj.load(max_context=64, kv=SnapKV(40, 8, 3)) as engine:
        assert engine.options().kv == ENGINE_KV
        assert engine.options(kv_budget=50).kv == SnapKV(50, 8, 3)
        assert engine.options(kv_policy=None).kv is None
        assert engine._kv(engine.options()) == SnapKV(40, 8, 3)
        with pytest.raises(InputError, match="options= or keyword shortcuts"):
            engine.generate("x", GenerateOptions(), max_new_tokens=2)
        with pytest.raises(InputError, match="options must be a sharpi_jax.GenerateOptions"):
            engine.generate("x", {"max_new_tokens": 2})
