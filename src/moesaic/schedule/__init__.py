"""Training-step schedules: how one optimizer step runs forward, backward, gradient
synchronisation and the update.

A schedule is a ``TrainStep`` (``schedule/base.py``). The registry below is the one list of
names: ``TrainConfig.schedule`` is validated against it, ``moesaic train --schedule NAME``
selects from it, and the tests run every entry. Names map to ``"module:Class"`` strings so that
this module stays torch-free (config validation and ``--help`` never import torch).

Adding a schedule: write ``schedule/<name>.py`` with a ``TrainStep`` subclass, add it here, and
``tests/train/test_step.py`` runs it against the vanilla step.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moesaic.schedule.base import StepParts, TrainStep

# name -> "module:class". "vanilla" first: the default and the reference of the others.
SCHEDULES = {
    "vanilla": "moesaic.schedule.vanilla:VanillaStep",
    "moe-only": "moesaic.schedule.flowmoe:MoeOnlyStep",
    "flowmoe": "moesaic.schedule.flowmoe:FlowMoEStep",
}


def schedule_names() -> tuple[str, ...]:
    """The registered schedule names, the default first."""
    return tuple(SCHEDULES)


def step_class(name: str) -> type[TrainStep]:
    """The ``TrainStep`` class registered as ``name`` (imports it: torch), for its traits."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule ({name!r}) must be one of {', '.join(map(repr, SCHEDULES))}")
    module, cls = SCHEDULES[name].split(":")
    step_cls: type[TrainStep] = getattr(importlib.import_module(module), cls)
    return step_cls


def make_step(name: str, parts: StepParts) -> TrainStep:
    """The ``TrainStep`` registered as ``name``, built on ``parts``."""
    return step_class(name)(parts)


__all__ = ["SCHEDULES", "make_step", "schedule_names", "step_class"]
