"""The one jit factory (`sharpi_jax.runtime.compiled`): a split module merges back bit for bit inside the
trace, a family of step functions is jitted once per graph (equal graphs share it), and `clear_caches`
drops every family's functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sharpi_jax.runtime import compiled
from tests.bitwise import assert_bitwise_equal


class Counter(nnx.Variable):
    """A mutable variable, split off as the module's cache."""


class Tiny(nnx.Module):
    def __init__(self, seed: int):
        self.lin = nnx.Linear(4, 3, rngs=nnx.Rngs(seed))
        self.calls = Counter(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls.value = self.calls.value + 1
        return self.lin(x)


@compiled.jit_factory
def _fns(graph: compiled.Graph) -> dict:
    def apply(params, cache, x):
        m = graph.merge(params, cache)
        y = m(x)
        return y, tuple(jax.tree.leaves(nnx.state(m, Counter)))

    return dict(apply=(apply, dict(donate_argnums=(1,))))


def test_merge_is_bitwise_and_the_cache_is_threaded():
    m = Tiny(0)
    x = jnp.arange(8, dtype=jnp.float32).reshape(2, 4) / 7
    graph, params, cache = compiled.split(m, Counter)
    assert len(cache) == 1 and graph.cache_treedef is not None
    y, cache = _fns(graph).apply(params, cache, x)
    assert_bitwise_equal(y, m.lin(x))
    _, cache = _fns(graph).apply(params, cache, x)
    assert int(cache[0]) == 2  # the mutable variable came back updated, twice
    g2, p2, c2 = compiled.split(m)  # no cache filter: everything is a param
    assert c2 == () and g2.cache_treedef is None and len(p2) == len(params) + 1


def test_one_family_per_graph_and_clear_caches():
    a, b = compiled.split(Tiny(0), Counter)[0], compiled.split(Tiny(1), Counter)[0]
    assert a == b and hash(a) == hash(b)  # same architecture, other weights: one graph
    first = _fns(a)
    assert _fns(b) is first
    compiled.clear_caches()
    assert _fns(a) is not first  # rebuilt after clear_caches


def test_hold_release_drops_a_graphs_functions_after_its_last_holder():
    """Runtimes hold their graph; the jitted family and the programs derived from it are kept while any
    holder is alive and dropped after the last release (the engine-close path), never before."""
    calls = []

    @compiled.derived_cache
    def loop(f):
        calls.append(f)
        return jax.jit(lambda p, c, x: f(p, c, x)[0])

    m = Tiny(5)
    graph, params, cache = compiled.split(m, Counter)
    x = jnp.ones((2, 4), jnp.float32)
    before = compiled.held().get(graph, 0)
    compiled.hold(graph)
    compiled.hold(graph)  # two runtimes of equal graphs
    fns = _fns(graph)
    y = loop(fns.apply)(params, cache, x)
    assert loop(fns.apply) is loop(fns.apply) and len(calls) == 1
    compiled.release(graph)  # one holder left: nothing dropped
    assert _fns(graph) is fns and fns.apply in {k[0] for k in loop.cache}
    compiled.release(graph)
    if before == 0:  # no other holder in this process
        assert graph not in _fns.cache and not loop.cache
        assert graph not in compiled.held()
        assert _fns(graph) is not fns  # rebuilt on the next use
        assert_bitwise_equal(loop(_fns(graph).apply)(params, cache, x), y)
        assert len(calls) == 2
