"""Issue 9 (checkpoints): damaged checkpoints refused in one line, failed saves one line and
no leftover, stale .tmp cleaned before a save, non-finite state never saved or pruned over."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from _train_helpers import start_from, tiny_args

from moesaic.cli import main
from moesaic.train.checkpoint import (
    MANIFEST,
    init_optimizer_state,
    load_checkpoint,
    load_model_for_inference,
    save_checkpoint,
)
from moesaic.train.ckpt_choice import latest_checkpoint, read_checkpoint_meta
from moesaic.train.errors import CheckpointError
from moesaic.train.parallel import build_layout


def _one_error_line(err: str, command: str = "train") -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1 and lines[0].startswith(f"moesaic {command}: error: "), err
    return lines[0]


def _damage(path: Path) -> None:
    """Zero 100 bytes inside ``path`` (same size: only a checksum can tell)."""
    data = bytearray(path.read_bytes())
    data[1000:1100] = bytes(100)
    path.write_bytes(bytes(data))


def test_damaged_data_file_refused_by_resume_and_generate(reference, data_file, tmp_path, capfd):
    # Issue 9 item 6: a damaged data file on --resume gave 163 lines and 6 tracebacks (and
    # tensor bytes zeroed in place loaded silently, wrong).
    run = start_from(reference, 8, tmp_path / "a")
    ckpt = run / "checkpoints" / "step_00000008"
    _damage(ckpt / "__0_0.distcp")
    expected = (
        f"checkpoint {ckpt} is corrupt: file __0_0.distcp does not match its sha256 in "
        "manifest.json (damaged after it was written)"
    )
    assert main(tiny_args(data_file, run, "--resume", "--steps", "10")) == 2
    assert _one_error_line(capfd.readouterr().err) == f"moesaic train: error: {expected}"
    assert main(["generate", "--checkpoint", str(run)]) == 2
    assert _one_error_line(capfd.readouterr().err, "generate") == (
        f"moesaic generate: error: {expected}"
    )
    # A damaged or missing manifest is refused too.
    (ckpt / MANIFEST).write_text("{")
    with pytest.raises(CheckpointError, match=r"is corrupt: cannot read manifest\.json"):
        read_checkpoint_meta(ckpt)


def test_dcp_checkpoint_exception_becomes_one_line(reference, tmp_path):
    # DCP's CheckpointException is a BaseException: it escaped `except Exception`.
    src = reference / "checkpoints" / "step_00000008"
    model, _ = load_model_for_inference(src)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    shard = bad / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"checkpoint {bad} could not be loaded: ") as info:
        load_checkpoint(bad, model=model, optimizer=None, rank=0)
    assert "\n" not in str(info.value)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 256 KiB tmpfs (root only): room for metrics, not for a checkpoint (~800 KB)."""
    d = tmp_path / "small"
    d.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    cmd = ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_full_disk_during_save(data_file, tiny_tmpfs, capfd):
    # A full disk during a save printed 173 lines; the partial step_N.tmp stayed on disk.
    run = tiny_tmpfs / "run"
    assert main(tiny_args(data_file, run, "--steps", "4")) == 2
    line = _one_error_line(capfd.readouterr().err)
    # Every rank sees DCP's failure; the line names the rank whose write failed.
    cause = f"saving checkpoint step_00000004 in {run}/checkpoints failed: No space left on device"
    assert line.startswith("moesaic train: error: rank "), line
    assert f": {cause} (on rank " in line, line
    assert "(traceback in " in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == []
    assert latest_checkpoint(str(run)) is None


def test_short_write_on_a_full_disk_named_as_such(tmp_path, monkeypatch):
    # CI once saw the tiny tmpfs fill inside torch's zip writer, which reports the short write as
    # "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598": the errno is lost.
    from torch.distributed.checkpoint.api import CheckpointException

    from moesaic.train import checkpoint as ckpt

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    exc = CheckpointException("save", {1: (short, None)})
    monkeypatch.setattr(ckpt, "_free_bytes", lambda path: 4096)
    assert ckpt._save_failure_cause(exc, tmp_path) == "No space left on device (on rank 1)"
    # With room left the writer's own words stand: the disk is not blamed for another fault.
    monkeypatch.setattr(ckpt, "_free_bytes", lambda path: 10 << 30)
    assert ckpt._save_failure_cause(exc, tmp_path) == (
        "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598 "
        "(on rank 1)"
    )
    enospc = OSError(28, "No space left on device")
    assert ckpt._save_failure_cause(enospc, tmp_path) == "No space left on device"


def test_stale_tmp_cleaned_before_a_save(reference, data_file, tmp_path):
    # What crashed saves leave (another step's .tmp, a moved-aside .old, latest.tmp) held the
    # room the next save needs: removed before it.
    run = start_from(reference, 8, tmp_path / "a")
    root = run / "checkpoints"
    (root / "step_00000012.tmp").mkdir()
    (root / "step_00000012.tmp" / "__0_0.distcp").write_bytes(b"x" * 1000)
    (root / "step_00000004.old").mkdir()
    (root / "latest.tmp").write_text("step_00000012\n")
    assert main(tiny_args(data_file, run, "--resume", "--steps", "10")) == 0
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_00000008", "step_00000010"]
    meta = read_checkpoint_meta(root / "step_00000010")  # verifies every sha256
    assert meta["step"] == 10 and meta["format"] == 2


def _saver(run_dir: Path, model, optimizer, layout, meta):
    def save(step: int, keep: int = 2) -> Path:
        return save_checkpoint(
            str(run_dir),
            model=model,
            optimizer=optimizer,
            step=step,
            consumed=step,
            meta=meta,
            layout=layout,
            keep=keep,
        )

    return save


def test_nonfinite_state_is_never_saved(reference, tmp_path):
    # With R1's item 2: a diverged run's NaN weights replaced the good checkpoints (and
    # keep-last-k pruning deleted them). A save refuses them; nothing is written or pruned.
    src = reference / "checkpoints" / "step_00000008"
    model, meta = load_model_for_inference(src)
    meta = {k: v for k, v in meta.items() if k not in ("format", "step", "consumed")}
    optimizer = torch.optim.AdamW(model.parameters())
    init_optimizer_state(optimizer)
    save = _saver(tmp_path, model, optimizer, build_layout(1, 60.0), meta)
    save(1)
    save(2)
    root = tmp_path / "checkpoints"
    before = sorted(p.name for p in root.iterdir())
    name, p = next(iter(model.named_parameters()))
    with torch.no_grad():
        p.view(-1)[0] = float("nan")
    with pytest.raises(CheckpointError) as info:
        save(3, keep=1)
    assert str(info.value) == (
        "refusing to save checkpoint step 3: 1 tensors hold NaN or inf (rank 0: 1, e.g. "
        f"model.{name}); the last good checkpoint (step_00000002) is kept"
    )
    assert (
        sorted(p.name for p in root.iterdir())
        == before
        == [
            "latest",
            "step_00000001",
            "step_00000002",
        ]
    )
    # Finite again: saved, and pruning to keep=1 removes only older finished checkpoints.
    with torch.no_grad():
        p.view(-1)[0] = 0.0
    (root / "step_00000000").mkdir()  # no manifest: not a finished checkpoint, never pruned
    save(3, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000000", "step_00000003"]
    assert json.loads((root / "step_00000003" / MANIFEST).read_text())["algorithm"] == "sha256"
