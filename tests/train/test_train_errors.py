"""User errors: a clear one-line message and exit code 2, before any worker starts."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from _train_helpers import fails, start_from, tiny_args

from moesaic.cli import main


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # EP must divide the world (2 ranks).
        (["--ep", "3"], "ep (3) must divide the world size (2)"),
        # 6 experts cannot be split over an EP group of 4.
        (["--nproc", "4", "--ep", "4", "--experts", "6"], "num_experts (6) must be divisible"),
        (["--n-heads", "3"], "d_model (32) must be divisible by n_heads (3)"),
        (["--steps", "0"], "steps (0) must be >= 1"),
        (["--fault-kill-rank", "0"], "fault_kill_rank and fault_kill_step must be given together"),
    ],
)
def test_bad_layout_or_config(extra, message, data_file, tmp_path, capsys):
    assert message in fails(tiny_args(data_file, tmp_path / "run", *extra), capsys)


def test_missing_and_empty_data(tmp_path, capsys):
    err = fails(tiny_args(tmp_path / "nope.txt", tmp_path / "run"), capsys)
    assert "data path" in err and "does not exist" in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    assert "is empty" in fails(tiny_args(tmp_path / "empty", tmp_path / "run"), capsys)
    (tmp_path / "short.txt").write_text("x" * 20)
    assert "fewer than seq_len + 1" in fails(
        tiny_args(tmp_path / "short.txt", tmp_path / "r"), capsys
    )


def test_resume_without_checkpoint(data_file, tmp_path, capsys):
    assert "no checkpoint" in fails(tiny_args(data_file, tmp_path / "run", "--resume"), capsys)


def test_corrupt_checkpoints(reference, data_file, tmp_path, capsys):
    # Garbage DCP metadata.
    run = start_from(reference, 8, tmp_path / "a")
    (run / "checkpoints" / "step_00000008" / ".metadata").write_bytes(b"not a pickle")
    assert "is corrupt" in fails(tiny_args(data_file, run, "--resume"), capsys)
    # A truncated data file.
    run = start_from(reference, 8, tmp_path / "b")
    shard = run / "checkpoints" / "step_00000008" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert "is corrupt" in fails(tiny_args(data_file, run, "--resume"), capsys)
    # The latest pointer names a checkpoint that is gone.
    run = start_from(reference, 8, tmp_path / "c")
    shutil.rmtree(run / "checkpoints" / "step_00000008")
    assert "not a directory" in fails(tiny_args(data_file, run, "--resume"), capsys)
    # Unreadable meta.json.
    run = start_from(reference, 8, tmp_path / "d")
    (run / "checkpoints" / "step_00000008" / "meta.json").write_text("{")
    assert "is corrupt" in fails(tiny_args(data_file, run, "--resume"), capsys)


def test_incompatible_checkpoint(reference, data_file, tmp_path, capsys):
    run = start_from(reference, 8, tmp_path / "a")
    err = fails(tiny_args(data_file, run, "--resume", "--d-model", "64"), capsys)
    assert "incompatible: model d_model is 32 in the checkpoint but 64" in err


def test_error_from_the_shell_is_one_line(tmp_path):
    cmd = [sys.executable, "-m", "moesaic", *tiny_args(tmp_path / "x", tmp_path / "r", "--ep", "3")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "moesaic train: error: ep (3) must divide the world size (2)"


def test_generate_errors(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(tmp_path)]) == 2
    assert "neither a checkpoint nor a run directory" in capsys.readouterr().err


def test_fresh_run_into_a_used_run_dir(reference, data_file, capsys):
    err = fails(tiny_args(data_file, reference), capsys)
    assert "already holds checkpoints (latest: step_00000008); pass --resume" in err
