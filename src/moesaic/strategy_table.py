"""The one list of MoE execution strategies: names -> ``"module:Class"`` (or the class itself).

Torch-free and at the bottom of the package (it imports only :mod:`moesaic.checks`), so that
``MoEConfig`` validates ``dispatcher`` against it without importing torch or the strategies, which
themselves import the config. Config validation, ``moesaic bench layer`` and the tests all read
``strategy_names()``; a new strategy is one module plus one line here (or a ``register_strategy``
call from user code). :mod:`moesaic.strategies.registry` builds the classes.
"""

from __future__ import annotations

import importlib

from moesaic.checks import check_one_of

__all__ = ["register_strategy", "resolve_strategy", "strategy_names"]

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


def resolve_strategy(name: str) -> type:
    """The class registered under ``name``, its module imported on first use.

    Raises:
        ValueError: no strategy is registered under ``name`` (the message lists the names).
    """
    check_one_of("dispatcher", name, strategy_names())
    target = _TARGETS[name]
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
        _TARGETS[name] = target
    if not isinstance(target, type):
        raise TypeError(f"strategy {name!r} resolves to {target!r}, which is not a class")
    return target
