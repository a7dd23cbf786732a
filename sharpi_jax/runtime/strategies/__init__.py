"""The generation strategies, one module each: `plain` (MTP off), `chain` (MTP chain drafts), `tree` (MTP
draft trees). Each holds its host loop and its device loop's body (`base.Strategy`); the device loops'
shared skeleton is `runtime.device_loop`. `strategy_for` picks the strategy by the type of
`GenerateOptions.speculation`."""

from __future__ import annotations

from sharpi_jax.runtime.options import Chain, Tree
from sharpi_jax.runtime.strategies.base import Strategy
from sharpi_jax.runtime.strategies.chain import ChainStrategy
from sharpi_jax.runtime.strategies.plain import PlainStrategy
from sharpi_jax.runtime.strategies.tree import TreeStrategy

__all__ = ["ChainStrategy", "PlainStrategy", "Strategy", "TreeStrategy", "strategy_for"]


def strategy_for(speculation: Chain | Tree | None) -> Strategy:
    """The strategy of `GenerateOptions.speculation`: None (MTP off), a `Chain` or a `Tree`."""
    match speculation:
        case None:
            return PlainStrategy()
        case Chain():
            return ChainStrategy()
        case Tree():
            return TreeStrategy()
    raise TypeError(f"speculation must be None, a Chain or a Tree, got {type(speculation).__name__}")
