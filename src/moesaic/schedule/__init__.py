"""Training-step schedules: how one optimizer step runs forward, backward, gradient
synchronisation and the update.

A schedule is a ``TrainStep`` (``schedule/base.py``) registered with its traits in
:mod:`moesaic.schedule_table` (torch-free, the one list of names: ``TrainConfig.schedule`` is
validated against it, ``moesaic train --schedule NAME`` selects from it, the simulator prices
from it, and the tests run every entry). This module imports the registered classes.

Adding a schedule: write ``schedule/<name>.py`` with a ``TrainStep`` subclass, add its
``ScheduleSpec`` to the table (or register it from user code), and ``tests/train/test_step.py``
runs it against the vanilla step.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from moesaic.schedule_table import schedule_names, schedule_spec

if TYPE_CHECKING:
    from moesaic.schedule.base import StepParts, TrainStep


def step_class(name: str) -> type[TrainStep]:
    """The ``TrainStep`` class registered as ``name`` (imports it: torch).

    Raises:
        ValueError: ``name`` is not registered, its class is not there, or the class's
            ``name`` is another one (its traits are read by that name).
    """
    target = schedule_spec(name).step
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except AttributeError:
            raise ValueError(
                f"schedule {name!r} names {target!r}, but module {module!r} has no {attr!r}"
            ) from None
    if not isinstance(target, type) or getattr(target, "name", None) != name:
        raise ValueError(
            f"schedule {name!r}: {target!r} must be a TrainStep class whose name is {name!r}"
        )
    step_cls: type[TrainStep] = target
    return step_cls


def make_step(name: str, parts: StepParts) -> TrainStep:
    """The ``TrainStep`` registered as ``name``, built on ``parts``."""
    return step_class(name)(parts)


__all__ = ["make_step", "schedule_names", "step_class"]
