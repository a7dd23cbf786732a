"""The routed experts a MoE block calls (`model.moe.ExpertProvider`), built and loaded from an open GGUF.

- `RoutedExperts`: one layer's whole expert stacks, QTensors [E, rows, cols] laid out once at load by
  the run's `quant.MatrixFormat` (the same as every other matrix: "xla" holds Q8_0 / Q4_K as SoA
  fields, floats as floats, other types as GGUF blocks; "pallas" the kernel layout), dispatched by
  `dispatch.routed_experts` (grouped or per-token, bitwise equal).
- `GGUFExperts`: the model loader's `ExpertLoader` for a GGUF: per MoE block a `RoutedExperts`, or,
  with an expert budget, the residency's `ResidentExperts` (device slots + streaming), and the loaders
  of their params.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from sharpi_jax import quant
from sharpi_jax.config import ModelConfig, RunConfig
from sharpi_jax.experts.dispatch import routed_experts
from sharpi_jax.gguf.reader import GGUFFile
from sharpi_jax.gguf.tensor_specs import EXPERT_MATRICES, expert_qtypes, expert_raw
from sharpi_jax.model.layers import QuantBlocks


def matrix_shape(n: int, d_model: int, d_ff: int, which: str) -> tuple[int, int, int]:
    """Numpy shape of `n` experts' `which` matrix: gate / up [n, F, D], down [n, D, F]."""
    return (n, d_model, d_ff) if which == "down" else (n, d_ff, d_model)


class ExpertFormat:
    """How one layer's expert stacks are held: the backend serving all three types (`MatrixFormat.
    experts_backend`) and its layouts. `zeros(n)` / `pack(raws)` build stacks of n experts."""

    def __init__(self, fmt: quant.MatrixFormat, qtypes: tuple[int, int, int], d_model: int, d_ff: int):
        self.fmt, self.qtypes, self.d_model, self.d_ff = fmt, tuple(int(q) for q in qtypes), d_model, d_ff
        shapes = tuple(matrix_shape(1, d_model, d_ff, m) for m in EXPERT_MATRICES)
        self.backend = fmt.experts_backend(self.qtypes, shapes)

    def shape(self, n: int, which: str) -> tuple[int, int, int]:
        return matrix_shape(n, self.d_model, self.d_ff, which)

    def zeros(self, n: int, which: str) -> quant.QTensor:
        """A zero-filled stack of n experts' `which` matrix (a module's value before loading)."""
        q = self.qtypes[EXPERT_MATRICES.index(which)]
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.fmt.abstract(q, self.shape(n, which), self.backend))

    def pack(self, raw, which: str) -> quant.QTensor:
        """GGUF bytes uint8 [n, rows, row_bytes] of `which` -> its stack (jittable)."""
        q = self.qtypes[EXPERT_MATRICES.index(which)]
        return self.fmt.pack(raw, q, self.shape(raw.shape[0], which), self.backend)


class RoutedExperts(nnx.Module):
    """One layer's routed experts: gate/up [E, F, D] and down [E, D, F] QTensor stacks + static qtypes."""

    def __init__(self, n_expert: int, d_model: int, d_ff: int, qtypes: tuple[int, int, int],
                 run: RunConfig = RunConfig()):
        """qtypes: (gate, up, down) ggml type ids; run: the dispatch (expert_mode, row_kernel) and the
        kernel backend the stacks are laid out for."""
        self.n_expert, self.d_model, self.d_ff = n_expert, d_model, d_ff
        self.mode, self.row_kernel = run.expert_mode, run.row_kernel
        self.qtypes = tuple(int(q) for q in qtypes)
        self.format = ExpertFormat(quant.MatrixFormat.for_run(run), self.qtypes, d_model, d_ff)
        for which in EXPERT_MATRICES:
            setattr(self, which, QuantBlocks(self.format.zeros(n_expert, which)))

    def weights(self) -> tuple[quant.QTensor, quant.QTensor, quant.QTensor]:
        """The (gate, up, down) stacks (no copy)."""
        return tuple(getattr(self, m).get_value() for m in EXPERT_MATRICES)

    def __call__(self, u: jax.Array, sel: jax.Array, w: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """`moe.ExpertProvider`: padding rows (valid False) already carry zero weights; `valid` only
        lets a backend's grouped op skip them."""
        return routed_experts(u, sel, w, self.weights(), mode=self.mode, row_kernel=self.row_kernel, valid=valid)


class GGUFExperts:
    """The routed experts of an open GGUF for `model.weights.load_model` / `load_mtp` / `load_block`.

    residency: a `residency.Residency` (an expert budget): the layers it manages get device slots;
    the others (the MTP block) whole stacks.
    """

    def __init__(self, f: GGUFFile, config: ModelConfig, run: RunConfig = RunConfig(), residency: Any = None):
        self.gguf, self.config, self.run, self.residency = f, config, run, residency

    def modules(self) -> Callable[[int], nnx.Module]:
        """A factory for one model build (layers of one build share the residency's staging buffers)."""
        shared: dict = {}

        def make(layer: int) -> nnx.Module:
            if self.residency is not None:
                m = self.residency.experts_module(layer, self.run, shared)
                if m is not None:
                    return m
            return self._whole(layer)

        return make

    def _whole(self, layer: int) -> nnx.Module:
        """The module of a layer whose every expert is held (no residency, or a layer it leaves alone)."""
        c = self.config
        return RoutedExperts(c.n_expert, c.d_model, c.expert_ff, expert_qtypes(self.gguf, layer), self.run)

    def format(self, layer: int) -> ExpertFormat:
        """How layer `layer`'s expert stacks are held."""
        c = self.config
        fmt = quant.MatrixFormat.for_run(self.run)
        return ExpertFormat(fmt, expert_qtypes(self.gguf, layer), c.d_model, c.expert_ff)

    def source(self, layer: int, path: tuple) -> Callable[[], Any]:
        """The loader of one param of `modules()(layer)`, by its path inside that module."""
        if self.residency is not None and layer in self.residency.plan.layers:
            return self.residency.source(layer, path)
        if len(path) != 1 or path[0] not in EXPERT_MATRICES:
            raise KeyError(path)
        return lambda: self._stack(layer, path[0])

    def _stack(self, layer: int, which: str) -> quant.QTensor:
        """Expert matrix `which` of a layer as its QTensor stack (the file's bytes laid out once)."""
        return self.format(layer).pack(expert_raw(self.gguf, layer, which), which)
