"""The routed experts a MoE block calls (`model.moe.ExpertProvider`), built and loaded from an open GGUF.

- `RoutedExperts`: one layer's whole expert stacks in their storage form (`expert_weights.expert_storage`:
  Q8_0 / Q4_K as SoA fields, F32 / F16 as floats, other types as raw GGUF rows), dispatched by
  `dispatch.routed_experts` (grouped or per-token, bitwise equal).
- `GGUFExperts`: the model loader's `ExpertLoader` for a GGUF: per MoE block a `RoutedExperts`, or,
  with an expert budget, the residency's `ResidentExperts` (device slots + streaming), and the loaders
  of their params.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx
from gguf import GGMLQuantizationType as Q

from sharpi_jax.config import PALLAS_EXPERT_MODE, ModelConfig, RunConfig
from sharpi_jax.experts.dispatch import routed_experts
from sharpi_jax.experts.expert_weights import (ExpertWeights, expert_storage, storage_values,
                                               storage_variables, to_expert_storage)
from sharpi_jax.gguf.reader import GGUFFile
from sharpi_jax.gguf.tensor_specs import EXPERT_MATRICES, expert_qtypes, expert_raw
from sharpi_jax.quant.backend_used import pallas_fallback_reason


def matrix_shape(n: int, d_model: int, d_ff: int, which: str) -> tuple[int, int, int]:
    """Numpy shape of `n` experts' `which` matrix: gate / up [n, F, D], down [n, D, F]."""
    return (n, d_model, d_ff) if which == "down" else (n, d_ff, d_model)


class RoutedExperts(nnx.Module):
    """One layer's routed experts: gate/up [E, F, D] and down [E, D, F] in storage form + static qtypes."""

    def __init__(self, n_expert: int, d_model: int, d_ff: int, qtypes: tuple[int, int, int],
                 run: RunConfig = RunConfig()):
        """qtypes: (gate, up, down) ggml type ids; run: the dispatch (expert_mode, row_kernel)."""
        self.n_expert, self.d_model, self.d_ff = n_expert, d_model, d_ff
        self.mode, self.row_kernel = run.expert_mode, run.row_kernel
        self.qtypes = tuple(int(q) for q in qtypes)
        # kernels="pallas" (expert_mode "pallas"): a layer with a matrix the kernels cannot take runs the
        # "grouped" XLA dispatch; `matrix_backends` reports it (and sj.load warns).
        self.fallback: tuple[tuple[str, str], ...] = ()  # (matrix, why it is not on the Pallas kernels)
        if self.mode == PALLAS_EXPERT_MODE:
            reasons = {w: pallas_fallback_reason(q, self._shape(w), experts=True)
                       for w, q in zip(EXPERT_MATRICES, self.qtypes)}
            if any(reasons.values()):
                self.mode = "grouped"
                bad = ", ".join(f"ffn_{w}_exps" for w, r in reasons.items() if r)
                self.fallback = tuple((w, r or f"its layer runs the grouped XLA dispatch ({bad} fall back)")
                                      for w, r in reasons.items())
        for which, q in zip(EXPERT_MATRICES, self.qtypes):
            setattr(self, which, storage_variables(expert_storage(matrix_shape(n_expert, d_model, d_ff, which), q)))

    def _shape(self, which: str) -> tuple[int, int]:
        """One expert's [N, K] for matrix `which`."""
        return matrix_shape(1, self.d_model, self.d_ff, which)[1:]

    def matrix_backends(self, selected: str) -> dict[str, dict]:
        """Per matrix ("gate" / "up" / "down") under the `selected` kernel backend: ggml type, one
        expert's [N, K], the backend it runs on and, for a fallback from "pallas", why."""
        backend = "pallas" if self.mode == PALLAS_EXPERT_MODE else ("xla" if selected == "pallas" else selected)
        return {w: {"type": Q(q).name, "shape": self._shape(w), "backend": backend, "why": dict(self.fallback).get(w)}
                for w, q in zip(EXPERT_MATRICES, self.qtypes)}

    def weights(self) -> ExpertWeights:
        """The dispatch module's view of these experts (no copy)."""
        return ExpertWeights.from_storage(storage_values(self.gate), storage_values(self.up),
                                          storage_values(self.down), self.qtypes)

    def __call__(self, u: jax.Array, sel: jax.Array, w: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """`moe.ExpertProvider`: padding rows already carry zero weights, so `valid` is not needed."""
        return routed_experts(u, sel, w, self.weights(), mode=self.mode, row_kernel=self.row_kernel)


class GGUFExperts:
    """The routed experts of an open GGUF for `model.weights.load_model` / `load_mtp` / `load_block`.

    residency: a `residency.Residency` (an expert budget): the layers it manages get device slots;
    the others (the MTP block) whole stacks.
    """

    def __init__(self, f: GGUFFile, config: ModelConfig, run: RunConfig = RunConfig(), residency: Any = None):
        self.gguf, self.config, self.run, self.residency = f, config, run, residency
        self._pending: dict = {}  # SoA fields of the matrix being loaded

    def modules(self) -> Callable[[int], nnx.Module]:
        """A factory for one model build (layers of one build share the residency's staging buffers)."""
        c = self.config
        shared: dict = {}

        def make(layer: int) -> nnx.Module:
            if self.residency is not None:
                m = self.residency.experts_module(layer, self.run, shared)
                if m is not None:
                    return m
            return RoutedExperts(c.n_expert, c.d_model, c.expert_ff, expert_qtypes(self.gguf, layer), self.run)

        return make

    def source(self, layer: int, path: tuple) -> Callable[[], Any]:
        """The loader of one param of `modules()(layer)`, by its path inside that module."""
        if self.residency is not None and layer in self.residency.plan.layers:
            return self.residency.source(layer, path)
        if len(path) not in (1, 2) or path[0] not in EXPERT_MATRICES:
            raise KeyError(path)
        return lambda: self._storage(layer, path[0], path[1] if len(path) == 2 else None)

    def _storage(self, layer: int, which: str, field: str | None):
        """Expert matrix `which` of a layer in its storage form, or one SoA field of it."""
        c = self.config
        qtype = expert_qtypes(self.gguf, layer)[EXPERT_MATRICES.index(which)]
        shape = matrix_shape(c.n_expert, c.d_model, c.expert_ff, which)
        return field_of(self._pending, (layer, which), field,
                        lambda: to_expert_storage(expert_raw(self.gguf, layer, which), shape, qtype))


def field_of(pending: dict, key: Any, field: str | None, convert: Callable[[], Any]):
    """`convert()` (an array, or a dict of SoA fields), or its `field`: a dict is converted once and its
    fields are handed out one by one from `pending` (dropped as they go: no copy outlives the load)."""
    if field is None:
        return convert()
    if key not in pending:
        pending.clear()  # a new matrix: the previous one's fields are no longer wanted
        pending[key] = dict(convert())
    fields = pending[key]
    value = fields.pop(field)
    if not fields:
        del pending[key]
    return value
