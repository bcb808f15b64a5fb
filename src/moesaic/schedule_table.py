"""The one list of training-step schedules and what each one is: names -> :class:`ScheduleSpec`.

Torch-free and at the bottom of the package (it imports only :mod:`moesaic.checks`), like
:mod:`moesaic.strategy_table`: ``TrainConfig`` validates ``schedule`` and the options that
depend on it (``--pipeline-degree``, ``--ar-chunk``, ``--activation-checkpointing``), the
simulator and planner price it, and sharding refuses it, all from the traits declared here,
without importing torch or the step classes. No code outside this table tells schedules apart
by their names.

A spec names its ``TrainStep`` class (``"module:Class"``, imported on first use by
:func:`moesaic.schedule.step_class`) and declares its traits; the step class reads its traits
from here (``TrainStep.spec``). User code outside the package registers its own schedule
without editing this file:

* ``register_schedule(name, spec)``: in this process only;
* the environment variable ``MOESAIC_SCHEDULES="name=module:SPEC,..."``: in every process
  started with that environment too (``moesaic train``'s workers), ``SPEC`` a ``ScheduleSpec``
  in a module on ``PYTHONPATH`` (one that does not import torch keeps ``moesaic simulate`` and
  config validation torch-free).

How the simulator prices a schedule is its ``pricing`` key, which the simulator maps to a
model of its own (``moesaic.sim.runs.PRICINGS``); a key it does not know, or None, is refused
there with the reason, never priced as some other schedule.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from moesaic.checks import check_one_of

__all__ = [
    "DEFAULT_SCHEDULE",
    "ENV_VAR",
    "ScheduleSpec",
    "register_schedule",
    "schedule_names",
    "schedule_spec",
    "schedules_where",
]

ENV_VAR = "MOESAIC_SCHEDULES"


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleSpec:
    """One schedule: its step class and its traits, declared once.

    Attributes:
        step: the ``TrainStep`` subclass as ``"module:Class"`` (or the class itself).
        pipelined: cuts each rank's batch into R chunks (``--pipeline-degree``) and runs the
            model's block stages chunk by chunk (``schedule.pipeline.BlockPipeline``), never
            the model's own forward: R > 1 needs it, ``"auto"`` R is 2 under it, a strategy
            without dispatch/combine phases and a model whose layers do not split into
            stages cannot run under it, and activation checkpointing (which recomputes whole
            block forwards) has no effect under it.
        pools_gradients: all-reduces the gradients through the communication pool in chunks
            of Sp bytes (``--ar-chunk``; ``schedule.pool.CommPool``).
        overlaps_attention: pipelines attention and gate with the all-to-alls too (FlowMoE's
            order); needs ``pipelined``.
        reduce_in_backward: the pool's chunks leave during the backward, in the gaps between
            all-to-alls, Sp tuned online when not given; needs ``pools_gradients``. Otherwise
            the pool reduces after the backward.
        unsharded_why: empty when it runs with FSDP2 sharding (``--dp-shard``); else why not,
            for the refusal.
        pricing: how the simulator prices it, a key of ``moesaic.sim.runs.PRICINGS``; None:
            the simulator has no model of it (refused there, with this said).
        summary: one line for ``--help`` and the docs.
    """

    step: str | type
    pipelined: bool = False
    pools_gradients: bool = False
    overlaps_attention: bool = False
    reduce_in_backward: bool = False
    unsharded_why: str = ""
    pricing: str | None = None
    summary: str = ""

    def __post_init__(self) -> None:
        if self.overlaps_attention and not self.pipelined:
            raise ValueError("ScheduleSpec: overlaps_attention needs pipelined")
        if self.reduce_in_backward and not self.pools_gradients:
            raise ValueError("ScheduleSpec: reduce_in_backward needs pools_gradients")
        if self.pools_gradients and not self.pipelined:
            raise ValueError(
                "ScheduleSpec: pools_gradients needs pipelined (the pool's all-to-all groups "
                "are the pipeline's)"
            )


# The first is the default and the reference of the others. The one deliberate piece of
# module-level mutable state: a registry that user code may extend.
_SPECS: dict[str, ScheduleSpec] = {
    "vanilla": ScheduleSpec(
        step="moesaic.schedule.vanilla:VanillaStep",
        pricing="block-pipeline",
        summary="the whole batch at once, every gradient all-reduced after the backward",
    ),
    "moe-only": ScheduleSpec(
        step="moesaic.schedule.flowmoe:MoeOnlyStep",
        pipelined=True,
        pools_gradients=True,
        pricing="block-pipeline",
        summary="R chunks, the MoE layers' all-to-alls pipelined with the experts",
    ),
    "flowmoe": ScheduleSpec(
        step="moesaic.schedule.flowmoe:FlowMoEStep",
        pipelined=True,
        pools_gradients=True,
        overlaps_attention=True,
        reduce_in_backward=True,
        unsharded_why=(
            "its gradient pool all-reduces Sp-byte chunks in its own priority order in the "
            "gaps between all-to-alls, while FSDP2 reduce-scatters each unit's gradients from "
            "its own backward hook; the pool does not drive FSDP2's reduce-scatters, so the "
            "order FlowMoE is about would not hold"
        ),
        pricing="block-pipeline",
        summary="R chunks, attention pipelined too, gradient all-reduce chunks in the gaps",
    ),
}
DEFAULT_SCHEDULE = next(iter(_SPECS))


def schedule_names() -> tuple[str, ...]:
    """Every registered schedule: the built-in ones (the default first), then
    ``register_schedule``'s, then those of ``MOESAIC_SCHEDULES``."""
    return (*_SPECS, *(n for n in _env_entries() if n not in _SPECS))


def _env_entries() -> dict[str, str]:
    """``MOESAIC_SCHEDULES`` as ``{name: "module:SPEC"}`` (read on every call: cheap, and a
    test may change it).

    Raises:
        ValueError: an entry is not ``name=module:SPEC``, or names a schedule registered
            otherwise.
    """
    out: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in os.environ.get(ENV_VAR, "").split(","))):
        name, eq, target = (part.strip() for part in entry.partition("="))
        module, colon, attr = target.partition(":")
        if not (name and eq and module and colon and attr):
            raise ValueError(
                f"{ENV_VAR}: entry {entry!r} must be name=module:SPEC, SPEC a "
                "moesaic.schedule_table.ScheduleSpec (several separated by commas)"
            )
        if name in _SPECS:
            raise ValueError(f"{ENV_VAR}: schedule {name!r} is already registered")
        out[name] = target
    return out


def register_schedule(name: str, spec: ScheduleSpec) -> None:
    """Register ``spec`` under ``name`` (in this process).

    Raises:
        ValueError: ``name`` is empty or already registered to another spec, or ``spec`` is
            not a ``ScheduleSpec``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"schedule name must be a non-empty string, got {name!r}")
    if not isinstance(spec, ScheduleSpec):
        raise ValueError(f"schedule {name!r}: spec must be a ScheduleSpec, got {spec!r}")
    old = _SPECS.get(name)
    if (old is not None and old != spec) or name in _env_entries():
        raise ValueError(f"schedule {name!r} is already registered")
    _SPECS[name] = spec


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of schedule ``name`` (an environment entry's module imported on first use).

    Raises:
        ValueError: ``name`` is not registered (the message lists the names), or its entry's
            module or attribute is not there or not a ``ScheduleSpec``.
    """
    check_one_of("schedule", name, schedule_names())
    if name in _SPECS:
        return _SPECS[name]
    target = _env_entries()[name]
    module, _, attr = target.partition(":")
    try:
        spec = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module.startswith(exc.name):
            raise
        raise ValueError(
            f"schedule {name!r} is registered as {target!r}, but module {exc.name!r} is not "
            "found (is its directory on PYTHONPATH?)"
        ) from None
    except AttributeError:
        raise ValueError(
            f"schedule {name!r} is registered as {target!r}, but module {module!r} has no {attr!r}"
        ) from None
    if not isinstance(spec, ScheduleSpec):
        raise ValueError(f"schedule {name!r}: {target!r} is not a ScheduleSpec")
    return spec


def schedules_where(trait: str, value: bool = True) -> tuple[str, ...]:
    """The registered schedules whose boolean ``trait`` is ``value`` (for messages)."""
    return tuple(n for n in schedule_names() if getattr(schedule_spec(n), trait) is value)
