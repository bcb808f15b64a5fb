"""``moesaic train --plan FILE.json|auto`` (issue 24, item 4): ``moesaic plan --json``'s entries
become the training options the flags set; a flag that disagrees is refused, a TOML key is
overridden with a note; ``auto`` plans on rank 0, every rank trains the same pick, recorded in
the run's summary and ``plan.json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from _train_helpers import fails, read_metrics, tiny_args

from moesaic.cli import main
from moesaic.train.flags import add_train_arguments, config_from_args
from moesaic.train.plan_auto import PLAN_FILE

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "examples" / "clusters" / "2dc_2node_small.toml"  # 2 x 2 ranks
TINY = ROOT / "examples" / "train_tiny.toml"  # batch 8: R 2, 4, 8 all divide it
RUN = ["--config", str(TINY), "--cluster", str(SMALL), "--nproc", "4", "--ep", "4"]


@pytest.fixture(scope="module")
def ranking(tmp_path_factory) -> tuple[Path, list[dict]]:
    """``moesaic plan --json`` of the tiny example on 2 x 2 ranks (every strategy runs)."""
    import contextlib
    import io

    out = io.StringIO()
    argv = ["plan", "--cluster", str(SMALL), "--model", str(TINY), "--flops-per-s", "2e10"]
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json", "--compression-ratio", "1,4"]) == 0
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(out.getvalue())
    return path, json.loads(out.getvalue())


def _config(*argv: str, notes: list[str] | None = None):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    sink = notes if notes is not None else []
    return config_from_args(parser.parse_args(list(argv)), note=sink.append)


def _trained(cfg) -> dict:
    """What a config trains, in a plan entry's terms."""
    moe = cfg.model.moe
    options = {"pipeline_degree": cfg.pipeline_degree}
    if cfg.ar_chunk != "auto":
        options["ar_chunk"] = cfg.ar_chunk
    opts = moe.options.to_dict()
    if moe.dispatcher == "hybrid":
        options["domain_sizes"] = list(opts["domain_sizes"])
        options["compression_ratio"] = opts["compression_ratio"]
    if moe.dispatcher == "taskflow":
        options["pipeline"] = opts["pipeline"]
    return {"strategy": moe.dispatcher, "schedule": cfg.schedule, "options": options}


def test_every_pair_round_trips(ranking, tmp_path):
    """The file's first entry, and the best entry of every pair (one object per file), set
    exactly what the entry says; training accepts each (supports, the cluster's levels)."""
    path, rows = ranking
    cfg = _config(*RUN, "--plan", str(path))
    first = rows[0]
    assert _trained(cfg) == {k: first[k] for k in ("strategy", "schedule", "options")}
    assert cfg.plan == str(path)
    best = {}
    for row in rows:
        best.setdefault((row["strategy"], row["schedule"]), row)
    assert len(best) == 10  # 3 strategies x 3 schedules + taskflow's vanilla
    for i, row in enumerate(best.values()):
        one = tmp_path / f"entry{i}.json"
        one.write_text(json.dumps(row))
        cfg = _config(*RUN, "--plan", str(one))
        assert _trained(cfg) == {k: row[k] for k in ("strategy", "schedule", "options")}
        assert cfg.check_world(4) == 4


def test_agreeing_flags_pass_disagreeing_are_refused(ranking, tmp_path):
    _, rows = ranking
    flow = next(r for r in rows if r["schedule"] == "flowmoe" and r["strategy"] == "dropless")
    one = tmp_path / "flow.json"
    one.write_text(json.dumps(flow))
    sp = flow["options"]["ar_chunk"]
    R = flow["options"]["pipeline_degree"]
    # the same values, spelled as flags spell them
    cfg = _config(*RUN, "--plan", str(one), "--schedule", "flowmoe", "--ar-chunk", f"{sp}B")
    assert cfg.ar_chunk == sp and cfg.pipeline_degree == R
    with pytest.raises(ValueError) as exc:
        _config(*RUN, "--plan", str(one), "--schedule", "vanilla", "--strategy", "padded")
    msg = str(exc.value)
    assert "--schedule vanilla (the plan: flowmoe)" in msg
    assert "--strategy padded (the plan: dropless)" in msg
    hybrid = next(r for r in rows if r["strategy"] == "hybrid")
    one.write_text(json.dumps(hybrid))
    other = "1,1" if hybrid["options"]["domain_sizes"] != [1, 1] else "2,2"
    with pytest.raises(ValueError, match=r"--domains 1,1|--domains 2,2"):
        _config(*RUN, "--plan", str(one), "--domains", other)


def test_a_toml_key_is_overridden_with_a_note(ranking, tmp_path):
    path, rows = ranking
    entry = rows[0]
    other = "moe-only" if entry["schedule"] != "moe-only" else "flowmoe"
    toml = tmp_path / "run.toml"
    toml.write_text(f'schedule = "{other}"\n' + TINY.read_text())
    notes: list[str] = []
    cluster = ["--cluster", str(SMALL), "--nproc", "4", "--ep", "4"]
    cfg = _config("--config", str(toml), *cluster, "--plan", str(path), notes=notes)
    assert cfg.schedule == entry["schedule"]
    assert f"schedule = {other!r} in {toml} is overridden by --plan {path}" in " ".join(notes)


@pytest.mark.parametrize(
    "content, words",
    [
        (None, ["--plan", "no such file"]),
        ("{", ["--plan", "not a JSON plan"]),
        ("[]", ["lists no combination"]),
        ('{"strategy": "dropless", "schedule": "vanilla"}', ["no options"]),
        ('{"strategy": "nope", "schedule": "vanilla", "options": {}}', ["'nope'", "registered"]),
        ('{"strategy": "dropless", "schedule": "x", "options": {}}', ["schedule 'x'"]),
        ('{"strategy": "dropless", "schedule": "vanilla", "options": {"R": 2}}', ["'R'"]),
        (
            '{"strategy": "dropless", "schedule": "vanilla", "options": {"domain_sizes": [2]}}',
            ["option 'domain_sizes' is neither a run option", "strategy 'dropless' (it has none)"],
        ),
    ],
    ids=["missing", "not-json", "empty", "no-options", "strategy", "schedule", "option", "owner"],
)
def test_bad_plan_files_are_one_line_errors(content, words, tmp_path, capsys):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    err = fails(["train", *RUN, "--plan", str(path)], capsys)
    for word in words:
        assert word in err, err


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--schedule", "flowmoe"], ["--schedule (--plan auto chooses it)"]),
        (["--domains", "auto"], ["--domains (--plan auto chooses it)"]),
        (["--activation-checkpointing"], ["--activation-checkpointing", "may pick"]),
    ],
    ids=["chosen", "domains", "limited"],
)
def test_auto_refuses_what_it_would_contradict(extra, words, capsys):
    err = fails(["train", *RUN, "--plan", "auto", *extra], capsys)
    for word in words:
        assert word in err, err


def test_auto_needs_a_cluster(capsys):
    err = fails(["train", "--config", str(TINY), "--plan", "auto"], capsys)
    assert "--plan auto" in err and "--cluster" in err


def test_auto_trains_rank_0s_pick_on_every_rank(data_file, tmp_path, capfd):
    """A 2-rank run plans on rank 0, every rank applies the same pick (compared by a
    collective after it), and the summary and plan.json record it."""
    cluster = tmp_path / "two.toml"
    cluster.write_text(
        'name = "two"\nworld_size = 2\n\n[[levels]]\nname = "link"\nsize = 2\n'
        "bandwidth_gbps = 0.1\nlatency_ms = 1.0\n"
    )
    run_dir = tmp_path / "run"
    args = tiny_args(data_file, run_dir, "--plan", "auto", "--cluster", str(cluster))
    args[args.index("--steps") + 1] = "2"
    assert main(args) == 0
    # the planner priced the job's own routing (its router on its data, train.routing_run)
    assert "--plan auto: routing from the profile (model.toml's router on its data" in (
        capfd.readouterr().err
    )
    recorded = json.loads((run_dir / PLAN_FILE).read_text())
    assert recorded["source"] == "auto" and recorded["cluster"] == str(cluster)
    first = recorded["ranking"][0]
    summary = read_metrics(run_dir)[-1]
    assert summary["kind"] == "summary"
    plan = summary["plan"]
    assert plan["source"] == "auto"
    assert plan == {"source": "auto", **summary["combination"]}
    assert (plan["strategy"], plan["schedule"]) == (first["strategy"], first["schedule"])
    assert plan["pipeline_degree"] == first["options"]["pipeline_degree"]
    if "domain_sizes" in first["options"]:
        assert plan["options"]["domain_sizes"] == first["options"]["domain_sizes"]


def test_auto_keeps_the_configs_options_the_plan_leaves_unset(ranking):
    """``--plan auto``'s pick sets the options it chose; the others stay the config's when the
    pick keeps the config's strategy, and are the new strategy's defaults otherwise."""
    import dataclasses

    from moesaic.train.plan_auto import apply_entry

    _, entries = ranking
    pick = next(e for e in entries if e["strategy"] == "taskflow")
    cfg = _config(*RUN, "--strategy", "hybrid")
    moe = dataclasses.replace(
        cfg.model.moe, dispatcher="taskflow", options={"tile_m": 64, "transport": "auto"}
    )
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe))
    opts = apply_entry(cfg, pick).model.moe.options.to_dict()
    assert (opts["tile_m"], opts["transport"]) == (64, "auto")
    assert opts["pipeline"] == pick["options"]["pipeline"]
    other = next(e for e in entries if e["strategy"] == "hybrid")
    hybrid = apply_entry(cfg, other).model.moe.options.to_dict()
    assert list(hybrid["domain_sizes"]) == other["options"]["domain_sizes"]


def test_run_group_kills_what_the_command_started():
    """``plan_auto.run_group`` past its timeout kills the whole process group: a routing
    measurement's launcher and worker do not outlive the plan that started them."""
    import os
    import subprocess
    import time

    from moesaic.train.plan_auto import run_group

    marker = f"sleep 3{os.getpid() % 1000}.25"  # a duration no other process sleeps
    cmd = ["sh", "-c", f"{marker} & {marker}"]
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_group(cmd, env=dict(os.environ), timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    time.sleep(0.2)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
    # (the check can fail: without the group kill the background sleep outlives its shell)
    done = run_group(["sh", "-c", "echo out; echo err >&2"], env=dict(os.environ), timeout_s=10)
    assert (done.returncode, done.stdout, done.stderr) == (0, "out\n", "err\n")


def _fixed_machine(monkeypatch) -> None:
    """``measure.machine.measure`` as a profile of ``--flops-per-s 2e10`` alone would be."""
    import dataclasses

    from moesaic.sim.profile import Profile

    defaults = {f.name: f.default for f in dataclasses.fields(Profile)}
    rates = {
        "flops_per_s": 2e10,
        **{k: defaults[k] for k in ("half_flops_per_s", "task_overhead_s", "mem_bytes_per_s")},
        "device": defaults["device"],
    }
    monkeypatch.setattr("moesaic.measure.machine.measure", lambda: dict(rates))


def test_auto_ranks_in_process_as_moesaic_plan_does(monkeypatch, tmp_path, capsys):
    """Rank 0's ranking is ``moesaic plan --json``'s for the same model and profile, computed
    by a call (no ``moesaic plan`` process); the routing measurement gets a quarter of the
    run's timeout and, when it runs out, the plan prices the routing prior, with a note."""
    import contextlib
    import dataclasses
    import io
    import subprocess

    from moesaic.train import plan_auto
    from moesaic.train.model_files import load_model

    calls = []

    def fake(cmd, *, env, timeout_s):
        calls.append((cmd, timeout_s))
        raise subprocess.TimeoutExpired(cmd, timeout_s)

    monkeypatch.setattr(plan_auto, "run_group", fake)
    _fixed_machine(monkeypatch)
    cfg = dataclasses.replace(load_model(TINY), cluster=str(SMALL), timeout_s=100.0)
    rows = plan_auto._plan_here(cfg, "ring")
    assert [(c[0][1:3], c[1]) for c in calls] == [(["-m", "moesaic.train.routing_run"], 25.0)]
    assert "planning with the routing prior" in capsys.readouterr().err
    model = tmp_path / "model.toml"
    model.write_text(plan_auto.model_toml(cfg))
    out = io.StringIO()
    argv = ["plan", "--cluster", str(SMALL), "--model", str(model), "--flops-per-s", "2e10"]
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json", "--all-reduce", "ring"]) == 0
    cli = json.loads(out.getvalue())
    for row in (*rows, *cli):  # who measured the profile: the only difference
        row["made_for"] = {k: v for k, v in row["made_for"].items() if k != "profile"}
    assert rows == cli


def test_a_plans_capacity_factor_sets_the_models(tmp_path, capsys):
    """An entry of ``moesaic plan --capacity-factor`` sets ``model.moe.capacity_factor``; a bad
    one is a one-line error naming the option."""
    entry = {"strategy": "padded", "schedule": "vanilla", "options": {"capacity_factor": 1.25}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps([entry]))
    cfg = _config(*RUN, "--plan", str(path))
    assert cfg.model.moe.capacity_factor == 1.25 and cfg.model.moe.dispatcher == "padded"
    entry["options"]["capacity_factor"] = 0
    path.write_text(json.dumps(entry))
    err = fails(["train", *RUN, "--plan", str(path)], capsys)
    assert "option capacity_factor (0) must be a finite number > 0" in err


def test_a_plans_ep_sets_the_runs(tmp_path, capsys):
    """An entry of ``moesaic plan --ep`` sets the run's ``ep`` (EP groups below the world, the
    rest replicas); a flag giving another EP is refused naming both."""
    entry = {"strategy": "dropless", "schedule": "vanilla", "options": {"ep": 2}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps([entry]))
    run = ["--config", str(TINY), "--nproc", "4"]
    assert _config(*run, "--plan", str(path)).ep == 2
    err = fails(["train", *run, "--ep", "4", "--plan", str(path)], capsys)
    assert "--ep 4 (the plan: 2)" in err
