"""What one simulation runs: a strategy and a schedule, two separate axes.

* the **strategy** (``STRATEGIES``) is how an MoE layer moves rows and experts: the registered
  strategies (:mod:`moesaic.strategy_table`) the simulator has a cost model for, ``dropless``,
  ``padded``, ``hybrid`` and ``taskflow``;
* the **schedule** (:mod:`moesaic.schedule_table`) is how a training step orders its stages:
  ``vanilla`` (one forward, one backward, one gradient all-reduce), ``moe-only`` (R chunks, the
  MoE layer's all-to-alls pipelined with the experts) and ``flowmoe`` (R chunks, attention
  pipelined too, Sp-byte all-reduce chunks in the gaps) built in. The simulator prices a
  schedule by its declared ``pricing`` key (``PRICINGS``) from its traits; a registered schedule
  without a key it knows is refused naming the reason (:func:`check_schedule`), never priced
  as another.

Every strategy runs every schedule but ``taskflow``, which runs the schedules that are not
pipelined only (``UNPIPELINED_ONLY``). A :class:`Run` is one pair; its name is
``strategy+schedule`` (``hybrid+flowmoe``), the label of its outputs.

Until 2026-12 one name mixed the two (``LEGACY_NAMES``): ``vanilla``, ``moe-only`` and
``flowmoe`` were dropless under that schedule, ``ep`` classic EP as HybridEP's benchmark runs
it (``hybrid`` with every domain of size 1, under ``vanilla``), ``hybrid`` and ``taskflow``
themselves under ``vanilla``. :func:`legacy_run` reads them; the API and the CLI accept them
with a deprecation note. Torch-free.
"""

from __future__ import annotations

from typing import NamedTuple

from moesaic.checks import check_one_of
from moesaic.cluster.spec import ClusterSpec
from moesaic.schedule_table import ScheduleSpec, schedule_names, schedule_spec
from moesaic.sim.model import ModelSpec
from moesaic.strategy_table import strategy_names

__all__ = [
    "LEGACY_NAMES",
    "PRICINGS",
    "STRATEGIES",
    "UNPIPELINED_ONLY",
    "Run",
    "check_run",
    "check_schedule",
    "legacy_note",
    "legacy_run",
    "priced_schedules",
    "runs",
    "unsupported_reason",
]

STRATEGIES = ("dropless", "padded", "hybrid", "taskflow")
# A schedule's pricing key (``ScheduleSpec.pricing``) -> the model that prices it. Only
# "block-pipeline": ``sim/pipelined.run_pipelined``'s step graph, shaped by the schedule's
# traits: R chunks if ``pipelined`` (else the whole batch) with the health flags gathered while
# the last gradients travel (``_PipelinedStep._gather_early``), FlowMoE's order if
# ``overlaps_attention``, Sp-byte all-reduce chunks in the gaps if ``reduce_in_backward`` (else
# one all-reduce after the backward).
PRICINGS = {
    "block-pipeline": "the block pipeline's step graph (sim/pipelined.py), shaped by the "
    "schedule's traits",
}
# strategy -> why it runs only the schedules that are not pipelined. The strategies declare it
# too (``MoEStrategy.supports``), but their classes import torch and this package does not; a
# test keeps the two in step.
UNPIPELINED_ONLY = {
    "taskflow": "taskflow runs no pipelined schedule: its dispatch, GEMMs and combine are "
    "fused into tile tasks",
}
# old mixed name -> (strategy, schedule); "ep" also sets every domain size to 1
LEGACY_NAMES = {
    "vanilla": ("dropless", "vanilla"),
    "moe-only": ("dropless", "moe-only"),
    "flowmoe": ("dropless", "flowmoe"),
    "ep": ("hybrid", "vanilla"),
}
LAYER_ONLY_UNSUPPORTED = ("hybrid",)  # HybridEP's step model has no layer-only mode


class Run(NamedTuple):
    """One simulated pair: a strategy under a schedule."""

    strategy: str
    schedule: str

    @property
    def name(self) -> str:
        """``strategy+schedule``: the label of the run's outputs."""
        return f"{self.strategy}+{self.schedule}"

    @property
    def traits(self) -> ScheduleSpec:
        """The schedule's traits (``moesaic.schedule_table``), which shape its pricing."""
        return schedule_spec(self.schedule)


def unpriced_reason(schedule: str) -> str | None:
    """Why the simulator cannot price the registered ``schedule`` (None: it can)."""
    key = schedule_spec(schedule).pricing
    if key in PRICINGS:
        return None
    said = "declares no pricing" if key is None else f"declares pricing {key!r}, unknown here"
    return (
        f"schedule {schedule!r} is registered (moesaic.schedule_table) but {said}: the "
        f"simulator prices the schedules declared with pricing {', '.join(map(repr, PRICINGS))}"
    )


def priced_schedules() -> tuple[str, ...]:
    """The registered schedules the simulator prices, in registry order."""
    return tuple(s for s in schedule_names() if unpriced_reason(s) is None)


def check_schedule(schedule: object) -> str:
    """``schedule`` is one the simulator prices; a registered one it does not price is a
    ValueError saying why, an unknown name one naming the parameter and the schedules."""
    name = check_one_of("schedule", schedule, schedule_names())
    why = unpriced_reason(name)
    if why is not None:
        raise ValueError(why)
    return name


def check_strategy(strategy: object) -> str:
    """``strategy`` is one the simulator prices; a registered one it does not price, or an
    unknown name, is a ValueError naming the parameter and the priced ones."""
    if isinstance(strategy, str) and strategy in STRATEGIES:
        return strategy
    if strategy in strategy_names():
        raise ValueError(
            f"strategy {strategy!r} is registered (moesaic.strategy_table) but the simulator "
            f"has no cost model for it; it prices {', '.join(map(repr, STRATEGIES))}"
        )
    return check_one_of("strategy", strategy, STRATEGIES)


def check_run(strategy: object, schedule: object) -> Run:
    """The run of ``strategy`` under ``schedule``.

    Raises:
        ValueError: an unknown (or unpriced) strategy or schedule, or a pair that cannot run
            (``taskflow`` under a pipelined schedule), naming the parameter and the rule.
    """
    name = check_strategy(strategy)
    sched = check_schedule(schedule)
    if schedule_spec(sched).pipelined and name in UNPIPELINED_ONLY:
        why = UNPIPELINED_ONLY[name]
        raise ValueError(f"schedule ({sched!r}) cannot run strategy {name!r}: {why}")
    return Run(name, sched)


def runs(strategy: str, schedule: str) -> list[Run]:
    """The runs of ``strategy`` under ``schedule``, either of them ``"all"``: every pair that can
    run, strategy by strategy (under ``schedule="all"`` a strategy that runs no pipelined
    schedule runs the others; under a named pipelined schedule ``strategy="all"`` leaves it
    out; ``schedule="all"`` includes a registered schedule the simulator does not price, which
    :func:`unsupported_reason` names). Two names: that pair, refused if it cannot run
    (:func:`check_run`)."""
    if strategy != "all" and schedule != "all":
        return [check_run(strategy, schedule)]
    names = STRATEGIES if strategy == "all" else (check_strategy(strategy),)
    scheds = schedule_names() if schedule == "all" else (check_schedule(schedule),)
    return [
        Run(n, s)
        for n in names
        for s in scheds
        if not schedule_spec(s).pipelined or n not in UNPIPELINED_ONLY
    ]


def legacy_run(name: object, num_levels: int) -> tuple[Run, tuple[int, ...] | None] | None:
    """The run an old mixed name stood for (``LEGACY_NAMES``) and the domain sizes it fixes
    (``ep``: every level's 1; None: none), or None for any other name."""
    pair = LEGACY_NAMES.get(name) if isinstance(name, str) else None
    if pair is None:
        return None
    return Run(*pair), (1,) * num_levels if name == "ep" else None


def legacy_note(name: str) -> str:
    """What an old mixed name is read as, in words (the deprecation note)."""
    strategy, schedule = LEGACY_NAMES[name]
    domains = " with every domain of size 1" if name == "ep" else ""
    return (
        f"strategy {name!r} is deprecated (strategy and schedule are separate now): it is "
        f"strategy {strategy!r}{domains} under schedule {schedule!r}"
    )


def unsupported_reason(spec: ClusterSpec, model: ModelSpec, run: Run) -> str | None:
    """Why ``run`` cannot simulate ``model`` on ``spec`` whatever its options (None: it can):
    what ``--strategy all`` leaves out, in words."""
    from moesaic.sim.taskflow import MAX_RANKS

    unpriced = unpriced_reason(run.schedule)
    if unpriced is not None:
        return unpriced
    if model.layer_only and run.strategy in LAYER_ONLY_UNSUPPORTED:
        return "no layer-only cost model: model.layer_only is set"
    if run.strategy == "taskflow" and spec.world_size > MAX_RANKS:
        return f"simulates worlds of <= {MAX_RANKS} ranks, the cluster has {spec.world_size}"
    return None
