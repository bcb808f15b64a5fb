"""Peak memory per rank of one training step on CPU, by category (issue 49 item 4).

The training job's counter, ``moesaic.train.memory.LiveBytes``, counts live tensor storage
bytes: every storage an op returns is counted once (``UntypedStorage``'s address) until it is
freed, and every tensor alive when the step starts (a ``gc`` scan: parameters, gradients,
optimizer state, hybrid's cached gathered experts) is counted from the start. Its mode is entered on the step's thread and on
the hybrid prefetcher's worker thread (gloo runs its gathers there), so the step's allocations
are seen wherever they run; autograd runs a CPU backward on the calling thread.

At each new peak the live storages are attributed, in this order, to: the model's
``parameters``, their ``gradients`` (``p.grad``), the ``optimizer state``, ``strategy state``
(tensors held by the MoE layers' strategies: hybrid's gathered experts and their shared
copies, the packed buffers a gather keeps, routing tables) and the rest: ``other, made in the step`` (activations saved for the
backward, temporaries, communication and gradient staging buffers made during the step) and
``other, alive at the step's start`` (kept across steps: the pool's staging buffers, the
batch, routing and placement tables).

Each case (strategy, schedule, the blocks' compute dtype) runs in a fresh gloo world of
``--ranks`` processes at EP = ranks, ``--repeats`` times, three optimizer steps with the
training job's AdamW (``train.loop._make_optimizer``) and its autocast (``--dtype bf16``:
``MoEGPT.set_autocast``); the first step (AdamW creates its state) and the third (steady
state) are measured. A case's peak is its largest rank's; repeats differ only where a thread's
timing decides what is alive at once (hybrid's gathers on gloo's prefetch thread). The script imports whichever
``moesaic`` is on ``PYTHONPATH``, so the same file measures another commit's tree (one that has
``train.memory.LiveBytes`` with ``classify``: from the commit that made this script use it; the
committed ``before`` entry, 89f6ff4, was measured with the script's own earlier copy)::

    git archive 89f6ff4 | tar -x -C /tmp/before     # and HEAD into /tmp/after
    PYTHONPATH=/tmp/before/src python benchmarks/step_memory.py --label before \\
        --commit 89f6ff4 --out benchmarks/results/step_memory.json
    PYTHONPATH=/tmp/after/src python benchmarks/step_memory.py --label after \\
        --commit <HEAD> --out benchmarks/results/step_memory.json
    PYTHONPATH=/tmp/after/src python benchmarks/step_memory.py --label after-standin \\
        --standin-streams --commit <HEAD> --out benchmarks/results/step_memory.json
    python benchmarks/step_memory.py --table benchmarks/results/step_memory.json

(results of several labels share the file: each run replaces its label's entry; ``--table``
prints them side by side.)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moesaic.train.memory import ALIVE_AT_START, MADE_SINCE, LiveBytes, storage_key

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer state",
    "strategy state",
    ALIVE_AT_START,
    MADE_SINCE,
)
# (strategy, schedule, blocks' compute dtype): hybrid and flowmoe, dropless under vanilla as the
# reference; fp32 (the CPU default) and bf16 autocast (``--dtype bf16``: what a GPU trains in,
# where the gathered experts' and the expert weights' casts can be half the size)
CASES = [
    (strategy, schedule, dtype)
    for dtype in ("fp32", "bf16")
    for strategy, schedule in (
        ("dropless", "vanilla"),
        ("hybrid", "vanilla"),
        ("dropless", "flowmoe"),
        ("hybrid", "flowmoe"),
    )
]
MEASURED = (0, 2)  # the first step (AdamW's state created) and the third (steady state)


def _tensors_in(obj: Any, seen: set[int], depth: int = 0) -> list[torch.Tensor]:
    """Tensors reachable from ``obj`` through containers, done futures, the attributes of the
    strategies' objects and the closures of moesaic's functions (a pending gather's buffers)."""
    if id(obj) in seen or depth > 12:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    kind = type(obj)
    items: Any = ()
    if isinstance(obj, (list, tuple, set)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, types.FunctionType) and obj.__module__.startswith("moesaic."):
        items = [_cell(c) for c in obj.__closure__ or ()]
    elif hasattr(obj, "done") and hasattr(obj, "result") and hasattr(obj, "exception"):
        items = [obj.result()] if obj.done() and obj.exception() is None else []
    elif isinstance(obj, torch.nn.Module):
        return []
    elif kind.__module__.startswith("moesaic.strategies"):
        if hasattr(obj, "__dict__"):
            items = vars(obj).values()
        else:  # a slots dataclass
            items = [getattr(obj, n, None) for n in getattr(kind, "__slots__", ())]
    return [t for item in items for t in _tensors_in(item, seen, depth + 1)]


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not yet set
        return None


def _classifier(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    params = list(model.parameters())
    strategies = [m.strategy for m in model.modules() if hasattr(m, "strategy")]

    def classify() -> dict[int, str]:
        out: dict[int, str] = {}
        held = _tensors_in(strategies, set())
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        grads = [p.grad for p in params if p.grad is not None]
        # reversed precedence: a later assignment wins
        for category, tensors in (
            ("strategy state", held),
            ("optimizer state", state),
            ("gradients", grads),
            ("parameters", params),
        ):
            for t in tensors:
                out[storage_key(t)] = category
        return out

    return classify


def _bump_versions(optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
    from torch.autograd.graph import increment_version

    increment_version([p for group in optimizer.param_groups for p in group["params"]])


def _config(args, strategy: str):
    from moesaic.models import MoEGPTConfig

    moe = {
        "num_experts": args.experts,
        "top_k": 2,
        "ffn_hidden_size": args.ffn,
        "dispatcher": strategy,
    }
    return MoEGPTConfig.from_dict(
        {
            "d_model": args.d_model,
            "n_layers": args.layers,
            "n_heads": 4,
            "seq_len": args.seq,
            "moe": moe,
        }
    )


def _case(rank: int, world_size: int, args, strategy: str, schedule: str, dtype: str) -> dict:
    from moesaic.models import MoEGPT
    from moesaic.schedule import make_step
    from moesaic.schedule.base import StepParts
    from moesaic.strategies.prefetch import ExpertPrefetcher
    from moesaic.train.hooks import ModelHooks
    from moesaic.train.loop import _make_optimizer
    from moesaic.train.parallel import GradientSync, build_layout

    torch.manual_seed(0)
    layout = build_layout(world_size, 120.0)
    model = MoEGPT(_config(args, strategy), ep_group=layout.ep_group)
    model.set_autocast(torch.bfloat16 if dtype == "bf16" else None)  # as train/loop.py does
    optimizer = _make_optimizer(model, types.SimpleNamespace(lr=1e-3, weight_decay=0.1))
    # Under a dispatch mode (this counter) torch 2.13's foreach AdamW updates the parameters
    # without bumping their version counters, by which hybrid knew its gathered copies were
    # stale until 7a6b8b1 (since then: a count of optimizer steps): on such trees it would
    # neither prefetch nor gather again without this hook, and train on the first step's
    # experts. Registered before the prefetcher's hook; harmless where the count decides.
    optimizer.register_step_post_hook(_bump_versions)
    hooks = ModelHooks(model).attach(optimizer)
    parts = StepParts(
        model=model,
        loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()),
        grad_sync=GradientSync(layout),
        optimizer=optimizer,
        pipeline_degree=args.degree,
    )
    step = make_step(schedule, parts)
    gen = torch.Generator().manual_seed(100 + rank)
    prefetchers = [h for h in hooks.hooks if isinstance(h, ExpertPrefetcher)]
    out: dict[str, Any] = {}
    for s in range(max(MEASURED) + 1):
        x_BT = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen)
        gc.collect()
        tally = LiveBytes(_classifier(model, optimizer))
        runs = [p._run for p in prefetchers]
        for p, run in zip(prefetchers, runs):  # gloo: the gathers' own thread

            def counted(jobs, _run=run, _tally=tally):
                with _tally.mode():
                    return _run(jobs)

            p._run = counted
        tally.start()
        start = tally.current
        with tally.mode():
            assert step.run(x_BT[:, :-1], x_BT[:, 1:]).applied
        for p in prefetchers:
            p.wait()
            del p._run
        if s in MEASURED:
            out[f"step{s + 1}"] = {
                "at_start_bytes": start,
                "peak_bytes": tally.peak,
                "at_peak_bytes": tally.at_peak,
            }
    if hasattr(step, "close"):
        step.close()
    hooks.close()
    return out


def _summary(repeats: list[list[dict]]) -> dict:
    """The largest rank's peak of each repeat (hybrid's gathers run on gloo's prefetch thread,
    so the overlap of its allocations with the step's, and the peak, vary with timing); the
    per-rank detail of the repeat with the highest."""
    peaks = [max(r["peak_bytes"] for r in per_rank) for per_rank in repeats]
    top = max(range(len(repeats)), key=peaks.__getitem__)
    return {
        "peak_bytes_max_rank": peaks[top],
        "peak_bytes_max_rank_repeats": peaks,
        "per_rank": repeats[top],
    }


def _source_meta() -> dict:
    import moesaic

    root = Path(moesaic.__file__).resolve().parents[2]

    def git(*cmd: str) -> str:
        res = subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True)
        return res.stdout.strip()

    return {
        "source": str(root),
        "commit": git("rev-parse", "HEAD") or "unknown",
        "uncommitted_files": len(git("status", "--porcelain", "--untracked-files=no").splitlines()),
    }


def table(path: Path, step: str = "step3") -> str:
    """A markdown table of ``path``'s runs side by side, in MiB: each case's peak (the largest
    rank's; "(-x)": the lowest repeat's peak x lower) and what was alive when the step started
    (the largest rank's), per run; the parts at the peak of the last run."""
    runs = json.loads(path.read_text())["runs"]
    labels = list(runs)
    short = ["params", "grads", "opt", "strategy", "kept", "step"]
    head = "| case | " + " | ".join(f"peak {label}" for label in labels)
    head += " | " + " | ".join(f"at start {label}" for label in labels)
    head += " | " + " | ".join(f"{c} {labels[-1]}" for c in short) + " |"
    lines = [head, "|" + " --- |" * (1 + 2 * len(labels) + len(short))]
    mib = 2**20
    for case in runs[labels[-1]]["cases"]:
        peaks, starts, parts = [], [], {}
        for label in labels:
            res = runs[label]["cases"].get(case, {}).get(step)
            if res is None:
                peaks.append("-")
                starts.append("-")
                continue
            low = min(res.get("peak_bytes_max_rank_repeats", [res["peak_bytes_max_rank"]]))
            spread = res["peak_bytes_max_rank"] - low
            peaks.append(f"{res['peak_bytes_max_rank'] / mib:.2f}")
            if spread:
                peaks[-1] += f" (-{spread / mib:.2f})"
            starts.append(f"{max(r['at_start_bytes'] for r in res['per_rank']) / mib:.2f}")
            parts = max(res["per_rank"], key=lambda r: r["peak_bytes"])["at_peak_bytes"]
        cells = [f"{parts.get(c, 0) / mib:.2f}" for c in CATEGORIES]
        lines.append(f"| {case} | " + " | ".join([*peaks, *starts, *cells]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, help="print a results file's table and exit")
    parser.add_argument("--label", help="this run's name (before, after)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--degree", type=int, default=2, help="flowmoe's R")
    parser.add_argument("--repeats", type=int, default=2, help="worlds per case")
    parser.add_argument("--only", default="", help="the cases whose name holds this text")
    parser.add_argument(
        "--commit", help="the commit of the tree on PYTHONPATH (a git-archive tree has no .git)"
    )
    parser.add_argument(
        "--standin-streams",
        action="store_true",
        help="the workers take the device-stream branches (MOESAIC_STANDIN_STREAMS=1, trees "
        "that have comm/streams.py's stand-in): hybrid's prefetch on the calling thread",
    )
    args = parser.parse_args()
    if args.table is not None:
        print(table(args.table))
        return
    if args.label is None or args.out is None:
        parser.error("--label and --out are needed to measure")

    from moesaic.comm.world import run_world

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.standin_streams:  # the spawned workers inherit it
        os.environ["MOESAIC_STANDIN_STREAMS"] = "1"
    cases = {}
    for strategy, schedule, dtype in CASES:  # a fresh world each: nothing of another alive
        if args.only not in f"{strategy}/{schedule}/{dtype}":
            continue
        repeats = [
            run_world(
                _case,
                args.ranks,
                args,
                strategy,
                schedule,
                dtype,
                timeout_s=600.0,
                pg_timeout_s=300.0,
            )
            for _ in range(args.repeats)
        ]
        cases[f"{strategy}/{schedule}/{dtype}"] = {
            step: _summary([[r[step] for r in per_rank] for per_rank in repeats])
            for step in repeats[0][0]
        }
    entry = {
        "meta": {
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            **_source_meta(),
            **({"commit": args.commit} if args.commit else {}),
        },
        "config": {
            k: v for k, v in vars(args).items() if k not in ("label", "out", "table", "commit")
        }
        | {"cases": list(cases), "backend": "gloo", "ep": args.ranks},
        "cases": cases,
    }
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data.setdefault("method", __doc__.split("\n\n")[1])
    data.setdefault("runs", {})[args.label] = entry
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    for name, steps in cases.items():
        for step, res in steps.items():
            peak = res["peak_bytes_max_rank"]
            print(f"{args.label:8s} {name:23s} {step}: peak {peak / 2**20:8.2f} MiB (max rank)")


if __name__ == "__main__":
    main()
