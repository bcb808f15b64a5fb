"""The routing a training job will see, measured before it runs: ``calibrate --model`` on a
training config trains that job's model on its own data for a few steps in one local process
and keeps the expert loads its router produced (:class:`moesaic.sim.profile.RoutingLoads`).

Why: a real job's router is far from uniform at the start of training (a byte-level model's
frequent bytes pick the same experts: the busiest expert of the validation runs got 3.4-3.8x
the mean load at 8 experts, 13.5-14.1x at 32, docs/simulator.md), and the busiest rank sets a
dropless step while a capacity factor caps it, so uniform routing ranks the strategies wrongly.

What runs: the config's model, seed, data, optimizer and learning-rate warm-up, on one rank
with the world's global batch (``batch_size x world`` sequences per step, so the updates are
the job's in expectation), ``dropless`` under ``vanilla`` (the router's demand, nothing
dropped), ``steps`` steps, no evaluation or checkpoint; the loads are those of the steps after
the first ``skip`` (:func:`moesaic.sim.model.measured_loads`), one row per MoE layer. These are
the loads of the job's first steps: a long run's router moves on (the balance loss, the
learning rate), which a few steps cannot tell.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from moesaic.checks import check_positive_int
from moesaic.config import MoEConfig
from moesaic.schedule_table import DEFAULT_SCHEDULE

__all__ = ["ROUTING_SKIP", "ROUTING_STEPS", "measure_routing"]

ROUTING_STEPS = 8  # steps trained; the loads of those after the first ROUTING_SKIP
ROUTING_SKIP = 2


def routing_config(cfg: Any, *, world: int, steps: int, run_dir: Path) -> Any:
    """``cfg`` (a ``TrainConfig``) as the one-process run that measures its routing: the same
    model, seed, data and optimizer, ``world`` ranks' sequences per step on one rank,
    the default strategy under the default schedule, nothing but metrics written."""
    from moesaic.train.config import TrainConfig

    d = cfg.to_dict()
    moe = d["model"]["moe"]
    # the default strategy (it drops no token: the loads the router gives) with its defaults
    default = {f.name: f.default for f in dataclasses.fields(MoEConfig)}["dispatcher"]
    moe.update(dispatcher=default, capacity_factor=None, options={})
    d.update(
        nproc=1,
        ep=1,
        batch_size=cfg.batch_size * world,
        steps=steps,
        schedule=DEFAULT_SCHEDULE,  # the whole batch at once (R 1)
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
        threads=None,
    )
    return TrainConfig.from_dict(d)


def measure_routing(
    path: str | Path, *, world: int, steps: int = ROUTING_STEPS, skip: int = ROUTING_SKIP
) -> Any:
    """The expert loads of the training config at ``path`` over its first ``steps`` steps
    (those after ``skip``; a job of fewer steps: all of them, after ``skip`` when it has more)
    at ``world`` ranks' global batch, as a ``RoutingLoads``; None when ``path`` is a model file
    (no data to route)."""
    from moesaic.sim.model import ModelSpec, measured_loads
    from moesaic.sim.profile import RoutingLoads
    from moesaic.train.launch import launch
    from moesaic.train.model_files import load_model

    check_positive_int("world", world)
    check_positive_int("steps", steps)
    if not 0 <= skip < steps:
        raise ValueError(f"skip ({skip}) must be >= 0 and < steps ({steps})")
    cfg = load_model(path)
    if isinstance(cfg, ModelSpec):  # a model file: no data, no router to run
        return None
    if cfg.steps < steps:  # a job shorter than the measurement: all of its steps
        steps, skip = cfg.steps, skip if skip < cfg.steps else 0
    with tempfile.TemporaryDirectory(prefix="moesaic-routing-") as tmp:
        run = routing_config(cfg, world=world, steps=steps, run_dir=Path(tmp) / "run")
        launch(run)
        loads = measured_loads(Path(tmp) / "run" / "metrics.jsonl", skip=skip)
    tokens = run.batch_size * run.model.seq_len
    source = (
        f"{Path(path).name}'s router on its data, steps {skip + 1}-{steps} of a one-process "
        f"run at {tokens} tokens per step ({world} ranks' batch)"
    )
    return RoutingLoads(loads=loads, source=source)


def main(argv: list[str] | None = None) -> int:
    """``python -m moesaic.train.routing_run CONFIG --world N``: :func:`measure_routing` of the
    training config ``CONFIG``, printed as JSON (``{"loads": ..., "source": ...}``, or null for
    a model file). ``moesaic train --plan auto`` runs it in a process group of its own, so
    that its time budget can stop the training run it launches."""
    import argparse
    import dataclasses
    import json

    p = argparse.ArgumentParser(prog="python -m moesaic.train.routing_run")
    p.add_argument("config", help="a training config (TOML)")
    p.add_argument("--world", type=int, required=True, help="ranks whose batch one step trains")
    args = p.parse_args(argv)
    routing = measure_routing(args.config, world=args.world)
    print(json.dumps(None if routing is None else dataclasses.asdict(routing)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
