"""``moesaic.train`` for a few steps on NCCL under each schedule (torchrun, one process, the
single-rank shortcuts off so that every collective of the step runs), with evaluation and
checkpoints. The CPU twin runs flowmoe on gloo the same way (~6 s): a world of one is where
FlowMoE's pool once raised KeyError.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _gpu_helpers import NEEDS_CUDA

STEPS = 4
SCHEDULES = ("vanilla", "moe-only", "flowmoe")
CASES = [pytest.param("nccl", s, id=f"nccl-{s}", marks=NEEDS_CUDA) for s in SCHEDULES]
CASES.append(pytest.param("gloo", "flowmoe", id="cpu-gloo-flowmoe-twin"))


def _args(data: Path, run_dir: Path) -> list[str]:
    """A 2-layer, width-32, 4-expert model (tests/train's tiny run), ``STEPS`` steps."""
    args = ["--data", str(data), "--run-dir", str(run_dir), "--steps", str(STEPS)]
    args += ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--experts", "4"]
    args += ["--expert-hidden", "32", "--seq-len", "32", "--batch-size", "4"]
    args += ["--eval-every", "2", "--eval-batches", "1", "--ckpt-every", "2", "--warmup-steps", "1"]
    return [*args, "--threads", "1", "--no-progress", "--timeout-s", "120"]


@pytest.mark.parametrize(("backend", "schedule"), CASES)
def test_train_a_few_steps(backend, schedule, data_file, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += ["-m", "moesaic.train", *_args(data_file, run_dir)]
    cmd += ["--backend", backend, "--schedule", schedule]
    env = {**os.environ, "MOESAIC_NO_SHORTCUTS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses), losses
    assert [r["step"] for r in rows if r["kind"] == "val"] == [2, 4]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"
