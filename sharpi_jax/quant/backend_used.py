"""Which backend a matrix actually runs on: the one place that decides, by ggml type and shape, whether
the Pallas kernels take a matrix or it falls back to XLA (dequantize + dot), and says why.

The Pallas grouped matmul reads the types in `pallas_kernels.KERNEL_TYPES` and tiles a [N, K] matrix
when K is a multiple of its 32-column step. Dense matrices have their rows padded at load to a multiple
of 16 (`qtensor.KERNEL_ROWS`), so any N tiles; routed experts (N x K per expert, not padded) need N a
multiple of the dispatch's column tile (64) or a power of two below it.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q

from pallas_kernels import KERNEL_TYPES

PALLAS_TYPES = frozenset(Q[name.upper()] for name in KERNEL_TYPES)
PALLAS_K_STEP = 32  # columns per kernel step
EXPERT_BLOCK_N = 64  # the expert dispatch's column tile (`experts.dispatch.routed_experts` block_n)


def pallas_fits(shape: tuple[int, ...], experts: bool = False) -> bool:
    """Whether the Triton kernel tiles a [..., N, K] matrix (see module doc)."""
    n, k = shape[-2], shape[-1]
    rows_ok = not experts or n % EXPERT_BLOCK_N == 0 or (n < EXPERT_BLOCK_N and n & (n - 1) == 0)
    return k % PALLAS_K_STEP == 0 and rows_ok


def pallas_fallback_reason(qtype: int, shape: tuple[int, ...], experts: bool = False) -> str | None:
    """None when the Pallas kernels take this matrix (one expert's, with `experts`), else why not."""
    if Q(qtype) not in PALLAS_TYPES:
        return f"ggml type {Q(qtype).name} has no Pallas kernel"
    if not pallas_fits(shape, experts):
        rule = f"K % {PALLAS_K_STEP} == 0" + (f", N % {EXPERT_BLOCK_N} == 0" if experts else "")
        return f"shape {shape[-2]}x{shape[-1]} does not tile ({rule})"
    return None


def backend_used(backend: str, qtype: int, shape: tuple[int, ...], experts: bool = False) -> str:
    """The backend a matrix of `qtype` and `shape` (one expert's, with `experts`) runs on when `backend`
    (resolved) is selected: "pallas" falls back to "xla" where `pallas_fallback_reason` says so; the
    other backends serve every type."""
    if backend == "pallas" and pallas_fallback_reason(qtype, shape, experts) is not None:
        return "xla"
    return backend
