"""Strategy names -> built strategies: :func:`get_strategy` and :func:`make_strategy`.

The list of names itself is :mod:`moesaic.strategy_table` (torch-free, below the config that
validates against it); this module only resolves a name to its class and builds it. Torch-free
too: the classes are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from moesaic.strategy_table import register_strategy, resolve_strategy, strategy_names

if TYPE_CHECKING:
    from moesaic.strategies.base import MoEStrategy, StrategyContext

__all__ = ["get_strategy", "make_strategy", "register_strategy", "strategy_names"]


def get_strategy(name: str) -> type[MoEStrategy]:
    """The class registered under ``name`` (imports its module on first use)."""
    return cast("type[MoEStrategy]", resolve_strategy(name))


def make_strategy(name: str, ctx: StrategyContext) -> MoEStrategy:
    """Build strategy ``name`` for ``ctx`` after checking that ``ctx`` has what it needs."""
    cls = get_strategy(name)
    missing = sorted(need for need in cls.needs if getattr(ctx, need, None) is None)
    if missing:
        raise ValueError(
            f"dispatcher {name!r} needs {', '.join(missing)}: pass "
            + ", ".join(f"{m}=..." for m in missing)
            + " to MoELayer"
        )
    return cls(ctx)
