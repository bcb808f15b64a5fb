"""HybridEP under FlowMoE on an emulated cluster (issue 22 item 4): dropless and hybrid, each
under the vanilla and the flowmoe schedule, timed round-robin in one world.

Usage (root: the emulated network needs network namespaces)::

    python benchmarks/compose_cluster.py --cluster examples/clusters/hybridep_2dc2.toml \\
        [--steps 8] [--out FILE.json] [--loopback]

Rules fixed before measuring:

* hybrid's domain sizes are what ``moesaic train --domains auto`` would choose for this model,
  batch and cluster (``plan_training_domains`` at the GEMM rate rank 0 measures, every rank
  taking rank 0's number), for the vanilla schedule; the same sizes under flowmoe. When the
  planner picks domains of one rank (classic EP), hybrid has nothing of its own to hide and the
  report says so;
* flowmoe: R = 2 and 4, Sp = G / 16 (G the replicated gradients' bytes), as in
  ``benchmarks/flowmoe_cluster.py``'s +Pipe-AR row;
* one world, every configuration its own copy of the model (same seed), one step of each per
  round with a barrier before each step; the step time is the slowest rank's; speedups are
  medians of per-round ratios.

The perfect-overlap bound of a configuration is max(busy compute, busy communication) of its
recorded spans (``moesaic.trace.overlap_bound``, the larger rank's). The vanilla schedule records
only whole forward/backward spans, so each vanilla row's bound is read from the same strategy
under ``moe-only`` at R = 1 (the same work, not overlapped, every stage traced), which is timed
too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# The step timing and the median/p10/p90 of flowmoe_cluster.py (same directory: the workers
# import both scripts by module name).
from flowmoe_cluster import _stats, _timed_step

MODEL = {
    "d_model": 128,
    "n_layers": 2,  # two MoE blocks, no dense one: a model the simulator expresses
    "dense_layers": 0,
    "n_heads": 4,
    "seq_len": 64,
    "moe": {
        "num_experts": 8,
        "top_k": 2,
        "ffn_hidden_size": 256,
        "dispatcher": "dropless",
        "aux_loss_coef": 0.01,
    },
}
BATCH = 8  # sequences per rank (R = 2, 4 divide it)
WARMUP = 2
SP_DIVISOR = 16
# (label, strategy, schedule, R)
CONFIGS: list[tuple[str, str, str, int]] = [
    ("dropless vanilla", "dropless", "vanilla", 1),
    ("dropless moe-only R=1 (traced vanilla)", "dropless", "moe-only", 1),
    ("dropless flowmoe R=2", "dropless", "flowmoe", 2),
    ("dropless flowmoe R=4", "dropless", "flowmoe", 4),
    ("hybrid vanilla", "hybrid", "vanilla", 1),
    ("hybrid moe-only R=1 (traced vanilla)", "hybrid", "moe-only", 1),
    ("hybrid flowmoe R=2", "hybrid", "flowmoe", 2),
    ("hybrid flowmoe R=4", "hybrid", "flowmoe", 4),
]
TRACED = {"dropless vanilla": 1, "hybrid vanilla": 5}  # vanilla row -> its traced twin


def _set_shape(shape: dict) -> None:
    """The run's model shape (``--seq-len``, ``--ffn``, ``--batch``), in every worker."""
    global BATCH
    MODEL["seq_len"] = shape["seq_len"]
    MODEL["moe"]["ffn_hidden_size"] = shape["ffn"]  # type: ignore[index]
    BATCH = shape["batch"]


def _model_config(strategy: str, domains: tuple[int, ...] | None) -> Any:
    from moesaic.models import MoEGPTConfig

    moe = {**MODEL["moe"], "dispatcher": strategy}  # type: ignore[dict-item]
    if strategy == "hybrid":
        moe["options"] = {"domain_sizes": list(domains) if domains else None}
    return MoEGPTConfig.from_dict({**MODEL, "moe": moe})


def _lm_loss(logits_BTV: Any, y_BT: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())


def _plan_domains(spec: Any, layout: Any) -> tuple[tuple[int, ...], str]:
    """What ``--domains auto`` picks here (rank 0's GEMM rate on every rank)."""
    import torch

    from moesaic.sim.hybrid_costmodel import measure_gemm_flops
    from moesaic.train.domains import plan_training_domains

    mine = measure_gemm_flops() if layout.rank == 0 else 0.0
    rates = layout.world.all_gather_dim0(torch.tensor([[mine]], dtype=torch.float64), "flops")
    plan = plan_training_domains(
        _model_config("hybrid", None),
        spec,
        batch_size=BATCH,
        pipeline_degree=1,
        flops_per_s=float(rates[0, 0]),
    )
    return tuple(plan.chosen.domain_sizes), plan.reason


def _build(layout: Any, rank: int, spec: Any, config: tuple, domains: Any) -> Any:
    import torch

    from moesaic.layer import is_expert_param
    from moesaic.models import MoEGPT
    from moesaic.schedule import make_step
    from moesaic.schedule.base import StepParts
    from moesaic.trace import Recorder
    from moesaic.train.parallel import GradientSync

    _, strategy, schedule, R = config
    torch.manual_seed(0)
    model = MoEGPT(_model_config(strategy, domains), ep_group=layout.ep_group, topology=spec)
    G = sum(p.numel() * p.element_size() for p in model.parameters() if not is_expert_param(p))
    parts = StepParts(
        model=model,
        loss_fn=_lm_loss,
        grad_sync=GradientSync(layout),
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        pipeline_degree=R,
        ar_chunk_bytes=max(4096, G // SP_DIVISOR) if schedule == "flowmoe" else None,
        recorder=Recorder(rank),
    )
    return make_step(schedule, parts)


def timing_worker(
    rank: int, world: int, spec_dict: dict, steps: int, timeout_s: float, shape: dict
) -> dict:
    import torch
    import torch.distributed as dist

    from moesaic.cluster.spec import ClusterSpec
    from moesaic.train.parallel import build_layout

    torch.set_num_threads(1)
    _set_shape(shape)
    spec = ClusterSpec.from_dict(spec_dict)
    layout = build_layout(ep_size=world, timeout_s=timeout_s)
    domains, reason = _plan_domains(spec, layout)
    gen = torch.Generator().manual_seed(100 + rank)
    T = MODEL["seq_len"]
    batches = [torch.randint(0, 256, (BATCH, T + 1), generator=gen) for _ in range(4)]  # type: ignore[call-overload]
    built = [_build(layout, rank, spec, c, domains) for c in CONFIGS]
    for step in built:
        for i in range(WARMUP):
            step.run(batches[i][:, :-1], batches[i][:, 1:])
    rounds = []
    for i in range(steps):
        x = batches[i % len(batches)]
        row = []
        for step in built:
            dist.barrier()
            row.append(_timed_step(step, x))
        rounds.append(row)
    for step in built:
        if hasattr(step, "close"):
            step.close()
    return {"rounds": rounds, "domains": list(domains), "reason": reason}


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration: the slowest rank per round, then medians over rounds."""
    n = len(per_rank[0]["rounds"])

    def worst(i: int, k: int) -> dict[str, float]:
        return max((r["rounds"][i][k] for r in per_rank), key=lambda d: d["time_s"])

    def bound(i: int, k: int) -> float:
        return max(r["rounds"][i][k]["bound_s"] for r in per_rank)

    out: dict[str, Any] = {}
    for k, (label, strategy, schedule, R) in enumerate(CONFIGS):
        b = TRACED.get(label, k)
        times = [worst(i, k)["time_s"] for i in range(n)]
        bounds = [bound(i, b) for i in range(n)]
        out[label] = {
            "strategy": strategy,
            "schedule": schedule,
            "pipeline_degree": R,
            "step_time_s": _stats(times),
            "overlap_bound_s": _stats(bounds),
            "bound_from": CONFIGS[b][0],
            "busy_compute_s": _stats([worst(i, b)["compute_s"] for i in range(n)]),
            "busy_comm_s": _stats([worst(i, b)["comm_s"] for i in range(n)]),
            "busy_gather_s": _stats([worst(i, b)["gather_s"] for i in range(n)]),
            "time_over_bound": _stats([t / x for t, x in zip(times, bounds) if x > 0]),
        }
    labels = [c[0] for c in CONFIGS]
    for name in labels:
        j = labels.index(name)
        for label in labels:
            k = labels.index(label)
            ratios = [worst(i, j)["time_s"] / worst(i, k)["time_s"] for i in range(n)]
            out[label].setdefault("speedup_over", {})[name] = _stats(ratios)
    return out


def composition_gain(summary: dict[str, Any]) -> dict[str, Any]:
    """hybrid + flowmoe against the better of hybrid alone and flowmoe alone (per R)."""
    gains = {}
    for R in (2, 4):
        combo = summary[f"hybrid flowmoe R={R}"]
        alone = {
            "hybrid vanilla": summary["hybrid vanilla"]["step_time_s"]["median"],
            f"dropless flowmoe R={R}": summary[f"dropless flowmoe R={R}"]["step_time_s"]["median"],
        }
        better = min(alone, key=lambda k: alone[k])
        gains[f"R={R}"] = {
            "better_alone": better,
            "speedup_over_better_alone": combo["speedup_over"][better],
        }
    return gains


def _table(summary: dict[str, Any]) -> str:
    lines = [f"{'configuration':40s} {'step s':>8s} {'bound s':>8s} {'t/bound':>8s}"]
    for label, e in summary.items():
        lines.append(
            f"{label:40s} {e['step_time_s']['median']:8.3f} {e['overlap_bound_s']['median']:8.3f} "
            f"{e['time_over_bound']['median']:8.2f}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="examples/clusters/hybridep_2dc2.toml")
    parser.add_argument("--steps", type=int, default=8, help="measured rounds")
    parser.add_argument("--out", default=None)
    parser.add_argument("--loopback", action="store_true", help="no emulated network (sizing)")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--seq-len", type=int, default=MODEL["seq_len"])
    parser.add_argument("--ffn", type=int, default=MODEL["moe"]["ffn_hidden_size"])  # type: ignore[index]
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences per rank")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import compose_cluster as mod  # workers unpickle the functions by this module name
    from moesaic.bench.meta import run_metadata
    from moesaic.cluster.spec import ClusterSpec

    shape = {"seq_len": args.seq_len, "ffn": args.ffn, "batch": args.batch}
    _set_shape(shape)
    spec = ClusterSpec.from_toml(args.cluster)
    spec_dict = json.loads(json.dumps(spec.to_dict()))
    world = spec.world_size
    load_before = os.getloadavg()
    start = time.perf_counter()
    if args.loopback:
        from moesaic.comm.world import run_world

        per_rank = run_world(
            mod.timing_worker, world, spec_dict, args.steps, args.timeout_s, shape, timeout_s=900.0
        )
    else:
        from moesaic.cluster import EmulatedCluster

        with EmulatedCluster(spec) as cluster:
            per_rank = cluster.run(
                mod.timing_worker,
                world,
                spec_dict,
                args.steps,
                args.timeout_s,
                shape,
                timeout_s=900.0,
            )
    wall = time.perf_counter() - start
    summary = summarize(per_rank)
    result = {
        "meta": run_metadata(),
        "wall_s": wall,
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "cluster": None if args.loopback else spec_dict,
        "config": {
            "model": MODEL,
            "batch_per_rank": BATCH,
            "world_size": world,
            "ep": world,
            "optimizer": "AdamW lr 1e-3",
            "warmup_steps": WARMUP,
            "measured_rounds": args.steps,
            "flowmoe_sp": f"G/{SP_DIVISOR}",
            "hybrid_domains": per_rank[0]["domains"],
            "hybrid_domains_reason": per_rank[0]["reason"],
            "configs": CONFIGS,
        },
        "results": summary,
        "composition_gain": composition_gain(summary),
        "notes": [
            "step time: the slowest rank's wall time of step.run per round; speedups: median "
            "(p10, p90) of per-round ratios (same round, same batch)",
            "overlap bound: max(busy compute, busy a2a+gather+allreduce) from the step's "
            "recorded spans, the larger rank's; vanilla rows from their moe-only R=1 twin",
        ],
    }
    name = f"{Path(args.cluster).stem}_s{args.seq_len}_b{args.batch}_f{args.ffn}"
    out = Path(args.out or f"benchmarks/results/compose_{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"hybrid domains: {per_rank[0]['domains']} ({per_rank[0]['reason']})")
    print(_table(summary))
    print(json.dumps(result["composition_gain"], indent=1))
    print(f"wall {wall:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
