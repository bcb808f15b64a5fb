"""FlowMoE's Sp tuner without its optional package says what to install (the first GPU run,
issue 27, failed on a machine without it with a bare "No module named 'bayes_opt'")."""

from __future__ import annotations

import sys

import pytest

from moesaic.schedule.tuner import SpTuner


def test_a_missing_bayes_opt_names_the_extra_and_the_way_around(monkeypatch):
    monkeypatch.setitem(sys.modules, "bayes_opt", None)  # import of it now fails
    with pytest.raises(ModuleNotFoundError, match=r"moesaic\[flowmoe\].*--ar-chunk"):
        SpTuner(low=1024, high=8192)
