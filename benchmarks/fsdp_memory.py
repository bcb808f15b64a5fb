"""Per-rank bytes of parameters, gradients and AdamW state with FSDP2 x EP (issue 50 item 6):
measured by ``moesaic train`` runs at ``--dp-shard`` 1, 2 and 4 (EP 2: 2, 4 and 8 gloo ranks)
and the unsharded EP 2 run, beside the prediction.

Measured: the ``memory`` record of ``metrics.jsonl`` (``train/fsdp.py``'s ``MemoryProbe``:
the local shards' bytes right after the first optimizer step, gradients still held). Predicted:
``train.mesh.state_bytes_per_rank`` (torch-free, from the config): dense bytes / (dp_shard x
EP) plus expert bytes / (EP x dp_shard) for parameters and gradients, twice that plus 4 bytes
per parameter tensor (AdamW's ``step``) for the optimizer; the error
column says how far FSDP2's padding of uneven shards moves the measurement from that rule.
Not measured here: the activation peak (``benchmarks/step_memory.py`` measures step peaks).

Usage: ``python benchmarks/fsdp_memory.py --out benchmarks/results/fsdp_memory.json``
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from moesaic.models import MoEGPTConfig
from moesaic.train.mesh import MeshShape, model_elements, state_bytes_per_rank

# A model whose dense part outweighs its experts (attention and the byte embedding: 1.6x).
MODEL = ["--n-layers", "2", "--d-model", "256", "--n-heads", "4", "--experts", "4"]
MODEL += ["--expert-hidden", "64", "--seq-len", "64"]
EP = 2
# (label, extra flags, world size)
CASES = [
    ("unsharded EP 2", [], 2),
    ("dp_shard 1", ["--dp-shard", "1"], 2),
    ("dp_shard 2", ["--dp-shard", "2"], 4),
    ("dp_shard 4", ["--dp-shard", "4"], 8),
]


MODEL_CONFIG = MoEGPTConfig.from_dict(
    {
        "n_layers": 2,
        "d_model": 256,
        "n_heads": 4,
        "seq_len": 64,
        "moe": {"num_experts": 4, "ffn_hidden_size": 64},
    }
)  # the same shape as MODEL's flags


def run(data: Path, work: Path, flags: list[str], world: int) -> list[dict]:
    run_dir = work / "run"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    args = [sys.executable, "-m", "moesaic", "train", "--data", str(data)]
    args += ["--run-dir", str(run_dir)]
    args += [*MODEL, "--batch-size", "1", "--steps", "1", "--no-save-final", "--threads", "1"]
    args += ["--no-progress", "--nproc", str(world), "--ep", str(EP), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(args, check=True, capture_output=True, env=env, timeout=600)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (memory,) = [r for r in records if r["kind"] == "memory"]
    return memory["per_rank"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = model_elements(MODEL_CONFIG)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "corpus.txt"
        data.write_bytes(Path(json.__file__).parent.parent.joinpath("argparse.py").read_bytes())
        for label, flags, world in CASES:
            per_rank = run(data, work, flags, world)
            shard = int(flags[1]) if flags else None
            shape = None if shard is None else MeshShape(dp_shard=shard, ep=EP)
            pred = dataclasses.asdict(state_bytes_per_rank(MODEL_CONFIG, shape, EP))
            worst = {k: max(r[k] for r in per_rank) for k in ("params", "grads", "optimizer")}
            rows.append(
                {
                    "case": label,
                    "world_size": world,
                    "ep": EP,
                    "dp_shard": shard,
                    "measured_max_over_ranks": worst,
                    "measured_dense_params": max(r["dense_params"] for r in per_rank),
                    "measured_expert_params": max(r["expert_params"] for r in per_rank),
                    "predicted": pred,
                    "error": {k: worst[k] / pred[k] - 1 for k in worst},
                    "per_rank": per_rank,
                }
            )
            print(label, worst, {k: round(v) for k, v in pred.items()}, flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    result = {
        "what": __doc__.split("\n\n")[0],
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "flags": MODEL,
            "ep": EP,
            "backend": "gloo (CPU)",
            "dense_elements": n.dense,
            "expert_elements": n.expert,
            "parameter_tensors": n.tensors,
        },
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
