"""Routed experts: dispatch (token -> expert bucketing, per-token reference, grouped fast path) over
QTensor expert stacks [E, rows, cols] (`sharpi_jax.quant`).

Residency and streaming live in their own modules beside this one.
"""

from sharpi_jax.experts.dispatch import (
    MODES,
    ROW_KERNELS,
    Buckets,
    DispatchConfig,
    StackView,
    bucket,
    check_experts,
    dispatch_counts,
    dispatch_stats,
    expert_ffn,
    routed_experts,
    row_tiles,
    weighted_reduce,
)

__all__ = [
    "MODES",
    "ROW_KERNELS",
    "Buckets",
    "DispatchConfig",
    "StackView",
    "bucket",
    "check_experts",
    "dispatch_counts",
    "dispatch_stats",
    "expert_ffn",
    "routed_experts",
    "row_tiles",
    "weighted_reduce",
]
