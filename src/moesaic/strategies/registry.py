"""The one list of MoE execution strategies: names -> classes, imported lazily.

Torch-free, so that ``MoEConfig`` validates ``dispatcher`` against it without importing torch.
Config validation, ``moesaic bench layer`` and the tests all read ``strategy_names()``; a new
strategy is one module plus one line here (or a ``register_strategy`` call from user code).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from moesaic.checks import check_one_of

if TYPE_CHECKING:
    from moesaic.strategies.base import MoEStrategy, StrategyContext

# name -> class or "module:Class"; order = the order benchmarks and tests list them in. The one
# deliberate piece of module-level mutable state: a registry that user code may extend.
_TARGETS: dict[str, str | type] = {
    "dropless": "moesaic.strategies.dropless:DroplessStrategy",
    "padded": "moesaic.strategies.padded:PaddedStrategy",
    "hybrid": "moesaic.strategies.hybrid:HybridStrategy",
    "taskflow": "moesaic.strategies.taskflow:TaskflowStrategy",
}


def strategy_names() -> tuple[str, ...]:
    """Every registered strategy name, built-in ones first."""
    return tuple(_TARGETS)


def register_strategy(name: str, target: str | type) -> None:
    """Register a strategy class (or its ``"module:Class"`` path) under ``name``.

    Raises:
        ValueError: ``name`` is empty or already registered to something else.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"strategy name must be a non-empty string, got {name!r}")
    old = _TARGETS.get(name)
    if old is not None and old != target:
        raise ValueError(f"strategy {name!r} is already registered ({old!r})")
    _TARGETS[name] = target


def get_strategy(name: str) -> type[MoEStrategy]:
    """The class registered under ``name`` (imports its module on first use)."""
    check_one_of("dispatcher", name, strategy_names())
    target = _TARGETS[name]
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
        _TARGETS[name] = target
    assert isinstance(target, type)
    return target


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
