"""The one list of MoE execution strategies: names -> ``"module:Class"`` (or the class itself).

Torch-free and at the bottom of the package (it imports only :mod:`moesaic.checks`), so that
``MoEConfig`` validates ``dispatcher`` against it without importing torch or the strategies, which
themselves import the config. Config validation, ``moesaic bench layer`` and the tests all read
``strategy_names()``; a new strategy is one module plus one line here. User code outside the
package registers its own without editing it:

* ``register_strategy(name, "module:Class")``: in this process only;
* the environment variable ``MOESAIC_STRATEGIES="name=module:Class,..."``: in every process
  started with that environment too (``moesaic train``'s torchrun workers, spawned test worlds),
  the module found on ``PYTHONPATH``.

A strategy with options (``MoEConfig.options``: a :class:`~moesaic.strategy_options.
StrategyOptions` subclass, e.g. ``hybrid``'s domain sizes) names their class in the same entry,
``("module:Class", "module:Options")`` (``register_strategy(..., options=...)``,
``name=module:Class+module:Options`` in the environment), in a module that does not import
torch: ``MoEConfig`` resolves it (:func:`options_class`) when it is built, in torch-free
processes too (``moesaic sim``, ``moesaic plan``). A strategy registered as a class object brings
its ``options_class``; one without options needs nothing.

:mod:`moesaic.strategies.registry` builds the classes.
"""

from __future__ import annotations

import importlib
import os

from moesaic.checks import check_one_of
from moesaic.strategy_options import StrategyOptions

__all__ = [
    "ENV_VAR",
    "options_class",
    "register_strategy",
    "resolve_strategy",
    "strategy_names",
]

# Strategies of user modules, for every process that inherits the environment.
ENV_VAR = "MOESAIC_STRATEGIES"

# A class or its "module:Class" path.
Target = str | type
# name -> the strategy, or (the strategy, its options class); order = the order benchmarks and
# tests list them in. The one deliberate piece of module-level mutable state: a registry that
# user code may extend.
_TARGETS: dict[str, Target | tuple[Target, Target]] = {
    "dropless": "moesaic.strategies.dropless:DroplessStrategy",
    "padded": "moesaic.strategies.padded:PaddedStrategy",
    "hybrid": (
        "moesaic.strategies.hybrid:HybridStrategy",
        "moesaic.strategies.hybrid_options:HybridOptions",
    ),
    "taskflow": (
        "moesaic.strategies.taskflow:TaskflowStrategy",
        "moesaic.strategies.taskflow_options:TaskflowOptions",
    ),
}


def strategy_names() -> tuple[str, ...]:
    """Every registered strategy name: built-in ones first, then ``register_strategy``'s, then
    those of ``MOESAIC_STRATEGIES``."""
    return (*_TARGETS, *(n for n in _env_targets() if n not in _TARGETS))


def _env_targets() -> dict[str, str | tuple[str, str]]:
    """``MOESAIC_STRATEGIES`` as ``{name: "module:Class"}`` or, for an entry
    ``name=module:Class+module:Options``, ``{name: ("module:Class", "module:Options")}`` (read
    on every call: cheap, and a test may change it).

    Raises:
        ValueError: an entry is not ``name=module:Class[+module:Options]``, or names a strategy
            registered otherwise (built in or by ``register_strategy``).
    """
    out: dict[str, str | tuple[str, str]] = {}
    for entry in filter(None, (e.strip() for e in os.environ.get(ENV_VAR, "").split(","))):
        name, eq, targets = (part.strip() for part in entry.partition("="))
        target, plus, options = (part.strip() for part in targets.partition("+"))
        if not (name and eq and _is_path(target) and (not plus or _is_path(options))):
            raise ValueError(
                f"{ENV_VAR}: entry {entry!r} must be name=module:Class or "
                "name=module:Class+module:Options (several separated by commas)"
            )
        if name in _TARGETS:
            raise ValueError(
                f"{ENV_VAR}: strategy {name!r} is already registered ({_TARGETS[name]!r})"
            )
        out[name] = (target, options) if plus else target
    return out


def _is_path(target: str) -> bool:
    """Whether ``target`` reads ``module:Attr``."""
    module, colon, attr = target.partition(":")
    return bool(module and colon and attr)


def register_strategy(name: str, target: str | type, *, options: str | type | None = None) -> None:
    """Register a strategy class (or its ``"module:Class"`` path) under ``name``.

    Args:
        name: the strategy's name (``MoEConfig.dispatcher``).
        target: the class, or ``"module:Class"`` (imported on first use).
        options: its options class (or ``"module:Options"``, from a module that does not
            import torch); None: none, or the ``options_class`` of a ``target`` class.

    Raises:
        ValueError: ``name`` is empty, already registered to something else, or named by
            ``MOESAIC_STRATEGIES``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"strategy name must be a non-empty string, got {name!r}")
    entry = target if options is None else (target, options)
    old = _TARGETS.get(name)
    if old is not None and old != entry:
        raise ValueError(f"strategy {name!r} is already registered ({old!r})")
    if name in _env_targets():
        raise ValueError(f"strategy {name!r} is already registered (by {ENV_VAR})")
    _TARGETS[name] = entry


def _entry(name: str) -> Target | tuple[Target, Target]:
    """The registry entry of ``name`` (checked to be registered)."""
    check_one_of("dispatcher", name, strategy_names())
    return _TARGETS.get(name) or _env_targets()[name]


def _strategy_target(entry: Target | tuple[Target, Target]) -> Target:
    return entry[0] if isinstance(entry, tuple) else entry


def options_class(name: str) -> type[StrategyOptions]:
    """The options class of strategy ``name`` (``MoEConfig.options``), without importing the
    strategy's own module: the class its entry names, the ``options_class`` of a strategy
    registered as a class object, else :class:`StrategyOptions` (no options).

    Raises:
        ValueError: ``name`` is not registered, or its options class is not there or is not a
            ``StrategyOptions`` subclass.
    """
    entry = _entry(name)
    if not isinstance(entry, tuple):
        found = getattr(entry, "options_class", StrategyOptions)
        return found if isinstance(found, type) else StrategyOptions
    target = entry[1]
    resolved = _import(name, target) if isinstance(target, str) else target
    if not (isinstance(resolved, type) and issubclass(resolved, StrategyOptions)):
        raise ValueError(
            f"strategy {name!r}: its options {target!r} are not a StrategyOptions subclass"
        )
    if name in _TARGETS:
        _TARGETS[name] = (entry[0], resolved)
    return resolved


def resolve_strategy(name: str) -> type:
    """The class registered under ``name``, its module imported on first use.

    Raises:
        ValueError: no strategy is registered under ``name`` (the message lists the names), or
            its module or class is not there.
    """
    entry = _entry(name)
    target = _strategy_target(entry)
    resolved = _import(name, target) if isinstance(target, str) else target
    if not isinstance(resolved, type):
        raise TypeError(f"strategy {name!r} resolves to {resolved!r}, which is not a class")
    if name in _TARGETS:  # the environment's are looked up again (importlib caches them)
        _TARGETS[name] = (resolved, entry[1]) if isinstance(entry, tuple) else resolved
    return resolved


def _import(name: str, target: str) -> object:
    """``"module:Class"`` -> the class; a module or class that is not there is named."""
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module.startswith(exc.name):
            raise  # a module the strategy's module imports: its own error says which
        raise ValueError(
            f"strategy {name!r} is registered as {target!r}, but module {exc.name!r} is not "
            "found (is its directory on PYTHONPATH?)"
        ) from None
    except AttributeError:
        raise ValueError(
            f"strategy {name!r} is registered as {target!r}, but module {module!r} has no {attr!r}"
        ) from None
