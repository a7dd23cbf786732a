"""`GenerateOptions`: validated once at construction (one-line InputErrors naming the option), frozen,
and the loop / tree defaults it derives."""

from __future__ import annotations

import dataclasses

import pytest

from sharpi_jax.errors import InputError
from sharpi_jax.runtime.options import GenerateOptions
from sharpi_jax.runtime.sampling import SamplingParams


@pytest.mark.parametrize("kw,match", [
    (dict(speculative="eagle"), "speculative must be one of"),
    (dict(verify="tree"), "verify must be one of"),
    (dict(loop="gpu"), "loop must be one of"),
    (dict(draft_tokens=0), "draft_tokens must be a positive integer"),
    (dict(draft_tokens=True), "draft_tokens must be a positive integer"),
    (dict(max_new_tokens=-1), "max_new_tokens must be a non-negative integer"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be a non-negative integer"),
    (dict(tree_nodes=4), "apply to speculative='mtp_tree' only"),
    (dict(speculative="mtp_tree", tree_nodes=0), "tree_nodes must be a positive integer"),
    (dict(speculative="mtp_tree", max_snapshot_bytes=-5), "max_snapshot_bytes must be a positive integer"),
    (dict(speculative="mtp_tree", draft_tokens=3, tree_nodes=2), "draft_tokens <= tree_nodes"),
    (dict(draft_vocab=64), "draft_vocab applies to speculative='mtp'"),
    (dict(sampling={"temperature": 1.0}), "sampling must be a SamplingParams"),
])
def test_bad_values_raise_one_line(kw, match):
    with pytest.raises(InputError, match=match) as e:
        GenerateOptions(**kw)
    assert "\n" not in str(e.value)


def test_frozen_and_derived():
    o = GenerateOptions(speculative="mtp", draft_tokens=4, sampling=SamplingParams(temperature=0.5, seed=3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.draft_tokens = 5
    assert o.device_loop and not dataclasses.replace(o, loop="host").device_loop
    assert not dataclasses.replace(o, verify="sequential").device_loop
    assert GenerateOptions(verify="sequential").device_loop  # MTP off ignores verify
    tree = GenerateOptions(speculative="mtp_tree", draft_tokens=4)
    assert tree.device_loop and not dataclasses.replace(tree, verify="sequential").device_loop
    assert tree.nodes == 8 and dataclasses.replace(tree, draft_tokens=12).nodes == 12
    assert dataclasses.replace(tree, tree_nodes=5).nodes == 5
    with pytest.raises(InputError, match="draft_vocab applies"):
        dataclasses.replace(o, speculative=None, draft_vocab=32)  # replace validates again
