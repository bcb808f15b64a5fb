"""Simulated against measured in one command (``moesaic simulate --measured F.json``): the
committed FlowMoE run reproduces the validation table's predictions and errors; the other
layouts, hybrid+flowmoe points and bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moesaic.cli import main
from moesaic.cluster.spec import ClusterSpec
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import Profile
from moesaic.sim.runs import Run
from moesaic.sim.simulate import SimOptions, simulate
from moesaic.simtools.compare import compare, geomean_abs_error, load_measured

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks/results"
CLUSTER = str(ROOT / "examples/clusters/flowmoe_2rank.toml")
MODEL = str(ROOT / "examples/models/flowmoe_small.toml")


def _measured(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["simulate", "--cluster", CLUSTER, "--model", MODEL, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_flowmoe_run_reproduces_the_validation_table(capsys, tmp_path):
    """``flowmoe_cluster.json`` (10 schedules, their R and Sp) with the profile the validation
    used: the committed simulated times and errors, and the table's geometric mean."""
    table = json.loads((RESULTS / "sim_validation.json").read_text())
    want = [r for r in table["rows"] if r["source"] == "flowmoe_cluster.json"]
    profile = tmp_path / "p.json"
    Profile.from_dict(want[0]["profile"]).save(profile)
    measured = str(RESULTS / "flowmoe_cluster.json")
    rc, out, _ = _measured(capsys, "--profile", str(profile), "--measured", measured, "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["point"] for r in rows] == [w["point"] for w in want]
    for got, w in zip(rows, want):
        assert got["strategy"] == "dropless"
        assert got["simulated_ms"] == pytest.approx(w["simulated_ms"], rel=1e-9), w["point"]
        assert got["measured_ms"] == pytest.approx(w["measured_ms"], rel=1e-12)
        assert got["error"] == pytest.approx(w["error"], rel=1e-6, abs=1e-9)
    rc, out, _ = _measured(capsys, "--profile", str(profile), "--measured", measured)
    lines = out.splitlines()
    assert lines[0].split() == ["point", "run", "R", "measured_ms", "simulated_ms", "error"]
    assert "flowmoe R=4 Sp=G/16" in out and "dropless+flowmoe" in out
    mean = geomean_abs_error(rows)
    assert lines[-1] == f"geometric-mean |error| over 10 points: {100 * mean:.1f}%"


def test_points_carry_their_run_and_knobs(tmp_path):
    """A list of points: each simulated with its own strategy, schedule, R, Sp and domains
    (hybrid+flowmoe included); a measured time equal to the simulation is error 0."""
    spec = ClusterSpec.from_toml(CLUSTER)
    model = ModelSpec.from_toml(MODEL)
    profile = Profile(flops_per_s=1e11)
    hybrid = simulate(
        spec, model, "hybrid", profile, SimOptions(degree=4, domain_sizes=(2,)), schedule="flowmoe"
    )
    points = [
        {
            "label": "h",
            "strategy": "hybrid",
            "schedule": "flowmoe",
            "pipeline_degree": 4,
            "domain_sizes": [2],
            "iteration_ms": hybrid.iteration_s * 1e3,
        },
        {"dispatcher": "padded", "schedule": "moe-only", "step_time_s": {"median": 0.5}},
        {"strategy": "ep", "step_time_s": 0.3},  # an old mixed name: classic EP
        {"schedule": "flowmoe", "degree": 2, "sp_bytes": 1e5, "iteration_ms": 400.0},
    ]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(points))
    got = load_measured(path, spec)
    assert [p.run for p in got] == [
        Run("hybrid", "flowmoe"),
        Run("padded", "moe-only"),
        Run("hybrid", "vanilla"),
        Run("dropless", "flowmoe"),
    ]
    assert [p.label for p in got] == ["h", "#1", "#2", "#3"]
    assert got[2].domain_sizes == (1,) and got[1].measured_ms == 500.0
    rows = compare(spec, model, profile, got, SimOptions(degree=2))
    assert rows[0]["error"] == pytest.approx(0.0, abs=1e-12)
    assert (rows[0]["degree"], rows[0]["domain_sizes"]) == (4, [2])
    assert rows[1]["degree"] == 2  # not recorded: --degree's
    assert rows[3]["sp_bytes"] == 1e5
    one = tmp_path / "one.json"
    one.write_text(json.dumps(points[0]))
    assert load_measured(one, spec)[0].run == Run("hybrid", "flowmoe")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('[{"schedule": "flowmoe"}]', "point '#0' has no time"),
        (
            '[{"strategy": "taskflow", "schedule": "flowmoe", "iteration_ms": 1}]',
            "taskflow runs no pipelined schedule",
        ),
        ('{"results": {"x": {"step_time_s": -1}}}', "point 'x': step_time_s (-1) must be"),
        ("[]", "holds no measured point"),
        ("{", "is not valid JSON"),
    ],
)
def test_bad_measured_files_name_the_point(capsys, tmp_path, content, message):
    path = tmp_path / "m.json"
    path.write_text(content)
    rc, out, err = _measured(capsys, "--measured", str(path))
    assert rc == 2 and out == ""
    assert f"--measured {path}" in err and message in err


def test_measured_takes_runs_from_the_file(capsys, tmp_path):
    path = str(RESULTS / "flowmoe_cluster.json")
    rc, _, err = _measured(capsys, "--measured", path, "--strategy", "hybrid", "--csv", "x.csv")
    assert rc == 2 and "leave out --strategy, --csv" in err
