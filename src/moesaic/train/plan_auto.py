"""``moesaic train --plan auto``: rank 0 plans at the start of the run, every rank trains its pick.

Rank 0 runs ``moesaic plan --json --measure-routing`` on the run's cluster (``--cluster``) and
model (a training config written from the run's, with its data, seed and optimizer schedule;
``moesaic.train.model_files.load_model`` reads it) with no profile, so the planner measures rank 0's
machine first (a quick calibration: the matmul rates and the per-op overhead, about a second)
and the job's routing (its router on its data for its first steps, in one process:
``sim.routecal``), and takes the ranking's first entry. The planner is the
simulator's (``moesaic.planning.planner``), which reads training configs and so sits above this
package: it runs as the ``moesaic plan`` command in a child process, its interface the
documented JSON, rather than as an import that would close a circle between the two packages.

Every rank receives rank 0's entry (two all-gathers: its length, then its bytes; an error on
rank 0 reaches every rank the same way) and applies it (:func:`apply_entry`) before anything is
built, as ``--domains auto`` shares rank 0's measurement. Rank 0 logs the pick and its reason and
writes the whole ranking to ``<run_dir>/plan.json``; a resumed or restarted run trains the
combination recorded there instead of planning again, so that its checkpoints keep their
strategy and options.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from moesaic.comm.agree import check_ranks_agree
from moesaic.config import MoEConfig
from moesaic.strategy_options import StrategyOptions
from moesaic.train.config import TrainConfig
from moesaic.train.plan import AUTO, check_entry, plan_record, plan_settings, strategy_options

__all__ = ["PLAN_FILE", "apply_entry", "model_toml", "resolve_auto_plan"]

# Where rank 0 records the ranking, in the run directory.
PLAN_FILE = "plan.json"


def _toml_value(value: Any) -> str | None:
    """``value`` as TOML (None: not representable, left out: None, tables, non-finite)."""
    if isinstance(value, (bool, int, str)):
        return json.dumps(value)
    if isinstance(value, float):
        return json.dumps(value) if math.isfinite(value) else None
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in value
    ):
        return json.dumps(list(value))
    return None


# The run's keys that make its first steps' routing (``sim.routecal`` trains them): the data,
# the seed and the optimizer's schedule.
_ROUTING_KEYS = (
    "seed",
    "data",
    "data_max_bytes",
    "val_fraction",
    "steps",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "grad_clip",
)
# How ``moesaic plan`` starts its notes on stderr (logged again by rank 0).
_PLAN_NOTE = "moesaic plan: "
# What a nested launch must not inherit from this worker (torchrun's own variables).
_WORKER_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def model_toml(cfg: TrainConfig) -> str:
    """A training config of ``cfg``'s batch, model and what makes its routing (no strategy
    options, no deadline: what the planner chooses or does not read), as ``moesaic plan
    --model`` reads one."""
    lines = [f"batch_size = {cfg.batch_size}"]
    for key in _ROUTING_KEYS:
        text = _toml_value(getattr(cfg, key))
        if text is not None:
            lines.append(f"{key} = {text}")
    lines += ["", "[model]"]
    model = cfg.model.to_dict()
    moe = model.pop("moe")
    skip_moe = {"options", "dispatcher", "collective_timeout_s"}
    for table, values, skip in (("", model, set()), ("[model.moe]", moe, skip_moe)):
        if table:
            lines += ["", table]
        for key, value in values.items():
            text = None if key in skip else _toml_value(value)
            if text is not None:
                lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def _plan_here(cfg: TrainConfig, all_reduce: str) -> list[dict[str, Any]]:
    """``moesaic plan --json`` of ``cfg`` on this machine (rank 0): the ranking.

    Within ``timeout_s / 2`` in all (the other ranks wait in a collective meanwhile): first with
    ``--measure-routing`` for up to half of it (the job's model at EP 1 in one process: a
    large model may take long or not fit, and then the planner prices uniform routing with a
    note); if that runs out, the process group it started is killed and the plan runs again
    without it."""
    assert cfg.cluster is not None  # internal: TrainConfig requires it with plan "auto"
    budget = cfg.timeout_s / 2
    with tempfile.TemporaryDirectory(prefix="moesaic-plan-") as tmp:
        model = Path(tmp) / "model.toml"
        model.write_text(model_toml(cfg))
        cmd = [sys.executable, "-m", "moesaic", "plan", "--cluster", cfg.cluster]
        cmd += ["--model", str(model), "--json", "--all-reduce", all_reduce]
        # this moesaic, wherever the worker found it (installed or on a path of its own)
        here = str(Path(__file__).resolve().parents[2])  # the directory holding moesaic/
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in _WORKER_ENV and not k.startswith("TORCHELASTIC_")
        }
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        t0 = time.monotonic()
        try:
            proc = run_group([*cmd, "--measure-routing"], env=env, timeout_s=budget / 2)
        except subprocess.TimeoutExpired:
            print(
                f"moesaic train: --plan auto: measuring the job's routing took over "
                f"{budget / 2:.0f} s; planning with uniform routing",
                file=sys.stderr,
                flush=True,
            )
            proc = run_group(cmd, env=env, timeout_s=budget - (time.monotonic() - t0))
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
        raise ValueError(f"--plan auto: moesaic plan failed: {lines[-1]}")
    for line in proc.stderr.splitlines():  # its notes: the routing it priced, extrapolations
        if line.startswith(_PLAN_NOTE):
            note = line.removeprefix(_PLAN_NOTE)
            print(f"moesaic train: --plan auto: {note}", file=sys.stderr, flush=True)
    return json.loads(proc.stdout)


def run_group(
    cmd: list[str], *, env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess:
    """``cmd`` in a process group of its own, its output captured; past ``timeout_s`` the
    whole group is killed (what it started too: a routing run's launcher and worker) and
    ``subprocess.TimeoutExpired`` raised."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _recorded(cfg: TrainConfig) -> dict[str, Any] | None:
    """The entry a resumed or restarted run recorded, if any."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    path = Path(cfg.run_dir) / PLAN_FILE
    if not (cfg.resume or restarted) or not path.exists():
        return None
    return json.loads(path.read_text())["ranking"][0]


def _choose(cfg: TrainConfig, all_reduce: str) -> str:
    """Rank 0: the chosen entry as JSON (``{"entry": ...}`` or ``{"error": ...}``)."""
    try:
        entry = _recorded(cfg)
        if entry is not None:
            print(
                f"moesaic train: --plan auto: resuming with the plan in {cfg.run_dir}/{PLAN_FILE}",
                file=sys.stderr,
                flush=True,
            )
            return json.dumps({"entry": entry})
        ranking = _plan_here(cfg, all_reduce)
        entry = check_entry(ranking[0], "--plan auto")
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        record = {"source": AUTO, "cluster": cfg.cluster, "ranking": ranking}
        (Path(cfg.run_dir) / PLAN_FILE).write_text(json.dumps(record, indent=1))
        print(
            f"moesaic train: --plan auto on {cfg.cluster}: {entry.get('reason', '')} "
            f"(ranking in {cfg.run_dir}/{PLAN_FILE})",
            file=sys.stderr,
            flush=True,
        )
        return json.dumps({"entry": entry})
    except (OSError, ValueError, subprocess.TimeoutExpired, KeyError, IndexError) as exc:
        return json.dumps({"error": str(exc)})


def _share(text: str, layout, device) -> str:
    """Rank 0's ``text`` on every rank (other ranks pass anything)."""
    data = text.encode() if layout.rank == 0 else b""
    n_t = torch.tensor([[len(data)]], dtype=torch.int64, device=device)
    n = int(layout.world.all_gather_dim0(n_t, "all_gather of the plan's length")[0, 0])
    buf = torch.zeros((1, max(n, 1)), dtype=torch.uint8, device=device)
    if layout.rank == 0 and n:
        buf[0, :n] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = layout.world.all_gather_dim0(buf, "all_gather of the plan")
    return bytes(out[0, :n].cpu().tolist()).decode()


def apply_entry(cfg: TrainConfig, entry: dict[str, Any]) -> TrainConfig:
    """``cfg`` training ``entry``'s strategy, schedule and options (validated again)."""
    settings = plan_settings(check_entry(entry, "--plan auto"))
    dispatcher = settings["model.moe.dispatcher"]
    options = strategy_options(settings)
    if dispatcher == cfg.model.moe.dispatcher:  # what the plan leaves unset stays the config's
        options = {**cfg.model.moe.options_as(StrategyOptions).to_dict(), **options}
    moe: MoEConfig = dataclasses.replace(cfg.model.moe, dispatcher=dispatcher, options=options)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, moe=moe),
        schedule=settings["schedule"],
        pipeline_degree=settings["pipeline_degree"],
        ar_chunk=settings.get("ar_chunk", "auto"),  # auto: flowmoe tunes it, moe-only one chunk
    )


def resolve_auto_plan(cfg: TrainConfig, layout, device) -> TrainConfig:
    """``--plan auto``: ``cfg`` with rank 0's pick (a collective; every rank gets the same);
    other runs unchanged.

    Raises:
        ValueError: on every rank, when rank 0 could not plan (its reason), or the pick does
            not fit the run (``TrainConfig.check_world``).
    """
    if cfg.plan != AUTO:
        return cfg
    all_reduce = "best" if torch.device(device).type == "cuda" else "ring"  # NCCL vs gloo
    text = _choose(cfg, all_reduce) if layout.rank == 0 else ""
    shared = json.loads(_share(text, layout, device))
    if "error" in shared:
        raise ValueError(shared["error"])
    cfg = apply_entry(cfg, shared["entry"])
    cfg.check_world(layout.world_size)
    # Every rank trains the same pick: compared, as the configuration was before it.
    check_ranks_agree(plan_record(cfg) or {}, timeout_s=cfg.timeout_s, what="--plan auto's pick")
    return cfg
