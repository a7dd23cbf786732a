"""Expert residency with kernels="pallas" (interpret mode on CPU): the device slots, the staging stack
and the cold experts served per layer run the grouped Pallas kernel, and the tokens and logits are
bitwise those of the all-resident Pallas run (tiny-qwen35moe Q8_0: every matrix has a Pallas kernel).

Fast: one budget with the ring policy, both lookahead modes and every miss streamed to the device (the
staging path through the kernel). Slow: every policy with lookahead none / next_layer / both, and MTP.
The cold experts' bytes are laid out for the kernel inside the step (`ExpertFormat.pack` of the staged
GGUF blocks), as on XLA."""

from __future__ import annotations

import pytest

import sharpi_jax as sj
from tests.bitwise import bitwise_equal
from tests.conftest import fixture_path

PROMPT = [1, 50, 300, 7, 900, 12]
LOAD = dict(max_context=32, kernels="pallas", prefill_buckets=(8,))
GEN = dict(max_new_tokens=6, stop_on_eos=False)


def _path() -> str:
    return str(fixture_path("tiny-qwen35moe", "tiny-qwen35moe-Q8_0.gguf"))


@pytest.fixture(scope="module")
def resident():
    with sj.load(_path(), **LOAD) as e:
        return e.logits(PROMPT), e.generate(PROMPT, **GEN).tokens


def _check(resident, policy: str, lookahead: str, cold: str | None) -> None:
    logits, tokens = resident
    with sj.load(_path(), **LOAD, expert_budget="30%", expert_policy=policy, expert_lookahead=lookahead,
                 expert_cold=cold) as e:
        assert {v["backend"] for k, v in e.matrix_backends.items() if ".experts." in k} == {"pallas"}
        out = e.generate(PROMPT, **GEN)
        assert out.tokens == tokens, (policy, lookahead, cold)
        assert bitwise_equal(e.logits(PROMPT), logits)
        ex = out.stats.experts
        assert ex["hit_rate"] < 1 and (cold != "stream" or ex["experts_streamed"] > 0), ex


@pytest.mark.filterwarnings("ignore:expert_policy='frequency' without calibrated counts")
def test_pallas_residency_streams_and_equals_all_resident(resident):
    _check(resident, "lru", "both", "stream")


@pytest.mark.slow
def test_pallas_residency_mtp_keeps_the_tokens(resident):
    """The MTP chain's verify passes under a budget on Pallas: the greedy tokens of MTP off."""
    with sj.load(_path(), **LOAD, expert_budget="30%", expert_policy="lru", expert_cold="stream") as e:
        assert e.generate(PROMPT, **GEN, speculative="mtp", draft_tokens=2).tokens == resident[1]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:expert_policy='frequency' without calibrated counts")
@pytest.mark.parametrize("policy", ["static", "frequency", "lru", "slru"])
@pytest.mark.parametrize("lookahead", ["none", "next_layer", "both"])
def test_pallas_residency_every_policy_and_lookahead(resident, policy, lookahead):
    _check(resident, policy, lookahead, None)
