"""``train --plan FILE.json`` against the job the plan was made for (issue 57 item 4): a plan
for a 4-rank, hidden-256 job applied to a 2-rank, hidden-32 run trained without a word. Now a
plan records its job (``made_for``), a run for another world, cluster or model is refused
unless ``--force-plan``, the run says which combination it applies, and an error a planned
value causes names the plan."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

import pytest
from _train_helpers import fails

from moesaic.cli import main
from moesaic.train.flags import add_train_arguments, config_from_args
from moesaic.train.launch import validate_config
from moesaic.train.plan import check_plan_fits, run_shape

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "examples" / "clusters" / "2dc_2node_small.toml"  # 2 x 2 ranks
TINY = ROOT / "examples" / "train_tiny.toml"
RUN = ["--config", str(TINY), "--cluster", str(SMALL), "--nproc", "4", "--ep", "4"]


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = io.StringIO()
    argv = ["plan", "--cluster", str(SMALL), "--model", str(TINY), "--flops-per-s", "2e10"]
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(out.getvalue())
    return path, json.loads(out.getvalue())


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)), note=lambda line: None)


def test_a_plan_records_the_job_it_was_made_for(plan):
    path, entries = plan
    cfg = _config(*RUN, "--plan", str(path))
    for entry in entries:
        made = entry["made_for"]
        assert made["world_size"] == 4 and made["cluster"] == "2dc_2node_small"
        assert made["model"] == run_shape(cfg)
        assert made["profile"].endswith("(2e+10 FLOP/s)"), made


def test_a_plan_for_another_job_is_refused(plan, tmp_path, capsys):
    # An entry whose options fit any world (else the options' own checks speak first, naming
    # the plan: see test_an_error_the_plan_causes_names_the_plan).
    entry = {**plan[1][0], "strategy": "dropless", "schedule": "vanilla", "options": {}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps([entry]))
    err = fails(
        ["train", *RUN[:2], "--nproc", "2", "--ep", "2", "--seq-len", "32", "--plan", str(path)],
        capsys,
    )
    assert err == (
        f"moesaic train: error: --plan {path} was made for another job: world_size 4 (this "
        "run: 2); model seq_len 64 (this run: 32); plan this job (moesaic plan --json) or "
        "pass --force-plan"
    )


def test_force_plan_applies_it_with_a_note_and_says_what(plan, tmp_path):
    first = {**plan[1][0], "strategy": "dropless", "schedule": "vanilla", "options": {}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps([first]))
    cfg = _config(*RUN[:2], "--nproc", "2", "--ep", "2", "--plan", str(path), "--force-plan")
    notes: list[str] = []
    notes.append(check_plan_fits(cfg, 2, "2dc_2node_small", notes.append))
    options = ", ".join(f"{k} {v}" for k, v in first["options"].items())
    with_options = f" with {options}" if options else ""
    assert notes == [
        f"--plan {path} was made for another job: world_size 4 (this run: 2); applied anyway "
        "(--force-plan)",
        f"--plan {path}: training {first['strategy']} / {first['schedule']}{with_options} "
        f"(ranked 1); made for 4 ranks on cluster '2dc_2node_small', profile "
        f"{first['made_for']['profile']}",
    ]


def test_a_matching_run_says_which_combination_it_applies(plan, capsys):
    path, entries = plan
    cfg = _config(*RUN, "--plan", str(path))
    validate_config(cfg, 4)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "--plan" in ln]
    assert len(lines) == 1 and lines[0].startswith(
        f"moesaic train: --plan {path}: training {entries[0]['strategy']} / "
        f"{entries[0]['schedule']}"
    ), err
    # Another cluster than the plan's is a mismatch too.
    with pytest.raises(ValueError, match=r"cluster '2dc_2node_small' \(this run: 'other'\)"):
        check_plan_fits(cfg, 4, "other", lambda line: None)


def test_an_error_the_plan_causes_names_the_plan(tmp_path, capsys):
    entry = {"strategy": "dropless", "schedule": "flowmoe", "options": {"pipeline_degree": 4}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps([entry]))
    err = fails(["train", *RUN[:2], "--batch-size", "2", "--plan", str(path)], capsys)
    assert err.startswith(
        f"moesaic train: error: --plan {path} sets pipeline_degree 4: pipeline_degree (4) "
        "must divide batch_size (2)"
    ), err


def test_force_plan_needs_a_plan_file(capsys):
    err = fails(["train", *RUN[:2], "--force-plan"], capsys)
    assert err == (
        "moesaic train: error: force_plan (--force-plan) applies to a plan file (--plan FILE.json)"
    )


def test_a_plan_option_that_does_not_fit_names_the_plan(tmp_path, capsys):
    entry = {"strategy": "hybrid", "schedule": "vanilla", "options": {"domain_sizes": [2, 2]}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps([entry]))
    err = fails(["train", *RUN[:2], "--nproc", "2", "--ep", "2", "--plan", str(path)], capsys)
    assert err.startswith(
        f"moesaic train: error: --plan {path} sets domain_sizes [2, 2]: "
        "model.moe.options.domain_sizes ([2, 2]) must have one entry per level"
    ), err
