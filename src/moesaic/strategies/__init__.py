"""MoE execution strategies: how routed tokens reach their experts and come back.

Every strategy implements ``MoEStrategy.forward(x_TH, plan, experts) -> StrategyOutput``;
``dropless`` and ``padded`` are dispatch/combine strategies (``DispatchCombineStrategy``). The
registry (``strategy_names``, ``register_strategy``, ``make_strategy``) is torch-free; the classes
are imported on first use.
"""

from moesaic.strategies.registry import (
    get_strategy,
    make_strategy,
    register_strategy,
    strategy_names,
)

__all__ = ["get_strategy", "make_strategy", "register_strategy", "strategy_names"]
