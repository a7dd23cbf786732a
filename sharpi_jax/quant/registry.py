"""Kernel backends behind one registry (the tokamax `ragged_dot` shape: a reference and one file per backend).

A backend (`Backend`, one module each under `sharpi_jax.quant.backends`) declares:

- `name`, and `platforms`: the jax platforms it runs on; `auto` ranks it for `kernels="auto"` there
  (highest wins; 0: never picked by "auto"); `unavailable()`: None, or why it cannot run here (a
  native extension that did not load) and the fix, in one line ("auto" then skips it);
- `serves(qtype, shape)`: whether it computes a matrix (or an expert stack [E, rows, cols]) of ggml type
  `qtype`; one it does not serve is held and computed by its `fallback` backend instead (`serving`:
  the one place that decides), and `why_not(qtype, shape)` says why, in words (`sj.load` warns with it);
- `layout(qtype, shape, repack)`: the `QTensor` layout it wants that matrix stored in (chosen once, at
  load, by `matmul.MatrixFormat`); `repacks`: the explicit repackings it accepts;
- `matmul(x, w)`: x float32 [M, K] @ W.T for a QTensor W [N, K] it laid out;
- routed experts, stacks [E, rows, cols] of its layout: either a whole grouped op `expert_rows` (one
  call per MoE layer for all N rows, e.g. a native kernel that reads each used expert once; signature
  `ExpertOp`) or, by default, per-expert hooks that `sharpi_jax.experts.dispatch` composes into its
  grouped / per-token loops: `expert_weight(w, e)` (expert e's matrix, read once per batch; default
  `w.take(e)`), `expert_matmul(x, we, w)` (rows x times that matrix; default `self.matmul`) and
  `expert_ffn` (one expert's SwiGLU from those; a backend with a fused op overrides it); and
  `weighted_reduce` (the rank-order top-k sum; default the shared jnp expression).

`register(backend)` adds one (a backend from outside the package registers the same way); `get(name)`
looks one up; `resolve_kernels("auto", platform)` picks by platform.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from sharpi_jax.pallas_kernels.weighted_reduce import reference as wr_reference
from sharpi_jax.config import REPACKS
from sharpi_jax.errors import InputError
from sharpi_jax.quant.qtensor import QTensor

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class ExpertOptions:
    """Tuning of a backend's grouped expert op (hashable: static under jit). row_kernel / row_tile are
    the composed XLA loops' (see `experts.dispatch`), block_m / block_n / interpret the Pallas kernels'."""

    row_kernel: str = "gemm"
    row_tile: int | None = None
    block_m: int = 16
    block_n: int = 64
    interpret: bool | None = None


# An expert op: (u f32[N, D], sel int32[N, k], (gate, up, down) QTensor stacks, ExpertOptions, valid=None)
#   -> (Y f32[N, k, D] unreduced in rank order, expert reads executed int32[]). valid (bool [N] or None):
#   rows with valid False are bucket padding (zero weights follow); an op may skip them.
ExpertOp = Callable[[jax.Array, jax.Array, tuple[QTensor, QTensor, QTensor], ExpertOptions],
                    tuple[jax.Array, jax.Array]]


class Backend:
    """A kernel backend (see module doc). Subclass, set the class attributes, override what differs."""

    name: str = ""
    platforms: tuple[str, ...] = ()  # jax platforms it runs on ("cpu", "gpu", "cuda", "rocm", "tpu")
    auto: int = 0  # rank for kernels="auto" on its platforms (highest wins; 0: never auto)
    fallback: str | None = None  # holds and computes the matrices this backend does not serve
    repacks: tuple[str | None, ...] = (None, "auto")
    expert_rows: ExpertOp | None = None  # a whole grouped routed-expert op, or None: compose the hooks

    def unavailable(self) -> str | None:
        """None when the backend can run here; else why not and the fix, in one line (e.g. a native
        extension that failed to load). "auto" skips it; naming it explicitly raises that line."""
        return None

    def serves(self, qtype: int, shape: tuple[int, ...]) -> bool:
        """Whether this backend holds and computes a [..., rows, cols] tensor of ggml type `qtype`."""
        raise NotImplementedError

    def why_not(self, qtype: int, shape: tuple[int, ...]) -> str | None:
        """None when `serves(qtype, shape)`; else why not, in words (a backend with finer rules says
        which one the tensor breaks)."""
        if self.serves(qtype, shape):
            return None
        from gguf import GGMLQuantizationType  # pylint: disable=import-outside-toplevel

        return f"{self.name} does not serve ggml type {GGMLQuantizationType(qtype).name} {'x'.join(map(str, shape))}"

    def layout(self, qtype: int, shape: tuple[int, ...], repack: str | None) -> str:
        """The QTensor layout of a served matrix ([rows, cols]) or expert stack ([E, rows, cols])."""
        raise NotImplementedError

    def matmul(self, x: jax.Array, w: QTensor, **options) -> jax.Array:
        """x float32 [M, K] @ W.T -> float32 [M, N], W a QTensor [N, K] in this backend's layout.
        options["rows"] (when given): only rows [0, rows) are needed; a backend may skip the others."""
        raise NotImplementedError

    def expert_weight(self, w: QTensor, e: jax.Array) -> Any:
        """Expert e's matrix of a stack [E, rows, cols] (a pytree of arrays), read once per batch."""
        return w.take(e)

    def expert_matmul(self, x: jax.Array, we: Any, w: QTensor) -> jax.Array:
        """Rows x [R, cols] times an `expert_weight` result -> [R, rows]; w: the stack (static info)."""
        return self.matmul(x, we)

    def expert_ffn(self, x: jax.Array, loaded: tuple[Any, Any, Any], stacks: tuple[QTensor, QTensor, QTensor]
                   ) -> jax.Array:
        """The unweighted SwiGLU expert on rows x [R, D]: down (silu(gate x) * up x), from one expert's
        `expert_weight` results (`stacks`: the three stacks, static info). A backend with a fused expert
        op overrides this so the composed loops give that op's bits."""
        (wg, wu, wd), (g, u, d) = loaded, stacks
        h = jax.nn.silu(self.expert_matmul(x, wg, g)) * self.expert_matmul(x, wu, u)
        return self.expert_matmul(h, wd, d)

    def weighted_reduce(self, y: jax.Array, w: jax.Array, opts: ExpertOptions) -> jax.Array:
        """sum_j w[:, j] * y[:, j] in rank order (y [N, k, D], w [N, k]): the routed experts' output."""
        return wr_reference.weighted_reduce_reference(y, w)


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend, *, replace: bool = False) -> Backend:
    """Adds `backend` under its name (an existing name needs replace=True). Returns it."""
    if not backend.name or backend.name == AUTO:
        raise ValueError(f"a backend needs a name other than {AUTO!r}, got {backend.name!r}")
    if backend.name in _REGISTRY and not replace and _REGISTRY[backend.name] is not backend:
        raise ValueError(f"kernel backend {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Removes a backend (tests that register a fake one)."""
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered backend names, in registration order."""
    return tuple(_REGISTRY)


def kernel_names() -> tuple[str, ...]:
    """What `kernels=` accepts: "auto" and every registered backend."""
    return (AUTO, *names())


def get(name: str) -> Backend:
    """The backend registered as `name` (InputError naming the registered ones otherwise)."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise InputError(f"kernel backend must be one of {names()}, got {name!r}") from None


def resolve_kernels(kernels: str, platform: str | None = None) -> str:
    """"auto" -> the highest-ranked available backend for `platform` (default: jax's); other names are
    checked (registered, and `Backend.unavailable` is None)."""
    if kernels != AUTO:
        if kernels not in _REGISTRY:
            raise InputError(f"kernels must be one of {kernel_names()}, got {kernels!r}")
        reason = _REGISTRY[kernels].unavailable()
        if reason:
            raise InputError(f"kernels={kernels!r} cannot run here: {reason}")
        return kernels
    platform = platform or jax.default_backend()
    ranked = [b for b in _REGISTRY.values() if b.auto > 0 and platform in b.platforms and not b.unavailable()]
    if not ranked:
        raise InputError(f"no kernel backend serves platform {platform!r} (registered: {names()})")
    return max(ranked, key=lambda b: b.auto).name


def serving(name: str, qtype: int, shape: tuple[int, ...]) -> Backend:
    """The backend that holds a tensor for backend `name`: itself if it serves the type, else its
    fallback chain's first that does."""
    seen = []
    b = get(name)
    while not b.serves(qtype, shape):
        seen.append(b.name)
        if b.fallback is None or b.fallback in seen:
            from gguf import GGMLQuantizationType

            raise InputError(f"no kernel backend in {seen} serves ggml type {GGMLQuantizationType(qtype).name}")
        b = get(b.fallback)
    return b


def check_repack(name: str, repack: str | None) -> None:
    """InputError unless `repack` is a known repacking that backend `name` accepts."""
    if repack not in REPACKS:
        raise InputError(f"repack must be one of {REPACKS}, got {repack!r}")
    if repack not in get(name).repacks:
        raise InputError(f"repack={repack!r} is not a {name!r} layout; it does not combine with kernels={name!r}")
