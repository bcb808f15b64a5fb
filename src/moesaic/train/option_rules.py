"""Which ``moesaic train`` options have an effect under which strategy and schedule: one table.

An option (its argparse ``dest``: a ``TrainConfig`` field, or ``model.<field>`` /
``model.moe.<field>``) that applies only to some strategies or schedules has an entry in
:data:`RULES` naming the strategies (``moesaic.strategies.strategy_names()``) or the schedules
(by a trait of theirs, ``moesaic.schedule_table``) it applies to; every other option applies
everywhere. This table is the only data about an option beside its field and doc (the flags are
generated from those: ``moesaic.train.flags``). ``tests/train/test_option_rules.py`` walks the
options of the parser against the strategies and schedules.

:func:`check_applicable` judges only the options the user set (flags and TOML keys, never
defaults), after their values were validated and before anything is created:

* a flag that does not apply is refused (ValueError naming the flag, the strategy or schedule,
  and what the option is for);
* a TOML key that does not apply is accepted with one line saying it has no effect: one file is
  often shared by runs that choose the strategy or schedule on the command line
  (``--config base.toml --schedule flowmoe``), and refusing its other keys would force a file
  per choice.

A strategy option (``model.moe.options.<name>``, a TOML ``[model.moe.options]`` key) without its
own entry applies to the strategies whose options have that name (:func:`rule_of`, from the
strategies' options classes): a new strategy's options need no entry here. What does not apply
is dropped after its note (:func:`drop_other_options`), so that the run's strategy only gets its
own options.

Whether a *value* fits (``--pipeline-degree 2`` needs a pipelined schedule, ``--domains`` must
fit the cluster's levels) stays with the value's own check. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from moesaic.schedule_table import schedule_names, schedule_spec
from moesaic.strategy_table import options_class, strategy_names

__all__ = ["RULES", "Applies", "check_applicable", "drop_other_options", "rule_of"]

# A strategy option's dest: ``model.moe.options.<name>`` (``MoEConfig.options``).
OPTIONS = "model.moe.options."


@dataclass(frozen=True, slots=True)
class Applies:
    """Where an option has an effect.

    Attributes:
        strategies: the strategies it applies to; None = every one.
        schedule_trait: the schedules it applies to, by a boolean trait of theirs
            (``moesaic.schedule_table.ScheduleSpec``): those whose trait is
            ``schedule_value``; None = every one.
        schedule_value: see ``schedule_trait``.
        what: what the option is for, said when it is refused.
    """

    strategies: tuple[str, ...] | None = None
    schedule_trait: str | None = None
    schedule_value: bool = True
    what: str = ""

    def applies_to_schedule(self, schedule: str) -> bool:
        """Whether the option has an effect under the registered ``schedule``."""
        if self.schedule_trait is None:
            return True
        return getattr(schedule_spec(schedule), self.schedule_trait) is self.schedule_value

    def misfit(self, strategy: str, schedule: str) -> tuple[str, str, tuple[str, ...]] | None:
        """``(flag, chosen, names)`` of the first choice this option does not apply to, or
        None when it applies to both."""
        if self.strategies is not None and strategy not in self.strategies:
            return "--strategy", strategy, self.strategies
        if not self.applies_to_schedule(schedule):
            return "--schedule", schedule, tuple(filter(self.applies_to_schedule, schedule_names()))
        return None


EVERYWHERE = Applies()

# option -> where it applies: only the options that apply to some strategies or schedules;
# every other option (a new field included) applies everywhere.
RULES: dict[str, Applies] = {
    "ar_chunk": Applies(
        schedule_trait="pools_gradients",
        what="Sp, the chunk size of their gradient all-reduce pool; a schedule without the pool "
        "all-reduces every gradient at once after the backward",
    ),
    "cluster": Applies(
        strategies=("hybrid",),
        what="the topology whose levels hold hybrid's expert domains; no other strategy reads it",
    ),
    "activation_checkpointing": Applies(
        schedule_trait="pipelined",
        schedule_value=False,
        what="recomputing each block forward in the backward; the pipelined schedules run "
        "the blocks' stages chunk by chunk with their own stage-wise backward, never a whole "
        "block forward to recompute",
    ),
    # ``--domains auto`` (a TOML file may also say ``auto_domains = true``)
    "auto_domains": Applies(
        strategies=("hybrid",),
        what="hybrid's expert domains chosen by the cost model; no other strategy has domains",
    ),
    "model.moe.options.domain_sizes": Applies(
        strategies=("hybrid",),
        what="the sizes of hybrid's expert domains; no other strategy has domains",
    ),
    "model.moe.options.compression_ratio": Applies(
        strategies=("hybrid",),
        what="the compression of the experts hybrid gathers; no other strategy gathers experts",
    ),
}


def check_applicable(
    given: Mapping[str, str],
    *,
    strategy: str,
    schedule: str,
    note: Callable[[str], None],
) -> None:
    """Refuse the flags, and note the TOML keys, that have no effect on this run.

    Args:
        given: the options the user set -> where: a flag (``"--ar-chunk"``, starts with
            ``--``) or the TOML file that holds the key. Keys without an entry in
            :data:`RULES` (TOML-only fields) are not judged.
        strategy: the run's strategy (``model.moe.dispatcher``).
        schedule: the run's schedule.
        note: receives one line per TOML key without effect.

    Raises:
        ValueError: flags that do not apply to ``strategy`` or ``schedule`` (one message
            naming each).
    """
    refused = []
    for key, source in given.items():
        rule = rule_of(key)
        misfit = None if rule is None else rule.misfit(strategy, schedule)
        if rule is None or misfit is None:
            continue
        choice, chosen, names = misfit
        only = f"{choice} {' or '.join(names)}"
        if source.startswith("--"):
            refused.append(
                f"{source} does not apply to {choice} {chosen}: only to {only} ({rule.what}); "
                f"drop {source} or choose {only}"
            )
        else:
            note(
                f"{key} in {source} has no effect with {choice} {chosen}: it applies only to "
                f"{only} ({rule.what})"
            )
    if refused:  # all of them at once, so that one fix is enough
        raise ValueError("; ".join(refused))


def rule_of(key: str) -> Applies | None:
    """The rule of option ``key``: its entry in :data:`RULES`, or for a strategy option without
    one, the strategies whose options have it; None when neither (a name no registered strategy
    has is left to ``MoEConfig``, which refuses it naming the strategy's options)."""
    rule = RULES.get(key)
    if rule is not None or not key.startswith(OPTIONS):
        return rule
    owners = _owners(key.removeprefix(OPTIONS))
    if not owners:
        return None
    return Applies(strategies=owners, what=f"an option of {' and '.join(owners)} only")


def _owners(option: str) -> tuple[str, ...]:
    """The registered strategies whose options have a field ``option``."""
    return tuple(s for s in strategy_names() if option in options_class(s).names())


def drop_other_options(options: Mapping[str, Any], strategy: str) -> dict[str, Any]:
    """``options`` without those of other strategies than ``strategy`` (noted as without
    effect by :func:`check_applicable`); names no strategy has stay, for ``MoEConfig`` to
    refuse."""
    own = options_class(strategy).names()
    return {k: v for k, v in options.items() if k in own or not _owners(k)}
