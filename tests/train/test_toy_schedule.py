"""A new schedule is its own modules plus one registry entry; nothing else changes (issue 52).

A toy schedule lives in two temporary modules outside the package: its ``ScheduleSpec`` in one
that does not import torch (``TOY_SPEC_SOURCE``: no pricing key, so the simulator has no model
of it) and its step in another (``TOY_STEP_SOURCE``: vanilla's forward and backward, then one
all-reduce per parameter, last first, instead of vanilla's two flat ones). It is registered the
way user code does it, by ``MOESAIC_SCHEDULES`` (so that ``moesaic train``'s workers and spawned
worlds see it too). With no other edit: the config validates it and applies the options rules
by its traits, the step test's comparison with the pre-schedule loop runs it, ``moesaic train``
trains it (its metrics carry the step's throughput), and ``moesaic simulate`` / ``moesaic plan``
refuse or skip it saying why. The environment is restored after each test.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from _train_helpers import fails, read_metrics, tiny_args
from test_step import _schedule_vs_old_world

from moesaic.cli import main
from moesaic.comm.world import run_world
from moesaic.schedule import step_class
from moesaic.schedule_table import ENV_VAR, schedule_names, schedule_spec
from moesaic.sim.runs import check_schedule, priced_schedules
from moesaic.train.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "examples", "clusters", "flowmoe_2rank.toml")
MODEL = os.path.join(ROOT, "examples", "models", "flowmoe_small.toml")

SPEC_MODULE, STEP_MODULE = "moesaic_toy_schedule_spec", "moesaic_toy_schedule"
TOY_SPEC_SOURCE = f'''
"""toy's traits (torch-free)."""

from moesaic.schedule_table import ScheduleSpec

TOY = ScheduleSpec(step="{STEP_MODULE}:ToyStep", summary="vanilla, one all-reduce per parameter")
'''
TOY_STEP_SOURCE = '''
"""toy: vanilla's step with one all-reduce per parameter, the last parameter first."""

from moesaic.layer import aux_loss
from moesaic.schedule.base import TrainStep


class ToyStep(TrainStep):
    name = "toy"

    def run(self, x_BT, y_BT):
        model = self.parts.model
        ce = self.parts.loss_fn(model(x_BT), y_BT)
        aux = aux_loss(model).to(ce.device)
        (ce + aux).backward()
        for p in reversed(self.params):
            self.parts.grad_sync.sync([p])
        return self.finish(ce, aux)
'''
UNPRICED = (
    "schedule 'toy' is registered (moesaic.schedule_table) but declares no pricing: the "
    "simulator prices the schedules declared with pricing 'block-pipeline'"
)


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """Registers ``toy`` from modules in ``tmp_path``, for this process and its children."""
    (tmp_path / f"{SPEC_MODULE}.py").write_text(TOY_SPEC_SOURCE)
    (tmp_path / f"{STEP_MODULE}.py").write_text(TOY_STEP_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    monkeypatch.setenv(ENV_VAR, f"toy={SPEC_MODULE}:TOY")
    yield "toy"
    for module in (SPEC_MODULE, STEP_MODULE):
        sys.modules.pop(module, None)


def test_the_environment_registers_it_and_its_traits_rule(toy):
    assert schedule_names()[-1] == toy and "toy" not in priced_schedules()
    assert step_class(toy).__module__ == STEP_MODULE
    assert not schedule_spec(toy).pipelined
    cfg = TrainConfig(schedule=toy, batch_size=4)
    assert cfg.pipeline_degree == 1  # "auto" under a schedule that is not pipelined
    with pytest.raises(ValueError, match=r"needs a pipelined schedule \(moe-only, flowmoe\)"):
        TrainConfig(schedule=toy, pipeline_degree=2, batch_size=4)


def test_bad_environment_entries_are_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "toy=no_colon")
    with pytest.raises(ValueError, match=f"{ENV_VAR}: entry 'toy=no_colon' must be name=module"):
        schedule_names()
    monkeypatch.setenv(ENV_VAR, "vanilla=some.module:SPEC")
    with pytest.raises(ValueError, match=f"{ENV_VAR}: schedule 'vanilla' is already registered"):
        schedule_names()
    monkeypatch.setenv(ENV_VAR, "toy=no_such_module:SPEC")
    with pytest.raises(ValueError, match=r"'toy' .* module 'no_such_module' is not found"):
        schedule_spec("toy")


def test_without_the_environment_there_is_no_toy():
    assert "toy" not in schedule_names()


def test_the_options_rules_read_its_traits(toy, capsys, tmp_path):
    err = fails(
        ["train", "--run-dir", str(tmp_path / "r"), "--schedule", toy, "--ar-chunk", "4MiB"], capsys
    )
    assert (
        "--ar-chunk does not apply to --schedule toy: only to --schedule moe-only or flowmoe" in err
    )


def _toy_vs_old_world(rank: int, world: int) -> list:
    return _schedule_vs_old_world(rank, world, "toy", 2)


def test_the_step_test_runs_it_against_the_old_loop(toy):
    """As ``test_step.test_every_schedule_trains_like_the_old_loop`` does for every schedule:
    DP 1 x EP 2, clipping on, 3 steps; the per-parameter all-reduces sum the same two numbers
    as the flat ones, so the weights are equal bitwise."""
    for (old_trace, old_w), (trace, w) in run_world(_toy_vs_old_world, 2, timeout_s=120):
        assert [ce for ce, _ in trace] == [ce for ce, _ in old_trace]
        assert all(torch.equal(w[k], old_w[k]) for k in w)


def test_train_runs_it(toy, data_file, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(data_file, run_dir, "--schedule", toy, "--steps", "4", "--eval-every", "0")
    assert main([*args, "--ckpt-every", "0"]) == 0
    train = [m for m in read_metrics(run_dir) if m["kind"] == "train"]
    losses = [m["loss"] for m in train]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert all(m["tokens_per_s"] > 0 for m in train)  # the step's throughput, as any run's


def test_the_simulator_refuses_it_with_the_reason(toy, capsys):
    with pytest.raises(ValueError) as info:
        check_schedule(toy)
    assert str(info.value) == UNPRICED
    sim = ["simulate", "--cluster", CLUSTER, "--model", MODEL]
    assert main([*sim, "--strategy", "dropless", "--schedule", toy]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == f"moesaic simulate: error: --strategy dropless --schedule {toy}: {UNPRICED}"
    # --schedule all: the others simulated, toy's pairs named as skipped with the reason
    assert main([*sim, "--strategy", "dropless", "--schedule", "all", "--json"]) == 0
    out = capsys.readouterr()
    assert [r["schedule"] for r in json.loads(out.out)] == list(priced_schedules())
    assert f"skipping dropless+{toy} ({UNPRICED})" in out.err
