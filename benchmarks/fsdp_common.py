"""What the FSDP2 x EP benchmarks share (``fsdp_memory.py``, ``fsdp_cluster.py``,
``sim_fsdp_check.py``, ``sim_replica_levels_check.py``): the model with a large dense part (as
flags and as a training config for ``calibrate``, at a given world and expert count), the corpus, one ``moesaic train``
run's records, a calibration on a cluster, and the result file's provenance."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from moesaic.models import MoEGPTConfig


def model_flags(experts: int = 4) -> list[str]:
    """A model whose dense part outweighs its experts (attention and the byte embedding: 1.5x
    at 4 experts), as ``moesaic train`` flags."""
    flags = ["--n-layers", "2", "--d-model", "256", "--n-heads", "4", "--experts", str(experts)]
    return [*flags, "--expert-hidden", "64", "--seq-len", "64"]


MODEL = model_flags()
MODEL_CONFIG = MoEGPTConfig.from_dict(
    {
        "n_layers": 2,
        "d_model": 256,
        "n_heads": 4,
        "seq_len": 64,
        "moe": {"num_experts": 4, "ffn_hidden_size": 64},
    }
)  # the same shape as MODEL's flags


# MODEL as the training config ``moesaic calibrate --model`` and ``load_model_spec`` read.
TRAIN_TOML = """nproc = {world}
ep = {world}
steps = 8
batch_size = 2
eval_every = 0
ckpt_every = 0
save_final = false
run_dir = "{run}"

[model]
seq_len = 64
d_model = 256
n_layers = 2
n_heads = 4

[model.moe]
num_experts = {experts}
ffn_hidden_size = 64
"""


def train_toml(run: Path, world: int = 4, experts: int = 4) -> str:
    """MODEL's training config at ``world`` ranks, EP = world, with ``experts`` experts."""
    return TRAIN_TOML.format(run=run, world=world, experts=experts)


def calibrate_on(
    cluster: Path, work: Path, timeout_s: float = 1800, *, world: int = 4, experts: int = 4
) -> tuple[Path, Path]:
    """``moesaic calibrate --cluster CLUSTER --model`` the model's training config (written to
    ``work/train.toml``; ``world`` ranks, ``experts`` experts): the paths of that config and of
    the profile (``work/p.json``)."""
    train = work / "train.toml"
    train.write_text(train_toml(work / "r", world, experts))
    profile = work / "p.json"
    cmd = [sys.executable, "-m", "moesaic", "calibrate", "--cluster", str(cluster)]
    cmd += ["--model", str(train), "--out", str(profile)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode:
        raise SystemExit(proc.stderr[-800:])
    return train, profile


def write_corpus(work: Path) -> Path:
    """The training text: the standard library's ``argparse.py``."""
    data = work / "corpus.txt"
    data.write_bytes(Path(json.__file__).parent.parent.joinpath("argparse.py").read_bytes())
    return data


def train_records(
    data: Path, work: Path, flags: list[str], timeout_s: float, experts: int = 4
) -> list[dict]:
    """``moesaic train`` on ``data`` with the model's and ``flags`` (``experts`` experts), in a
    fresh run directory under ``work``: its ``metrics.jsonl`` records."""
    run_dir = work / "run"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    args = [sys.executable, "-m", "moesaic", "train", "--data", str(data)]
    args += ["--run-dir", str(run_dir), *model_flags(experts), "--no-save-final", "--no-progress"]
    args += flags
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(args, check=True, capture_output=True, env=env, timeout=timeout_s)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def provenance(doc: str) -> dict:
    """The result file's header: what (the script's first paragraph), machine, versions, the
    commit and the date."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "what": doc.split("\n\n")[0],
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
