"""``moesaic train --plan auto``: rank 0 plans at the start of the run, every rank trains its pick.

Rank 0 calls the planner (:func:`moesaic.planning.planner.plan_runs`) on the run's cluster
(``--cluster``) and model (the run's config as the simulator's ``ModelSpec``) with a profile of
rank 0's machine measured first (a quick calibration: the matmul rates and the per-op overhead,
about a second, ``measure.machine.profile_here``) and the job's routing (its router on its data
for its first steps, in one process: ``python -m moesaic.train.routing_run`` on a training config
written from the run's, with its data, seed and optimizer schedule), and takes the ranking's
first entry, as ``moesaic plan --json --measure-routing`` would rank them.

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


# The run's keys that make its first steps' routing (``train.routing_run`` trains them): the data,
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


def _note(line: str) -> None:
    print(f"moesaic train: --plan auto: {line}", file=sys.stderr, flush=True)


def _measured_routing(model: Path, world: int, timeout_s: float) -> Any:
    """The job's routing (``train.routing_run``, a training run of its own: launched from this
    worker without the worker's torchrun variables, in a process group killed past
    ``timeout_s``), or None with a note when it runs out or fails (the plan then prices the
    routing prior)."""
    from moesaic.sim.profile import RoutingLoads

    cmd = [sys.executable, "-m", "moesaic.train.routing_run", str(model), "--world", str(world)]
    # this moesaic, wherever the worker found it (installed or on a path of its own)
    here = str(Path(__file__).resolve().parents[2])  # the directory holding moesaic/
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _WORKER_ENV and not k.startswith("TORCHELASTIC_")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    try:
        proc = run_group(cmd, env=env, timeout_s=timeout_s)
    except subprocess.TimeoutExpired:
        _note(
            f"measuring the job's routing took over {timeout_s:.0f} s; planning with the "
            "routing prior"
        )
        return None
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
        _note(f"--measure-routing failed ({lines[-1].strip()[-300:]}): routing from the prior")
        return None
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return None if data is None else RoutingLoads(**data)


def _plan_here(cfg: TrainConfig, all_reduce: str) -> list[dict[str, Any]]:
    """The ranking of ``cfg`` on this machine (rank 0), as the plan file's entries.

    The routing measurement gets ``timeout_s / 4`` (the other ranks wait in a collective
    meanwhile: a large model may take long or not fit, and then the planner prices the routing
    prior with a note); the planning itself runs here, in seconds."""
    from moesaic.cluster.spec import ClusterSpec
    from moesaic.measure.machine import profile_here
    from moesaic.planning.loads import model_loads
    from moesaic.planning.plan_memory import apply_memory
    from moesaic.planning.planner import plan_runs
    from moesaic.train.model_files import load_model_spec
    from moesaic.train.plan import PLAN_SHAPE_FIELDS, made_for, ranking_json

    assert cfg.cluster is not None  # internal: TrainConfig requires it with plan "auto"
    spec = ClusterSpec.from_toml(cfg.cluster)
    profile = profile_here("measured here by moesaic train --plan auto (matmul and op overhead)")
    with tempfile.TemporaryDirectory(prefix="moesaic-plan-") as tmp:
        path = Path(tmp) / "model.toml"
        path.write_text(model_toml(cfg))
        planned = load_model_spec(path)
        routing = _measured_routing(path, spec.world_size, cfg.timeout_s / 4)
    if routing is not None:
        profile = dataclasses.replace(profile, routing=routing)
    model, prior = model_loads(planned, note=_note, profile=profile, world=spec.world_size)
    ranking = plan_runs(spec, model, profile, all_reduce=all_reduce, routing_prior=prior)
    job = made_for(
        world_size=spec.world_size,
        cluster=spec.name,
        shape={name: getattr(model, name) for name in PLAN_SHAPE_FIELDS},
        profile=f"{profile.source} ({profile.flops_per_s:.3g} FLOP/s)",
    )
    fit = apply_memory(planned, None, ranking, spec.world_size, _note)
    ranking = ranking if fit is None else fit.plan
    for name, why in ranking.skipped:
        _note(f"skipped {name}: {why}")
    return ranking_json(ranking, job, () if fit is None else fit.peaks)


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
    except Exception as exc:
        return json.dumps({"error": f"--plan auto: {type(exc).__name__}: {exc}"})


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
