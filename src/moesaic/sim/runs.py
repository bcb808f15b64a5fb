"""What one simulation runs: a strategy and a schedule, two separate axes.

* the **strategy** (``STRATEGIES``) is how an MoE layer moves rows and experts: the registered
  strategies (:mod:`moesaic.strategy_table`) the simulator has a cost model for, ``dropless``,
  ``padded``, ``hybrid`` and ``taskflow``;
* the **schedule** (``SCHEDULES``, :func:`moesaic.schedule.schedule_names`) is how a training
  step orders its stages: ``vanilla`` (one forward, one backward, one gradient all-reduce),
  ``moe-only`` (R chunks, the MoE layer's all-to-alls pipelined with the experts) and
  ``flowmoe`` (R chunks, attention pipelined too, Sp-byte all-reduce chunks in the gaps).

Every strategy runs every schedule but ``taskflow``, which runs ``vanilla`` only
(``VANILLA_ONLY``). A :class:`Run` is one pair; its name is ``strategy+schedule``
(``hybrid+flowmoe``), the label of its outputs.

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
from moesaic.schedule import schedule_names
from moesaic.sim.model import ModelSpec
from moesaic.strategy_table import strategy_names

__all__ = [
    "LEGACY_NAMES",
    "SCHEDULES",
    "STRATEGIES",
    "VANILLA_ONLY",
    "Run",
    "check_run",
    "legacy_note",
    "legacy_run",
    "runs",
    "unsupported_reason",
]

STRATEGIES = ("dropless", "padded", "hybrid", "taskflow")
SCHEDULES = schedule_names()
# strategy -> why it runs the vanilla schedule only. The strategies declare it too
# (``MoEStrategy.supports``), but their classes import torch and this package does not; a test
# keeps the two in step.
VANILLA_ONLY = {
    "taskflow": "taskflow runs vanilla only: its dispatch, GEMMs and combine are fused into "
    "tile tasks",
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
    sched = check_one_of("schedule", schedule, SCHEDULES)
    if sched != "vanilla" and name in VANILLA_ONLY:
        raise ValueError(f"schedule ({sched!r}) cannot run strategy {name!r}: {VANILLA_ONLY[name]}")
    return Run(name, sched)


def runs(strategy: str, schedule: str) -> list[Run]:
    """The runs of ``strategy`` under ``schedule``, either of them ``"all"``: every pair that can
    run, strategy by strategy (under ``schedule="all"`` a vanilla-only strategy runs vanilla;
    under a named pipelined schedule ``strategy="all"`` leaves it out). Two names: that pair,
    refused if it cannot run (:func:`check_run`)."""
    if strategy != "all" and schedule != "all":
        return [check_run(strategy, schedule)]
    names = STRATEGIES if strategy == "all" else (check_strategy(strategy),)
    scheds = SCHEDULES if schedule == "all" else (check_one_of("schedule", schedule, SCHEDULES),)
    return [Run(n, s) for n in names for s in scheds if s == "vanilla" or n not in VANILLA_ONLY]


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

    if model.layer_only and run.strategy in LAYER_ONLY_UNSUPPORTED:
        return "no layer-only cost model: model.layer_only is set"
    if run.strategy == "taskflow" and spec.world_size > MAX_RANKS:
        return f"simulates worlds of <= {MAX_RANKS} ranks, the cluster has {spec.world_size}"
    return None
