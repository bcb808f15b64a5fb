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

:mod:`moesaic.strategies.registry` builds the classes.
"""

from __future__ import annotations

import importlib
import os

from moesaic.checks import check_one_of

__all__ = ["ENV_VAR", "register_strategy", "resolve_strategy", "strategy_names"]

# Strategies of user modules, for every process that inherits the environment.
ENV_VAR = "MOESAIC_STRATEGIES"

# name -> class or "module:Class"; order = the order benchmarks and tests list them in. The one
# deliberate piece of module-level mutable state: a registry that user code may extend.
_TARGETS: dict[str, str | type] = {
    "dropless": "moesaic.strategies.dropless:DroplessStrategy",
    "padded": "moesaic.strategies.padded:PaddedStrategy",
    "hybrid": "moesaic.strategies.hybrid:HybridStrategy",
    "taskflow": "moesaic.strategies.taskflow:TaskflowStrategy",
}


def strategy_names() -> tuple[str, ...]:
    """Every registered strategy name: built-in ones first, then ``register_strategy``'s, then
    those of ``MOESAIC_STRATEGIES``."""
    return (*_TARGETS, *(n for n in _env_targets() if n not in _TARGETS))


def _env_targets() -> dict[str, str]:
    """``MOESAIC_STRATEGIES`` as ``{name: "module:Class"}`` (read on every call: cheap, and a
    test may change it).

    Raises:
        ValueError: an entry is not ``name=module:Class``, or names a strategy registered
            otherwise (built in or by ``register_strategy``).
    """
    out: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in os.environ.get(ENV_VAR, "").split(","))):
        name, eq, target = (part.strip() for part in entry.partition("="))
        module, colon, attr = target.partition(":")
        if not (name and eq and module and colon and attr):
            raise ValueError(
                f"{ENV_VAR}: entry {entry!r} must be name=module:Class (several separated by "
                "commas)"
            )
        if name in _TARGETS:
            raise ValueError(
                f"{ENV_VAR}: strategy {name!r} is already registered ({_TARGETS[name]!r})"
            )
        out[name] = target
    return out


def register_strategy(name: str, target: str | type) -> None:
    """Register a strategy class (or its ``"module:Class"`` path) under ``name``.

    Raises:
        ValueError: ``name`` is empty, already registered to something else, or named by
            ``MOESAIC_STRATEGIES``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"strategy name must be a non-empty string, got {name!r}")
    old = _TARGETS.get(name)
    if old is not None and old != target:
        raise ValueError(f"strategy {name!r} is already registered ({old!r})")
    if name in _env_targets():
        raise ValueError(f"strategy {name!r} is already registered (by {ENV_VAR})")
    _TARGETS[name] = target


def resolve_strategy(name: str) -> type:
    """The class registered under ``name``, its module imported on first use.

    Raises:
        ValueError: no strategy is registered under ``name`` (the message lists the names), or
            its module or class is not there.
    """
    check_one_of("dispatcher", name, strategy_names())
    target = _TARGETS.get(name) or _env_targets()[name]
    resolved = _import(name, target) if isinstance(target, str) else target
    if not isinstance(resolved, type):
        raise TypeError(f"strategy {name!r} resolves to {resolved!r}, which is not a class")
    if name in _TARGETS:  # the environment's are looked up again (importlib caches them)
        _TARGETS[name] = resolved
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
