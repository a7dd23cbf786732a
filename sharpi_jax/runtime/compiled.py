"""The one jit factory of the runtime's step functions (the trunk's, the MTP head's, the tree drafter's).

A module is split once (`split`) into a hashable `Graph` (the static nnx graph definition and the tree
structure of its params and of its mutable cache) plus its params and cache as flat tuples of arrays:
flattening an nnx.State on every call costs ~0.1-0.3 ms, a tuple almost nothing. Step functions take
(params, cache, ...) and rebuild the module inside the trace (`Graph.merge`); `jit_factory` jits a
family of them once per graph (graphs of the same architecture and quant layout share the compiled
functions) and `clear_caches` drops every family's (for loops that load many engines).
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace
from typing import Any, Callable

import jax
from flax import nnx

_FACTORIES: list = []  # every jit_factory's per-graph cache (`clear_caches`)


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
    of the jitted functions by name, built once per graph and kept."""

    @functools.lru_cache(maxsize=None)
    def fns(graph: Graph) -> SimpleNamespace:
        return SimpleNamespace(**{name: jax.jit(f, **opts) for name, (f, opts) in build(graph).items()})

    functools.update_wrapper(fns, build)
    _FACTORIES.append(fns)
    return fns


def clear_caches() -> None:
    """Forget every factory's jitted functions (they keep their graphs, and with them the weights' shapes
    and constants, alive)."""
    for fns in _FACTORIES:
        fns.cache_clear()
