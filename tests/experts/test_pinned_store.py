"""The pinned host store (`expert_store="pinned_host"`, `sharpi_jax.experts.residency.slots.ColdStore`):
every expert of a managed layer laid out once at load in the kernel layout, held in JAX's "pinned_host"
memory, and each call's misses sliced from it and moved to the device inside the step.

Claims: the tokens and logits are bitwise those of every expert resident (the moved experts are the
same laid-out bytes the callback path lays out per call); the step makes no host callback at all (so
the budgeted decode step and MTP verify pass lower for CUDA on a machine without a GPU, every matrix on
Pallas, the store's arguments in pinned host memory); the stats count the bytes moved.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import sharpi_jax as sj
from sharpi_jax.errors import InputError
from sharpi_jax.experts import residency
from tests.bitwise import assert_bitwise_equal
from tests.conftest import fixture_path
from tests.cuda_lowering import lower_for_cuda

PROMPT = "def add(a, b):\n    return"


def _path(variant: str) -> str:
    return str(fixture_path("tiny-qwen35moe", f"tiny-qwen35moe-{variant}.gguf"))


def _store_arrays(engine) -> list:
    return [leaf for path, var in nnx.to_flat_state(nnx.state(engine.model)) if "store" in path
            for leaf in jax.tree.leaves(var.get_value())]


@pytest.mark.parametrize("variant,policy,lookahead", [("Q8_0", "lru", "both"), ("Q4_K_M", "frequency", "next_layer")])
def test_pinned_store_gives_the_all_resident_bits(variant, policy, lookahead):
    full = sj.load(_path(variant), max_context=64)
    ids = full.tokenizer.encode(PROMPT)
    gen = dict(max_new_tokens=16, stop_on_eos=False)
    ref = full.generate(ids, **gen).tokens
    e = sj.load(_path(variant), max_context=64, expert_budget="30%", expert_policy=policy,
                expert_lookahead=lookahead, expert_store="pinned_host")
    store = _store_arrays(e)
    assert store and {a.sharding.memory_kind for a in store} == {"pinned_host"}
    assert_bitwise_equal(e.logits(ids), full.logits(ids))
    out = e.generate(ids, **gen)
    assert out.tokens == ref
    ex = out.stats.experts
    assert ex["hit_rate"] < 1.0 and ex["experts_streamed"] > 0 and ex["callbacks"] == 0
    assert ex["experts_host_computed"] == 0 and "pinned_host" in ex["staging_memory"]
    layers = e.residency.plan.layers  # bytes per expert of each layer's own block types
    assert ex["bytes_streamed"] == sum(r["streamed"] * layers[i].bytes_per_expert for i, r in ex["per_layer"].items())
    assert e.generate(ids, **gen, speculative="mtp", draft_tokens=3).tokens == ref


def test_pinned_store_steps_lower_for_cuda_without_a_callback(monkeypatch):
    """The budgeted decode step and 4-row MTP verify pass (lookahead "both": prefetches come from the store
    too) lowered for CUDA: Triton kernels, every matrix on Pallas, pinned host arguments, no callback."""
    e = sj.load(_path("Q8_0"), max_context=32, kernels="pallas", prefill_buckets=(8,), expert_budget="30%",
                expert_policy="lru", expert_lookahead="both", expert_store="pinned_host")
    assert {v["backend"] for v in e.matrix_backends.values()} == {"pallas"}
    rt = e.runtime
    state = rt.new_state()
    tokens = np.zeros((4,), np.int32)
    snaps = jax.eval_shape(lambda s: rt._fns.verify(rt.params, rt.cache, s, tokens, np.int32(0), np.int32(4))[0].snaps,
                           state)  # pylint: disable=protected-access
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    texts = {
        "decode": lower_for_cuda(lambda: rt._fns.decode.trace(rt.params, rt.cache, state, np.int32(1), np.int32(0))
                                 .lower(lowering_platforms=("cuda",))),
        "verify": lower_for_cuda(lambda: rt._fns.commit_verify.trace(rt.params, rt.cache, state, snaps, np.int32(0),
                                                                     tokens, np.int32(0), np.int32(4))
                                 .lower(lowering_platforms=("cuda",))),
    }
    for name, text in texts.items():
        assert text.count("__gpu$xla.gpu.triton") > 0, name
        assert 'mhlo.memory_kind = "pinned_host"' in text, name
        assert "callback" not in text, name


def test_store_mode_is_resolved_once():
    assert residency.resolve_store(None) == residency.resolve_store("auto") == "callback"  # CPU backend
    assert residency.resolve_store("pinned_host") == "pinned_host"
    with pytest.raises(InputError, match="expert_store='pinned_host' with expert_parallel"):
        residency.resolve_store("pinned_host", 2)
