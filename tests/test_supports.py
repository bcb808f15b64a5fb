"""What strategies run under is declared once (``MoEStrategy.supports``) and refused once, before
any worker starts, naming the strategy, the schedule or option, and the strategy's reason."""

from __future__ import annotations

import re

import pytest

from moesaic.schedule import schedule_names
from moesaic.strategies import get_strategy, strategy_names
from moesaic.strategies.base import DispatchCombineStrategy, Supports
from moesaic.strategies.registry import check_supported
from moesaic.train.config import TrainConfig


def test_refusals_name_strategy_schedule_and_why():
    s = Supports(pipelined=False, capacity=False, why="fused tiles")
    s.check("toy", schedule="vanilla")
    with pytest.raises(ValueError, match=r"^strategy 'toy' does not run under schedule 'flowmoe' "):
        s.check("toy", schedule="flowmoe")
    with pytest.raises(ValueError, match=r"runs under vanilla\): fused tiles$"):
        s.check("toy", schedule="moe-only")
    with pytest.raises(ValueError, match=r"'toy' does not support capacity_factor .*fused tiles"):
        s.check("toy", capacity=True)
    Supports().check("any", schedule="flowmoe", capacity=True)  # the default: everything


@pytest.mark.parametrize("strategy", strategy_names())
def test_phase_strategies_run_every_schedule_and_the_rest_say_why(strategy):
    cls = get_strategy(strategy)
    for schedule in schedule_names():
        runs = cls.supports.runs_under(schedule)
        if issubclass(cls, DispatchCombineStrategy):
            assert runs, (strategy, schedule)  # the phases run under every schedule
        if runs:
            check_supported(strategy, schedule=schedule)
        else:
            assert cls.supports.why
            with pytest.raises(ValueError, match=re.escape(cls.supports.why)):
                check_supported(strategy, schedule=schedule)


def test_train_config_checks_before_spawning():
    """``TrainConfig.check_world`` (the launcher's check before spawning) asks ``supports``."""
    ok = {"schedule": "flowmoe", "model": {"moe": {"dispatcher": "hybrid"}}}
    assert TrainConfig.from_dict(ok).check_world(2) == 2
    bad = {"schedule": "moe-only", "model": {"moe": {"dispatcher": "taskflow"}}}
    with pytest.raises(ValueError, match=r"strategy 'taskflow' does not run under schedule"):
        TrainConfig.from_dict(bad).check_world(2)
