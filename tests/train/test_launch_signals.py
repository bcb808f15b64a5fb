"""A signal that reaches the launcher is reported as the signal, wherever it lands in the agent.

A CI run of ``test_ctrl_c_on_taskflow_stops_within_seconds`` once exited 1 instead of 130: the
Ctrl-C's exception was raised on the first line of torch's metrics wrapper (``start = ...``),
whose ``finally`` then raised ``UnboundLocalError`` with the signal only as its context.
"""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
from torch.distributed.elastic import metrics
from torch.distributed.elastic.metrics import api as metrics_api
from torch.distributed.elastic.multiprocessing.api import SignalException

from moesaic.train.config import TrainConfig
from moesaic.train.launch import _run_agent, _signal_behind


def _agent_hit_while_timing(sigval: signal.Signals):
    """A stand-in for ``elastic_launch`` whose run is a metrics-wrapped function, with the
    signal arriving as the wrapper reads its start time (the line inside its ``try``)."""

    @metrics.prof
    def run_agent(*args):
        raise AssertionError("the signal should have landed first")

    def launch(config, entrypoint):
        return run_agent

    def time_now():
        raise SignalException("a signal", sigval=sigval)

    return launch, SimpleNamespace(time=time_now)


@pytest.mark.parametrize("sigval", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_in_torchs_metrics_wrapper_is_an_interrupt(monkeypatch, sigval):
    launch, clock = _agent_hit_while_timing(sigval)
    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", launch)
    monkeypatch.setattr(metrics_api, "time", clock)
    with pytest.raises(KeyboardInterrupt):
        _run_agent(TrainConfig(nproc=2), "moesaic-test")


def test_another_signal_in_torchs_metrics_wrapper_names_it(monkeypatch):
    launch, clock = _agent_hit_while_timing(signal.SIGHUP)
    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", launch)
    monkeypatch.setattr(metrics_api, "time", clock)
    with pytest.raises(RuntimeError, match="stopped by signal SIGHUP"):
        _run_agent(TrainConfig(nproc=2), "moesaic-test")


def test_an_error_with_no_signal_behind_it_is_raised_as_it_is(monkeypatch):
    def launch(config, entrypoint):
        def run(*args):
            try:
                raise KeyError("first")
            except KeyError:
                raise ValueError("a real error") from None

        return run

    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", launch)
    with pytest.raises(ValueError, match="a real error"):
        _run_agent(TrainConfig(nproc=2), "moesaic-test")


def test_signal_behind_follows_cause_and_context_and_stops_on_a_cycle():
    sig = SignalException("x", sigval=signal.SIGTERM)
    outer = RuntimeError("outer")
    outer.__context__ = UnboundLocalError("start")
    outer.__context__.__cause__ = sig
    assert _signal_behind(outer, SignalException) is sig
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert _signal_behind(a, SignalException) is None
