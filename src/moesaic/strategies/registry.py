"""Strategy names -> built strategies: :func:`get_strategy` and :func:`make_strategy`.

The list of names itself is :mod:`moesaic.strategy_table` (torch-free, below the config that
validates against it); this module only resolves a name to its class and builds it. Torch-free
too: the classes are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from moesaic.strategy_table import (
    options_class,
    register_strategy,
    resolve_strategy,
    strategy_names,
)

if TYPE_CHECKING:
    from moesaic.strategies.base import MoEStrategy, StrategyContext

__all__ = [
    "check_supported",
    "get_strategy",
    "make_strategy",
    "register_strategy",
    "strategy_names",
]


def get_strategy(name: str) -> type[MoEStrategy]:
    """The class registered under ``name`` (imports its module on first use).

    Raises:
        ValueError: the class's ``options_class`` is not the options class its registry entry
            names (``MoEConfig`` validates ``options`` by the entry, without the class).
    """
    cls = cast("type[MoEStrategy]", resolve_strategy(name))
    declared, registered = getattr(cls, "options_class", None), options_class(name)
    if declared is not None and declared is not registered:
        raise ValueError(
            f"strategy {name!r}: {cls.__name__}.options_class is {declared.__name__} but its "
            f"registry entry names {registered.__name__}; register it with its options "
            "(register_strategy(name, target, options=...), or name=module:Class+module:Options "
            "in MOESAIC_STRATEGIES)"
        )
    return cls


def make_strategy(name: str, ctx: StrategyContext) -> MoEStrategy:
    """Build strategy ``name`` for ``ctx``."""
    return get_strategy(name)(ctx)


def check_supported(
    name: str, *, schedule: str | None = None, capacity: bool = False, sharded: bool = False
) -> None:
    """Refuse what strategy ``name`` does not support (its ``supports``), naming why.

    Raises:
        ValueError: the strategy, the schedule or option (``sharded``: FSDP2), and the
            strategy's reason.
    """
    get_strategy(name).supports.check(name, schedule=schedule, capacity=capacity, sharded=sharded)
