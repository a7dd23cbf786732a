"""Routed experts: dispatch (token -> expert bucketing, per-token reference, grouped fast path).

Residency and streaming live in their own modules beside this one.
"""

from sharpi_jax.experts.dispatch import (
    MODES,
    ROW_KERNELS,
    Buckets,
    DispatchConfig,
    ExpertWeights,
    PackedExpertWeights,
    bucket,
    dispatch_counts,
    dispatch_stats,
    expert_ffn,
    pack_expert_weights,
    routed_experts,
    row_tiles,
    weighted_reduce,
)

__all__ = [
    "MODES",
    "ROW_KERNELS",
    "Buckets",
    "DispatchConfig",
    "ExpertWeights",
    "PackedExpertWeights",
    "bucket",
    "dispatch_counts",
    "dispatch_stats",
    "expert_ffn",
    "pack_expert_weights",
    "routed_experts",
    "row_tiles",
    "weighted_reduce",
]
