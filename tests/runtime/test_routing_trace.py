"""trace_routing's routing is the engine's: per-expert counts equal the residency's device counters
(`calibrate_experts`, counted inside the jitted MoE), and the early router rows are distributions."""

from __future__ import annotations

import numpy as np
import pytest

import sharpi_jax as sj
from sharpi_jax.assets import default_model_path
from sharpi_jax.errors import InputError
from sharpi_jax.runtime.routing import trace_routing


def test_trace_counts_are_the_engines_routing():
    path = default_model_path()
    e = sj.load(path, max_context=128, expert_budget="100%", expert_policy="static")
    ids = e.tokenizer.encode("import os\n\n\ndef read_config(path):\n    with open(path) as f:\n"
                             "        return json.load(f)\n") * 2
    trace = trace_routing(e.model, ids)
    c = e.config
    assert trace.selected.shape == (c.n_layer, len(ids), c.n_expert_used)
    counts = e.calibrate_experts([ids], save=False)
    for layer in range(c.n_layer):
        np.testing.assert_array_equal(np.bincount(trace.selected[layer].ravel(), minlength=c.n_expert),
                                      counts[layer])
    assert np.isnan(trace.early[0]).all()
    np.testing.assert_allclose(trace.early[1:].sum(axis=-1), 1.0, rtol=1e-5)
    assert trace.probs.shape == trace.early.shape == (c.n_layer, len(ids), c.n_expert)


def test_dense_model_is_refused():
    e = sj.load("../shared/fixtures/tiny-qwen35/tiny-qwen35-Q8_0.gguf", max_context=16)
    with pytest.raises(InputError, match="MoE"):
        trace_routing(e.model, [1, 2, 3])
