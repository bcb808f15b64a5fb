"""Per-step budgets of a training step, counted on CPU (issue 49): host syncs, collectives per
lane and on the world's control plane, communicators per rank, and peak memory per rank.

Run from a checkout (``PYTHONPATH=<other tree>/src`` measures another commit with this same
script)::

    OMP_NUM_THREADS=1 python benchmarks/step_budget.py --out benchmarks/results/x.json

Each case trains a small MoEGPT (2 MoE blocks) for ``STEPS`` steps on a gloo world of 2 ranks
(EP 2) with the optimizer the training loop builds, and counts the last step:

* host syncs: ``moesaic.testing.HostSyncCounter`` over the whole ``step.run`` (forward,
  backward, gradient sync, norm, health flags, clipping, optimizer) and the training loop's
  statistics of the step (``train.loop._step_stats``: loss, aux loss, loads), with AdamW as a GPU run
  builds it (``fused``, whose step counts stay on the device) where the tree has
  ``train.loop.make_adamw``, else the loop's old ``foreach=False`` (whose per-parameter reads
  of the CPU-resident step counts the counter sees, a GPU would not sync on them);
* collectives: ``record_collectives`` per lane, averaged over the last ``TUNE_STEPS`` steps
  (flowmoe's Sp tuner agrees its choice on some steps only), and those on the world group
  (the control plane: health flags, the tuner's choice, the loop's statistics);
* communicators: process groups the world's registry created (``GroupRegistry.created``) once
  the model, step and prefetcher exist and have run;
* peak memory: the largest sum of live CPU allocations during the last step (torch.profiler's
  memory events), above what was allocated before it, plus the parameters' bytes.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

STEPS, TUNE_STEPS = 7, 5
CASES = [  # (schedule, dispatcher, prefetcher, tuned Sp)
    ("vanilla", "dropless", False, False),
    ("vanilla", "hybrid", True, False),
    ("vanilla", "hybrid", False, False),  # no prefetcher: what a hybrid run without it holds
    ("flowmoe", "dropless", False, True),
    ("flowmoe", "hybrid", True, True),
]
WORLD = 2


def _optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, str]:
    try:
        from moesaic.train.loop import adamw_kernel, make_adamw  # type: ignore[attr-defined]
    except ImportError:
        return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False), "foreach=False"
    gpu = torch.device("cuda")  # what a GPU run builds (fused runs on CPU too)
    kernel = ",".join(adamw_kernel(gpu))
    return make_adamw(model.parameters(), lr=1e-3, device=gpu), kernel


def _peak_bytes(prof: torch.profiler.profile) -> int:
    """The highest running sum of the allocations (+) and frees (-) the profiler recorded."""
    assert prof.profiler is not None
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    live = peak = 0
    for ev in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        live += ev.nbytes()
        peak = max(peak, live)
    return peak


# The world's control plane: what the step agrees on across ranks once per step (the EP group
# of EP = world has the same ranks, so they are told apart by what they carry).
CONTROL = ("health flags", "gradient norm", "step statistics")


def _case(rank: int, schedule: str, dispatcher: str, prefetch: bool, tuned: bool) -> dict:
    from moesaic.comm.collectives import record_collectives
    from moesaic.comm.groups import registry
    from moesaic.models import MoEGPT, MoEGPTConfig
    from moesaic.schedule import make_step
    from moesaic.schedule.base import StepParts
    from moesaic.strategies.prefetch import ExpertPrefetcher
    from moesaic.testing import HostSyncCounter
    from moesaic.train.parallel import GradientSync, build_layout

    created0 = registry().created
    layout = build_layout(WORLD, 60.0)
    moe = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 64, "dispatcher": dispatcher}
    cfg = MoEGPTConfig.from_dict(
        {"d_model": 64, "n_layers": 3, "dense_layers": 1, "n_heads": 2, "seq_len": 16, "moe": moe}
    )
    torch.manual_seed(0)
    model = MoEGPT(cfg, ep_group=layout.ep_group)
    optimizer, kernel = _optimizer(model)
    prefetcher = ExpertPrefetcher(model).attach(optimizer) if prefetch else None
    loop = importlib.import_module("moesaic.train.loop")
    # the loop's statistics of a step (loss, aux loss, loads): trees since efac67d hand them
    # to the step, which sums them with its health flags; older ones all-reduce them after it
    folded = hasattr(loop, "_step_statistics")
    extra = {"statistics": loop._step_statistics(model, "cpu")} if folded else {}
    parts = StepParts(
        model=model,
        loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        grad_sync=GradientSync(layout),
        optimizer=optimizer,
        pipeline_degree=1 if schedule == "vanilla" else 2,
        ar_chunk_bytes=None if tuned else 1 << 16,
        grad_clip=1.0,
        **extra,
    )
    step = make_step(schedule, parts)

    def run(x_BT: torch.Tensor) -> None:  # a step and the loop's statistics of it
        result = step.run(x_BT[:, :-1], x_BT[:, 1:])
        if folded:
            loop._step_stats(model, result.statistics, layout, "cpu")
        else:
            loop._step_stats(model, result.ce, result.aux, layout, "cpu")

    gen = torch.Generator().manual_seed(rank)
    lanes: Counter[str] = Counter()
    control = 0
    syncs = peak = 0
    for s in range(STEPS):
        x_BT = torch.randint(0, 256, (4, 17), generator=gen)
        last = s == STEPS - 1
        if prefetcher is not None:
            prefetcher.wait()
        with record_collectives() as log:
            if last:
                with (
                    torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
                    ) as prof,
                    HostSyncCounter() as counter,
                ):
                    run(x_BT)
                syncs, peak = counter.count, _peak_bytes(prof)
            else:
                run(x_BT)
            if prefetcher is not None:
                prefetcher.wait()
        if s >= STEPS - TUNE_STEPS:
            lanes.update(lane for _, lane, _, _ in log)
            control += sum(1 for *_, what in log if any(c in what for c in CONTROL))
    if hasattr(step, "close"):
        step.close()
    if prefetcher is not None:
        prefetcher.close()
    reg = registry()
    by_lane = Counter(lane for (_ranks, lane), pg in reg._groups.items() if pg is not None)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "optimizer": f"AdamW({kernel})",
        "host_syncs_per_step": syncs,
        "collectives_per_step_by_lane": {k: v / TUNE_STEPS for k, v in sorted(lanes.items())},
        "control_collectives_per_step": control / TUNE_STEPS,
        "communicators_per_rank": reg.created - created0,
        "groups_by_lane": dict(sorted(by_lane.items())),
        "peak_step_bytes_above_start": peak,
        "parameter_bytes": params,
    }


def _world(rank: int, world: int, case: tuple) -> dict:
    torch.set_num_threads(1)
    return _case(rank, *case)


def main() -> None:
    from moesaic.comm.world import run_world

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--commit", help="the commit of a tree that is no git checkout (an archive)")
    args = ap.parse_args()
    import moesaic

    tree = Path(moesaic.__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (not a git checkout)"
    commit = args.commit or commit
    results: list[dict] = [{} for _ in range(WORLD)]
    for case in CASES:  # a world each: communicators are counted from a fresh registry
        for rank, got in enumerate(run_world(_world, WORLD, case, timeout_s=600.0)):
            name = f"{case[0]}/{case[1]}" + (
                "" if case[2] or case[1] != "hybrid" else " (no prefetcher)"
            )
            results[rank][name] = got
    doc = {
        "what": __doc__.splitlines()[0],
        "label": args.label,
        "commit": commit,
        "tree": str(tree),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
        "config": {
            "world": WORLD,
            "ep": WORLD,
            "steps": STEPS,
            "counted": "the last step",
            "collectives averaged over": TUNE_STEPS,
            "cases": CASES,
            "model": "MoEGPT d_model 64, 3 layers (1 dense, 2 MoE), E 4, K 2, F 64, T 16, B 4",
        },
        "per_rank": results,
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(results[0], indent=1))


if __name__ == "__main__":
    main()
