"""The one jit factory of the runtime's step functions (the trunk's, the MTP head's, the tree drafter's).

A module is split once (`split`) into a hashable `Graph` (the static nnx graph definition and the tree
structure of its params and of its mutable cache) plus its params and cache as flat tuples of arrays:
flattening an nnx.State on every call costs ~0.1-0.3 ms, a tuple almost nothing. Step functions take
(params, cache, ...) and rebuild the module inside the trace (`Graph.merge`); `jit_factory` jits a
family of them once per graph (graphs of the same architecture and quant layout share the compiled
functions). Runtimes `hold` their graph and `release` it when closed: after the last holder the
graph's functions and the programs `derived_cache` built from them are dropped; `clear_caches` drops
every family's.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace
from typing import Any, Callable

import jax
from flax import nnx

_FACTORIES: list = []  # every jit_factory's and derived_cache's getter (`clear_caches`)
_GRAPH_CACHES: list = []  # each jit_factory's {graph: functions}
_DERIVED: list = []  # each derived_cache's forget(dropped function ids)
_HOLDERS: dict = {}  # graph -> live holders (`hold` / `release`)


@dataclasses.dataclass(frozen=True)
class Graph:
    """A split module: graphdef (static), the treedef of its params and of its mutable cache (None: no
    cache collection)."""

    graphdef: Any
    treedef: Any
    cache_treedef: Any = None

    def merge(self, params: tuple, cache: tuple = ()) -> nnx.Module:
        """The module from its flat params (and flat cache), inside a trace."""
        state = jax.tree.unflatten(self.treedef, params)
        if self.cache_treedef is None:
            return nnx.merge(self.graphdef, state)
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.cache_treedef, cache), state)


def split(module: nnx.Module, cache: Any = None) -> tuple[Graph, tuple, tuple]:
    """(graph, params, cache) of a module, params and cache as flat tuples of arrays; cache: the nnx
    filter of its mutable variables (None: none, cache ())."""
    if cache is None:
        graphdef, state = nnx.split(module)
        leaves, treedef = jax.tree.flatten(state)
        return Graph(graphdef, treedef), tuple(leaves), ()
    graphdef, cache_state, state = nnx.split(module, cache, ...)
    leaves, treedef = jax.tree.flatten(state)
    cache_leaves, cache_treedef = jax.tree.flatten(cache_state)
    return Graph(graphdef, treedef, cache_treedef), tuple(leaves), tuple(cache_leaves)


def jit_factory(build: Callable[[Graph], dict[str, tuple[Callable, dict]]]) -> Callable[[Graph], SimpleNamespace]:
    """build(graph) -> {name: (step function, `jax.jit` options)}. Returns fns(graph) -> a SimpleNamespace
    of the jitted functions by name, built once per graph and kept until the graph is `release`d by its
    last holder (or `clear_caches`)."""
    cache: dict[Graph, SimpleNamespace] = {}

    def fns(graph: Graph) -> SimpleNamespace:
        ns = cache.get(graph)
        if ns is None:
            ns = cache[graph] = SimpleNamespace(**{name: jax.jit(f, **opts) for name, (f, opts) in build(graph).items()})
        return ns

    _GRAPH_CACHES.append(cache)
    return _registered(fns, build, cache)


def derived_cache(build: Callable[..., Any]) -> Callable[..., Any]:
    """build(*jitted step functions) -> a program built from them (e.g. a jitted loop nesting them), kept
    per argument tuple and dropped with the graph whose factory made any of the functions."""
    cache: dict[tuple, Any] = {}

    def get(*fns: Any) -> Any:
        out = cache.get(fns)
        if out is None:
            out = cache[fns] = build(*fns)
        return out

    def forget(dropped: set[int]) -> None:
        for key in [k for k in cache if any(id(f) in dropped for f in k)]:
            del cache[key]

    _DERIVED.append(forget)
    return _registered(get, build, cache)


def _registered(getter: Callable[..., Any], build: Callable[..., Any], cache: dict) -> Callable[..., Any]:
    """getter, named as `build`, with `.cache` / `.cache_clear` and listed among the factories
    `clear_caches` empties."""
    functools.update_wrapper(getter, build)
    getter.cache = cache
    getter.cache_clear = cache.clear
    _FACTORIES.append(getter)
    return getter


class Hold:
    """One holder's claim on a graph's compiled functions (`hold`); `release()` gives it up once, however
    often it is called (a runtime's `close` may run from `close()`, `with` and `__del__` alike)."""

    def __init__(self, graph: Graph):
        self._graph: Graph | None = graph

    def release(self) -> None:
        if self._graph is not None:
            graph, self._graph = self._graph, None
            release(graph)


def hold(graph: Graph) -> Hold:
    """Count one more holder (a runtime) of graph's compiled functions; the returned `Hold` releases it."""
    _HOLDERS[graph] = _HOLDERS.get(graph, 0) + 1
    return Hold(graph)


def release(graph: Graph) -> None:
    """One holder of graph is done; after the last, every factory's functions of the graph, and the
    programs derived from them, are dropped (with them their compiled code and what their traces keep)."""
    n = _HOLDERS.get(graph, 0) - 1
    if n > 0:
        _HOLDERS[graph] = n
        return
    _HOLDERS.pop(graph, None)
    dropped: set[int] = set()
    for cache in _GRAPH_CACHES:
        ns = cache.pop(graph, None)
        if ns is not None:
            dropped.update(id(f) for f in vars(ns).values())
    if dropped:
        for forget in _DERIVED:
            forget(dropped)


def held() -> dict[Graph, int]:
    """Graphs with live holders and how many (a copy)."""
    return dict(_HOLDERS)


def clear_caches() -> None:
    """Forget every factory's jitted functions (they keep their graphs, and with them the weights' shapes
    and constants, alive)."""
    for fns in _FACTORIES:
        fns.cache_clear()
