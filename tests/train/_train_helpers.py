"""Helpers of the training tests: the tiny run's flags and readers of its outputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def tiny_args(data: Path, run_dir: Path, *extra: str) -> list[str]:
    """A 2-layer, width-32, 4-expert model: 8 steps on 2 ranks in about a second."""
    args = ["train", "--data", str(data), "--run-dir", str(run_dir)]
    args += ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--experts", "4"]
    args += ["--expert-hidden", "32", "--seq-len", "32", "--batch-size", "4", "--steps", "8"]
    args += ["--eval-every", "4", "--eval-batches", "2", "--ckpt-every", "4", "--warmup-steps", "2"]
    args += ["--threads", "1", "--no-progress", "--timeout-s", "60"]
    return [*args, *extra]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss; a step logged twice (before a kill, then after the resume) keeps the last."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from moesaic.train.checkpoint import load_model_for_inference
    from moesaic.train.ckpt_choice import latest_checkpoint

    model, _ = load_model_for_inference(latest_checkpoint(str(run_dir)))
    return model.state_dict()


def start_from(reference: Path, step: int, run_dir: Path) -> Path:
    """A run directory holding only ``reference``'s checkpoint of ``step``."""
    name = f"step_{step:08d}"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / name, run_dir / "checkpoints" / name)
    (run_dir / "checkpoints" / "latest").write_text(name + "\n")
    return run_dir


def fails(args: list[str], capsys) -> str:
    """Run ``moesaic`` with ``args``; it must exit 2 with one ``moesaic train: error:`` line."""
    from moesaic.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moesaic train: error: ") and "\n" not in err, err
    return err


INTERRUPTED = "moesaic train: interrupted; the workers were stopped"


def interrupt_when(proc, ready, *, wait_s: float, settle_s: float = 0.0) -> str:
    """Once ``ready()`` (polled while ``proc`` runs, for at most ``wait_s``) and ``settle_s``
    later, Ctrl-C ``proc``'s process group as a terminal does; checks the one-line interrupt
    (exit 130, no traceback, the last line :data:`INTERRUPTED`) and returns its stderr.
    ``proc`` was started with ``start_new_session=True`` and ``stderr=PIPE``; it is killed if
    anything fails on the way."""
    import os
    import signal
    import time

    try:
        deadline = time.monotonic() + wait_s
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(settle_s)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == INTERRUPTED, err
    return err
