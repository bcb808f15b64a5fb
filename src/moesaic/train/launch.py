"""Start a training run through torch's elastic launcher (the machinery behind torchrun).

``launch(cfg)`` validates what can be validated in this process (layout, data, checkpoint), so a
mistake is one clear error before any worker starts, then runs ``cfg.nproc`` workers under an
elastic agent on this node: a standalone c10d rendezvous on a free local port, and up to
``cfg.max_restarts`` restarts of the whole group when a worker dies (the workers resume from the
latest checkpoint). Several nodes: run ``torchrun ... -m moesaic.train`` on each (docs/training.md).
"""

from __future__ import annotations

import logging
import uuid

from moesaic.train.checkpoint import (
    already_has_checkpoints,
    latest_checkpoint,
    read_checkpoint_meta,
)
from moesaic.train.config import TrainConfig
from moesaic.train.data import load_splits


def _worker_entry(cfg_dict: dict) -> dict:
    # Imported in the worker, not here: the launcher never needs the training loop.
    from moesaic.train.loop import run_worker

    return run_worker(cfg_dict)


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Raise ValueError / FileNotFoundError for a run that cannot start."""
    cfg.check_world(world_size)
    load_splits(cfg.data, cfg.data_max_bytes, cfg.val_fraction, cfg.model.seq_len)
    path = latest_checkpoint(cfg.run_dir)
    if cfg.resume:
        if path is None:
            raise ValueError(f"--resume: no checkpoint in {cfg.run_dir}/checkpoints")
        read_checkpoint_meta(path, cfg.model)
    elif path is not None:
        raise ValueError(already_has_checkpoints(cfg.run_dir, path))


def launch(cfg: TrainConfig) -> dict:
    """Validate, then train with ``cfg.nproc`` local workers; returns rank 0's summary.

    Raises:
        ValueError, FileNotFoundError: the run cannot start (nothing was spawned).
        RuntimeError: a worker failed after the allowed restarts.
    """
    validate(cfg, cfg.nproc)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs rendezvous, restarts and child tracebacks; the workers print one line per
    # error themselves and rank 0 reports each resume, so keep only the agent's critical logs.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.nproc,
        run_id=f"moesaic-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"timeout": int(max(60, cfg.timeout_s))},
        max_restarts=cfg.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
    )
    try:
        results = elastic_launch(config, _worker_entry)(cfg.to_dict())
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise RuntimeError(
            f"worker rank {rank} failed (exit code {failure.exitcode}) after "
            f"{cfg.max_restarts} restart(s) allowed; its error is printed above"
        ) from None
    return results.get(0) or {}
