"""An engine's lifetime is explicit: `close()`, `with sj.load(...)` and dropping the last reference
release its compiled programs (unless another live engine shares the graph), device arrays, expert
staging and the file's mmap; a closed engine refuses use with one line. Slow: 20 engines of the
embedded model (mixed options: budgets, policies, lookahead, MTP chain / tree, SnapKV, sampling), and 3
of the 35B-shaped slice, loaded, used and closed in one process keep the maximum RSS after the last
within 1.2x of that after the 2nd (`tests/runtime/engine_sweep.py`, in a subprocess)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref

import pytest

import sharpi_jax as sj
from sharpi_jax.errors import InputError
from sharpi_jax.runtime import compiled
from sharpi_jax.runtime.strategies import plain
from tests.conftest import REPO_ROOT

OPTS = dict(max_context=64, prefill_buckets=(32,))
PROMPT = "def add(a, b):\n    return a + b\n"


def _holders(graphs):
    held = compiled.held()
    return [held.get(g, 0) for g in graphs]


def test_close_releases_everything_the_engine_holds():
    e = sj.load(**OPTS, expert_budget="50%", expert_policy="lru")
    out = e.generate(PROMPT, max_new_tokens=2)  # the device loop: a program derived from the steps
    graphs = [e.runtime.graph, e.mtp.graph]
    before = _holders(graphs)
    assert min(before) >= 1
    fns = {id(f) for ns in (e.runtime.steps,) for f in vars(ns).values()}
    assert any(id(f) in fns for key in plain.jitted_loop.cache for f in key)
    streamer, gguf, mtp = e.residency.streamer, e.gguf, e.mtp
    param = weakref.ref(e.runtime.params[0])
    e.close()
    assert _holders(graphs) == [n - 1 for n in before]  # this engine's hold released, once
    for g, n in zip(graphs, before):
        if n == 1:  # no other live engine shares the graph: its compiled functions are gone
            assert all(g not in cache for cache in compiled._GRAPH_CACHES)
    if before[0] == 1:
        assert not any(id(f) in fns for key in plain.jitted_loop.cache for f in key)
    gc.collect()
    assert param() is None  # the device arrays are freed
    assert streamer.sources == {} and streamer.host_fns == {} and gguf._mmap is None
    assert mtp.params == ()
    assert e.closed and "closed" in repr(e)
    for use in (lambda: e.generate(PROMPT, max_new_tokens=1), lambda: e.logits([1, 2]), lambda: e.mtp,
                lambda: e.expert_stats()):
        with pytest.raises(InputError, match="closed"):
            use()
    e.close()  # idempotent
    assert out.tokens


def test_with_and_drop_close_the_engine():
    with sj.load(**OPTS) as e:
        graph, gguf = e.runtime.graph, e.gguf
        n = compiled.held()[graph]
        assert e.generate(PROMPT, max_new_tokens=2).tokens
    assert e.closed and gguf._mmap is None and compiled.held().get(graph, 0) == n - 1
    e2 = sj.load(**OPTS)
    gguf2, graph2 = e2.gguf, e2.runtime.graph
    n2 = compiled.held()[graph2]
    del e2
    gc.collect()
    assert gguf2._mmap is None and compiled.held().get(graph2, 0) == n2 - 1


def _sweep(n: int, *extra: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "tests.runtime.engine_sweep", str(n), *extra], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=3600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_engines_on_the_35b_shaped_slice_keep_memory_flat():
    from experiments.presets import resolve_model

    path = resolve_model("synthetic-qwen36-35b-a3b-4L-Q4_K")
    rss = _sweep(3, "--how=with", f"--path={path}", "--max_new=3")["rss_mib"]
    assert rss[2] <= 1.2 * rss[1], rss


@pytest.mark.slow
def test_twenty_engines_keep_memory_flat():
    out = _sweep(20, "--how=close")
    rss = out["rss_mib"]
    assert rss[19] <= 1.2 * rss[1], rss
    from tests.runtime.engine_sweep import CONFIGS

    n = len(CONFIGS)
    for i, tokens in enumerate(out["tokens"]):  # every engine of a config gives the same tokens
        assert tokens == out["tokens"][i % n], i
