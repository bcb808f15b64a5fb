"""Per-rank memory with FSDP2 x EP (issue 50 item 6): parameters, gradients, AdamW state and a
step's peak, measured by ``moesaic train --measure-peak`` runs at ``--dp-shard`` 1, 2 and 4 (EP
2: 2, 4 and 8 gloo ranks) and the unsharded EP 2 run, at 1 and 8 sequences per rank, beside
``moesaic.sim.memory``'s prediction.

Measured (the ``memory`` record of ``metrics.jsonl``, ``moesaic.train.memory``): the local
shards' bytes right after the first optimizer step (gradients still held), and the most bytes
alive at once during the second step (tensor storages counted on each rank's step thread),
the largest rank's. Predicted: ``sim.memory.predict_memory`` (torch-free, from the config,
the batch and the mesh; uniform routing). The peak's error column is measured / predicted - 1;
the measurement also holds what the model leaves out (the corpus, buffers: about 0.15 MB here).

Usage: ``python benchmarks/fsdp_memory.py --out benchmarks/results/fsdp_memory.json``
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from fsdp_common import MODEL, MODEL_CONFIG, provenance, train_records, write_corpus
from moesaic.sim.memory import model_elements, predict_memory

EP = 2
# (label, dp_shard or None, world size)
MESHES = [("unsharded EP 2", None, 2), ("dp_shard 1", 1, 2), ("dp_shard 2", 2, 4)]
MESHES += [("dp_shard 4", 4, 8)]
BATCHES = (1, 8)
STATE = ("params", "grads", "optimizer")


def measure(data: Path, work: Path, dp_shard: int | None, world: int, batch: int) -> list[dict]:
    flags = ["--batch-size", str(batch), "--steps", "2", "--threads", "1", "--measure-peak"]
    flags += ["--nproc", str(world), "--ep", str(EP)]
    if dp_shard is not None:
        flags += ["--dp-shard", str(dp_shard)]
    records = train_records(data, work, flags, timeout_s=900)
    (memory,) = [r for r in records if r["kind"] == "memory"]
    return memory["per_rank"]


def row(label: str, dp_shard: int | None, world: int, batch: int, per_rank: list[dict]) -> dict:
    pred = predict_memory(MODEL_CONFIG, batch_size=batch, ep=EP, dp_shard=dp_shard)
    worst = {k: max(r[k] for r in per_rank) for k in (*STATE, "step_peak")}
    return {
        "case": label,
        "batch_per_rank": batch,
        "world_size": world,
        "ep": EP,
        "dp_shard": dp_shard,
        "measured_max_over_ranks": worst,
        "measured_dense_params": max(r["dense_params"] for r in per_rank),
        "measured_expert_params": max(r["expert_params"] for r in per_rank),
        "predicted": pred.to_dict(),
        "error": {
            **{k: worst[k] / getattr(pred, k) - 1 for k in STATE},
            "peak": worst["step_peak"] / pred.peak - 1,
        },
        "per_rank": per_rank,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = model_elements(MODEL_CONFIG)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = write_corpus(work)
        for batch in BATCHES:
            for label, dp_shard, world in MESHES:
                rows.append(
                    row(label, dp_shard, world, batch, measure(data, work, dp_shard, world, batch))
                )
                r = rows[-1]
                print(label, batch, r["measured_max_over_ranks"], r["error"], flush=True)
    result = {
        **provenance(__doc__),
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
