"""``moesaic train --schedule/--pipeline-degree/--ar-chunk/--trace/--trace-png``: bad settings
are one-line errors naming the option, TOML keys, the traces a run writes, and checkpoints
that resume under another schedule."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _train_helpers import (
    fails,
    final_weights,
    read_metrics,
    start_from,
    tiny_args,
    train_losses,
)

from moesaic.cli import main
from moesaic.train.config import TRACE_STEPS
from moesaic.train.flags import add_train_arguments, config_from_args

# A pipelined schedule against vanilla (docs/training.md, "Schedules"): the same mathematics,
# summed in another order (per-chunk losses and aux terms, gradients accumulated over R chunks,
# all-reduced in chunks), so fp32 rounding differences (~1e-7 relative per step) that AdamW's
# normalisation can amplify where a gradient is near zero. Losses: 1e-5 relative.
LOSS_RTOL = 1e-5
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pipeline-degree", "0"], "pipeline_degree (0) must be >= 1"),
        # The tiny run's batch is 4 sequences per rank: R must divide it ...
        (["--pipeline-degree", "3"], "pipeline_degree (3) must divide batch_size (4)"),
        # ... and cannot exceed it.
        (["--pipeline-degree", "8"], "pipeline_degree (8) must divide batch_size (4)"),
        # vanilla runs the whole batch at once.
        (["--pipeline-degree", "2"], "pipeline_degree (2) needs a pipelined schedule"),
        (
            ["--schedule", "flowmoe", "--ar-chunk", "0"],
            "ar_chunk ('0') must be 'auto' or a positive number of bytes",
        ),
        (
            ["--schedule", "flowmoe", "--ar-chunk=-4MB"],
            "ar_chunk ('-4MB') must be 'auto' or a positive number",
        ),
        (
            ["--schedule", "flowmoe", "--ar-chunk", "4XB"],
            "ar_chunk ('4XB') must be 'auto' or a positive number",
        ),
        (
            ["--schedule", "flowmoe", "--ar-chunk", "0.5B"],
            "ar_chunk ('0.5B') must be 'auto' or a positive number",
        ),
        (["--schedule", "flow"], "schedule ('flow') must be one of 'vanilla'"),
        (["--trace", ""], "trace must be a non-empty path"),
    ],
)
def test_bad_schedule_settings(extra, message, data_file, tmp_path, capsys):
    err = fails(tiny_args(data_file, tmp_path / "run", *extra), capsys)
    assert message in err, err
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_toml_keys_and_flags(tmp_path):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    toml = tmp_path / "run.toml"
    toml.write_text(
        'schedule = "vanilla"\nbatch_size = 6\nar_chunk = "4MiB"\n'
        'trace = "t.json"\ntrace_png = "t.png"\n'
    )
    notes: list[str] = []
    cfg = config_from_args(parser.parse_args(["--config", str(toml)]), note=notes.append)
    assert (cfg.ar_chunk, cfg.ar_chunk_bytes) == (4 * 2**20, 4 * 2**20)
    assert notes == [
        f"ar_chunk in {toml} has no effect with --schedule vanilla: it applies only to "
        "--schedule moe-only or flowmoe (Sp, the chunk size of their gradient all-reduce pool; "
        "a schedule without the pool all-reduces every gradient at once after the backward)"
    ]
    assert (cfg.trace, cfg.trace_png, cfg.pipeline_degree) == ("t.json", "t.png", 1)
    # the TOML's schedule is vanilla (its ar_chunk only noted): --ar-chunk needs a pool
    argv = ["--config", str(toml), "--schedule", "moe-only", "--ar-chunk", "auto"]
    cfg = config_from_args(parser.parse_args(argv))
    assert (cfg.ar_chunk, cfg.ar_chunk_bytes) == ("auto", None)
    for text, expected in (("65536", 65536), ("4MB", 4_000_000), ("512 KiB", 524_288)):
        cfg = config_from_args(parser.parse_args(["--schedule", "flowmoe", "--ar-chunk", text]))
        assert cfg.ar_chunk_bytes == expected
    toml.write_text('schedule = "flowmoe"\nar_chunk = 1048576\n')  # a TOML int is bytes
    assert config_from_args(parser.parse_args(["--config", str(toml)])).ar_chunk == 2**20
    # Whether a trace is written is something every rank must agree on (gathering it is a
    # collective); where it goes is not.
    assert cfg.agreement_fields()["tracing"] is False and "trace" not in cfg.agreement_fields()


def _x_events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def _check_trace(path: Path, steps: list[int], world: int = 2) -> dict:
    """The Chrome trace's structure; returns it. Every rank has its process and lanes; the
    trace holds exactly ``steps``; every task lies within its rank's recorded time."""
    trace = json.loads(path.read_text())
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(world)}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    events = _x_events(trace)
    for r in range(world):
        mine = [e for e in events if e["pid"] == r]
        assert {lanes[r, e["tid"]] for e in mine} >= {"step", "compute", "allreduce", "optimizer"}
        assert all(lanes[r, e["tid"]] == e["cat"] for e in mine)
        step_spans = sorted((e for e in mine if e["cat"] == "step"), key=lambda e: e["ts"])
        assert [e["name"] for e in step_spans] == [f"step{s}" for s in steps]
        assert sum(e["name"] == "optimizer" for e in mine) == len(steps)
        for e in mine:  # the optimizer and every compute task run inside a step
            if e["cat"] in ("compute", "optimizer"):
                assert any(
                    s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1
                    for s in step_spans
                ), e
    return trace


# ---------------------------------------------------------------- pipelined schedules


@pytest.fixture(scope="module")
def flowmoe_run(data_file, tmp_path_factory) -> Path:
    """8 tiny steps of ``flowmoe`` at R = 2 from scratch (checkpoints at 4 and 8)."""
    run_dir = tmp_path_factory.mktemp("schedules") / "flowmoe"
    args = ["--schedule", "flowmoe", "--pipeline-degree", "2"]
    assert main(tiny_args(data_file, run_dir, *args)) == 0
    return run_dir


def _close_losses(got: dict[int, float], ref: dict[int, float], steps) -> None:
    assert sorted(got) == list(steps)
    for s in steps:
        assert abs(got[s] - ref[s]) <= LOSS_RTOL * abs(ref[s]), (s, got[s], ref[s])


def _close_weights(run_a: Path, run_b: Path) -> None:
    wa, wb = final_weights(run_a), final_weights(run_b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], **WEIGHT_TOL, msg=k)


def test_example_config_with_flowmoe_and_trace(data_file, tmp_path):
    """The documented command: ``--config examples/train_tiny.toml --schedule flowmoe
    --pipeline-degree 2``, with both timeline outputs."""
    out = tmp_path / "out"
    args = ["train", "--config", "examples/train_tiny.toml", "--schedule", "flowmoe"]
    args += ["--pipeline-degree", "2", "--steps", "2", "--data", str(data_file)]
    args += ["--run-dir", str(tmp_path / "run"), "--eval-batches", "1", "--threads", "1"]
    args += ["--no-progress", "--trace", str(out / "t.json"), "--trace-png", str(out / "t.png")]
    assert main(args) == 0
    trace = _check_trace(out / "t.json", [1, 2])
    for r in range(2):
        mine = [e for e in _x_events(trace) if e["pid"] == r]
        kinds = {e["name"].rstrip("0123456789.") for e in mine}
        assert {"AT", "D", "E", "C", "head", "optimizer"} <= kinds, kinds
        a2a = [e for e in mine if e["cat"] == "a2a"]
        # 2 steps x R = 2 chunks x 2 MoE blocks x (dispatch, combine) x (forward, backward).
        assert len(a2a) == 2 * 2 * 2 * 2 * 2, len(a2a)
        assert all(e["args"]["phase"] in ("fwd", "bwd") and e["args"]["chunk"] in (1, 2)
                   for e in a2a)  # fmt: skip
    assert (out / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flowmoe_trains_like_vanilla(reference, flowmoe_run):
    """8 steps from the same init and data: the same losses and weights as vanilla."""
    _close_losses(train_losses(flowmoe_run), train_losses(reference), range(1, 9))
    _close_weights(flowmoe_run, reference)


def test_vanilla_resumes_a_flowmoe_checkpoint(reference, flowmoe_run, data_file, tmp_path):
    """flowmoe's step-4 checkpoint, resumed by vanilla: steps 5-8 continue from its state.
    The run also writes vanilla's timeline (the last TRACE_STEPS steps, both outputs)."""
    run_dir = start_from(flowmoe_run, 4, tmp_path / "vanilla")
    out = tmp_path / "out"
    args = ["--resume", "--trace", str(out / "t.json"), "--trace-png", str(out / "t.png")]
    assert main(tiny_args(data_file, run_dir, *args)) == 0
    got = train_losses(run_dir)
    _close_losses(got, train_losses(flowmoe_run), range(5, 9))
    _close_losses(got, train_losses(reference), range(5, 9))
    _close_weights(run_dir, flowmoe_run)
    trace = _check_trace(out / "t.json", list(range(9 - TRACE_STEPS, 9)))
    for r in range(2):
        names = [e["name"] for e in _x_events(trace) if e["pid"] == r and e["cat"] != "step"]
        for name in ("forward", "backward", "allreduce", "optimizer"):
            assert names.count(name) == TRACE_STEPS, (name, names)
    assert (out / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("name", "R"), [("flowmoe", "4"), ("moe-only", "2")])
def test_pipelined_schedule_resumes_a_vanilla_checkpoint(name, R, reference, data_file, tmp_path):
    """vanilla's step-4 checkpoint, resumed by a pipelined schedule (another R too)."""
    run_dir = start_from(reference, 4, tmp_path / name)
    args = ["--resume", "--schedule", name, "--pipeline-degree", R]
    assert main(tiny_args(data_file, run_dir, *args)) == 0
    _close_losses(train_losses(run_dir), train_losses(reference), range(5, 9))
    _close_weights(run_dir, reference)


def test_flowmoe_under_torchrun_at_world_size_one(data_file, tmp_path):
    """``torchrun --standalone --nproc-per-node 1 -m moesaic.train --schedule flowmoe``: the
    pool of a one-rank world has no group of more than one rank (its reduction sets are all
    ``(0,)``); it used to raise ``KeyError: (0,)`` looking up the world's group after the
    first backward. Two steps complete, with vanilla's losses (``--nproc 1``)."""
    few = ["--steps", "2", "--eval-every", "2", "--ckpt-every", "2", "--eval-batches", "1"]
    run_dir = tmp_path / "flowmoe1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += ["-m", "moesaic.train", *tiny_args(data_file, run_dir, *few)[1:]]
    cmd += ["--schedule", "flowmoe", "--pipeline-degree", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()
    vanilla = tmp_path / "vanilla1"
    assert main(tiny_args(data_file, vanilla, *few, "--nproc", "1")) == 0
    _close_losses(train_losses(run_dir), train_losses(vanilla), range(1, 3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(pipeline_degree=0), r"pipeline_degree \(0\) must be >= 1"),
        (dict(pipeline_degree=1.5), r"pipeline_degree must be an int"),
        (dict(ar_chunk_bytes=0), r"ar_chunk_bytes \(0\) must be > 0"),
        (dict(ar_chunk_bytes=-1), r"ar_chunk_bytes \(-1\) must be > 0"),
    ],
)
def test_step_parts_refuse_bad_settings(kwargs, message):
    from moesaic.schedule.base import StepParts

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=message):
        StepParts(model=model, loss_fn=None, grad_sync=None, optimizer=optimizer, **kwargs)


def test_pipeline_degree_auto_rule():
    """'auto' (the default): 1 for vanilla; 2 for a pipelined schedule when it divides the
    batch, else 1; an explicit R wins; a bad string names the option."""
    from moesaic.train.config import TrainConfig
    from moesaic.train.schedule_options import parse_pipeline_degree

    assert TrainConfig().pipeline_degree == 1
    assert TrainConfig(schedule="flowmoe", batch_size=8).pipeline_degree == 2
    assert TrainConfig(schedule="moe-only", batch_size=7).pipeline_degree == 1
    assert TrainConfig(schedule="flowmoe", batch_size=8, pipeline_degree=4).pipeline_degree == 4
    assert parse_pipeline_degree("4") == 4 and parse_pipeline_degree("auto") == "auto"
    with pytest.raises(ValueError, match=r"pipeline_degree \('two'\) must be 'auto' or an int"):
        parse_pipeline_degree("two")


@pytest.mark.parametrize("tiny", ["1B", "4095", "1KiB"])
def test_ar_chunk_below_4_kib_is_refused(tiny):
    """Issue 25 item 9: ``--ar-chunk 1B`` ran 300x slower (18 vs 5,900 tokens/s, 81,792
    all-reduce spans) without a word."""
    from moesaic.train.schedule_options import parse_ar_chunk

    with pytest.raises(ValueError, match=r"must be at least 4096 bytes \(4 KiB\)"):
        parse_ar_chunk(tiny)
    assert parse_ar_chunk("4KiB") == 4096


def test_no_save_final_writes_metrics_only(data_file, tmp_path):
    """``--no-save-final`` (a throwaway run: calibrate's routing measurement, a benchmark
    point): no validation and no checkpoint at the last step, every step's metrics still."""
    few = ["--steps", "2", "--eval-every", "0", "--ckpt-every", "0", "--eval-batches", "1"]
    run_dir = tmp_path / "throwaway"
    assert main(tiny_args(data_file, run_dir, *few, "--nproc", "1", "--no-save-final")) == 0
    assert not (run_dir / "checkpoints").exists()
    kinds = [r["kind"] for r in read_metrics(run_dir)]
    assert kinds.count("train") == 2 and "val" not in kinds and "checkpoint" not in kinds
