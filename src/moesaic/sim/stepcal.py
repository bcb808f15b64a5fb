"""One rank's whole training step, timed before the job runs: ``calibrate --model`` on a
training config trains one rank's share of that job in one local process and keeps its median
step time as the profile's ``ops.step_s`` (:class:`moesaic.sim.opcal.OpCal`).

Why: the simulator prices a step from its timed pieces (attention, the MoE layer's own work, the
expert GEMMs, the head, the optimizer: :mod:`moesaic.sim.opmeasure`), and a real step holds
more than those: the embedding, the loss's reduction, zeroing the gradients, the training loop's
own bookkeeping (the router's loads, the metrics). On the validation's configurations a
one-process step took 15-20% more than the sum of its priced pieces (docs/simulator.md), a
time every strategy pays once per step and which the simulator missed. The difference between
the timed step and its priced pieces (:meth:`moesaic.sim.opcal.OpPrices.rest_s`) becomes one
compute task at the start of each simulated step.

What runs: the config's model, seed, data and optimizer, on one rank with one rank's batch
(``batch_size`` sequences), ``num_experts / world`` experts (at least ``top_k``: the rank's
share of the experts, whose GEMMs ``opmeasure`` timed at that count), ``dropless`` under
``vanilla`` (no communication: a world of one), ``threads`` torch threads (training's per-rank
threads), ``steps`` steps, no evaluation or checkpoint. The step time is tokens per step over
``tokens_per_s`` of each train record after the first ``skip`` (warm-up), and their median.
Torch is imported by the training job it launches, not here.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from moesaic.checks import check_positive_int

__all__ = ["STEP_SKIP", "STEP_STEPS", "measure_step", "median_step_s"]

STEP_STEPS = 10  # steps trained; the median of those after the first STEP_SKIP
STEP_SKIP = 4


def step_config(cfg: Any, *, world: int, threads: int, steps: int, run_dir: Path) -> Any:
    """``cfg`` (a ``TrainConfig``) as the one-process run of one rank's share: the same model
    (its rank's experts, at least ``top_k``), seed, data, optimizer and per-rank batch,
    ``dropless`` under ``vanilla`` with ``threads`` threads, nothing but metrics written."""
    from moesaic.train.config import TrainConfig

    d = cfg.to_dict()
    moe = d["model"]["moe"]
    share = max(moe["num_experts"] // world, moe["top_k"])
    moe.update(num_experts=share, dispatcher="dropless", capacity_factor=None, options={})
    d.update(
        nproc=1,
        ep=1,
        steps=steps,
        schedule="vanilla",
        pipeline_degree=1,
        ar_chunk="auto",
        trace=None,
        trace_png=None,
        eval_every=0,
        ckpt_every=0,
        save_final=False,
        run_dir=str(run_dir),
        resume=False,
        max_restarts=0,
        progress=False,
        fault_kill_rank=None,
        fault_kill_step=None,
        cluster=None,
        auto_domains=False,
        emulate=None,
        plan=None,
        threads=threads,
    )
    return TrainConfig.from_dict(d)


def median_step_s(path: str | Path, tokens_per_step: int, *, skip: int) -> float:
    """The median step time (seconds) of a run's ``metrics.jsonl`` at ``path``:
    ``tokens_per_step / tokens_per_s`` of each train record after the first ``skip`` (all of
    them when there are no more)."""
    check_positive_int("tokens_per_step", tokens_per_step)
    path = Path(path)
    rates = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if isinstance(row, dict) and row.get("kind") == "train" and row.get("tokens_per_s"):
            rates.append(float(row["tokens_per_s"]))
    if not rates:
        raise ValueError(
            f"{path}: no train record with tokens_per_s (a moesaic train metrics.jsonl)"
        )
    kept = rates[skip:] or rates
    return statistics.median(tokens_per_step / r for r in kept)


def measure_step(
    path: str | Path,
    *,
    world: int,
    threads: int,
    steps: int = STEP_STEPS,
    skip: int = STEP_SKIP,
) -> float | None:
    """One rank's median step time (seconds) of the training config at ``path`` at ``world``
    ranks (module docstring); None when ``path`` is a model file (no data to train on)."""
    from moesaic.sim.model import ModelSpec, load_model
    from moesaic.train.launch import launch

    check_positive_int("world", world)
    check_positive_int("threads", threads)
    check_positive_int("steps", steps)
    if not 0 <= skip < steps:
        raise ValueError(f"skip ({skip}) must be >= 0 and < steps ({steps})")
    cfg = load_model(path)
    if isinstance(cfg, ModelSpec):  # a model file: no data, no job to time
        return None
    with tempfile.TemporaryDirectory(prefix="moesaic-step-") as tmp:
        run = step_config(cfg, world=world, threads=threads, steps=steps, run_dir=Path(tmp) / "run")
        launch(run)
        tokens = run.batch_size * run.model.seq_len
        return median_step_s(Path(tmp) / "run" / "metrics.jsonl", tokens, skip=skip)
