"""Checkpoints through torch.distributed.checkpoint (DCP): atomic, resumable, EP-resharding.

Layout of ``RUN_DIR/checkpoints/``::

    step_00000400/       one DCP checkpoint (.metadata, __<rank>_0.distcp) plus meta.json
    latest               the name of the newest complete checkpoint (replaced atomically)

Keys of the DCP state dict:

* ``model.<param>``: replicated parameters (equal on every rank; DCP writes one copy);
* ``model.<layer>.experts.<w>.<g>``: global expert g's slice of an expert parameter, so a rank
  saves and loads exactly the experts it holds, whatever the EP size was at save time;
* ``optim.<same key>.<state>``: AdamW's ``exp_avg`` / ``exp_avg_sq`` (per expert for experts)
  and ``optim.<param>.step``;
* ``train.step``, ``train.consumed`` (data position), ``rng.<rank>`` (torch RNG states).

Atomicity: ranks write into ``step_N.tmp``; rank 0 then adds meta.json, renames the directory
to ``step_N`` and replaces ``latest``. A crash at any point leaves the previous checkpoint and
``latest`` intact (a stale ``.tmp`` is removed by the next save).
"""

from __future__ import annotations

import json
import os
import shutil
from operator import attrgetter
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from moesaic.layer import is_expert_param
from moesaic.models.gpt import MoEGPT, MoEGPTConfig

FORMAT_VERSION = 1
# Fields that fix tensor shapes or routing; the others (loss weights, dispatcher, timeouts) may
# change on resume.
SHAPE_FIELDS = (
    "vocab_size",
    "seq_len",
    "d_model",
    "n_layers",
    "n_heads",
    "dense_layers",
    "dense_hidden",
    "moe.num_experts",
    "moe.top_k",
    "moe.ffn_hidden_size",
    "moe.activation",
)


def _expert_first_id(model: nn.Module, name: str) -> int:
    return model.get_submodule(name.rsplit(".", 1)[0]).first_expert


def tensor_entries(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """``{key: tensor}`` views of this rank's parameters (and optimizer states), see above."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        if is_expert_param(p):
            g0 = _expert_first_id(model, name)
            for i in range(p.shape[0]):
                out[f"model.{name}.{g0 + i}"] = p.data[i]
                for k, v in state.items():
                    if torch.is_tensor(v) and v.shape == p.shape:
                        out[f"optim.{name}.{g0 + i}.{k}"] = v[i]
        else:
            out[f"model.{name}"] = p.data
            for k, v in state.items():
                if torch.is_tensor(v) and v.shape == p.shape:
                    out[f"optim.{name}.{k}"] = v
        for k, v in state.items():
            if torch.is_tensor(v) and v.shape != p.shape:
                out[f"optim.{name}.{k}"] = v  # AdamW's scalar step
    return out


def init_optimizer_state(optimizer: torch.optim.AdamW) -> None:
    """Allocate AdamW's state (zeros) so that a checkpoint can be loaded into it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state.get(p):
                optimizer.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _barrier(layout, what: str, device: torch.device) -> None:
    # An all-reduce through EPGroup rather than dist.barrier: it waits with the deadline.
    layout.world.all_reduce(torch.zeros(1, device=device), what=what)


def save_checkpoint(
    run_dir: str,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    consumed: int,
    meta: dict,
    layout,
    keep: int,
) -> Path:
    """Write checkpoint ``step`` atomically (a collective: every rank calls it)."""
    root = Path(run_dir) / "checkpoints"
    name = f"step_{step:08d}"
    tmp, final = root / f"{name}.tmp", root / name
    if layout.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    device = next(model.parameters()).device
    _barrier(layout, "barrier before checkpoint save", device)
    state = tensor_entries(model, optimizer)
    state["train.step"] = torch.tensor(step, dtype=torch.int64)
    state["train.consumed"] = torch.tensor(consumed, dtype=torch.int64)
    state[f"rng.{layout.rank}"] = torch.get_rng_state()
    dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    if layout.rank == 0:
        info = {**meta, "format": FORMAT_VERSION, "step": step, "consumed": consumed}
        _write_atomic(tmp / "meta.json", json.dumps(info, indent=1))
        # The same step may exist from an attempt that died before updating ``latest`` (so it
        # is not the checkpoint ``latest`` names): move it aside, never delete it first.
        trash = root / f"{name}.old"
        if final.exists():
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
        os.rename(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(trash, ignore_errors=True)
        _write_atomic(root / "latest", name + "\n")
        # Only older steps than this one are pruned (never the one ``latest`` now names).
        done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.suffix)
        done = [p for p in done if p.name <= name]
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(layout, "barrier after checkpoint save", device)
    return final


def latest_checkpoint(run_dir: str) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` (via ``latest``), or None if there is none."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not name or not path.is_dir():
        raise ValueError(f"checkpoint pointer {pointer} names {name!r}, which is not a directory")
    return path


def already_has_checkpoints(run_dir: str, path: Path) -> str:
    """The message for a fresh run pointed at a run directory that has checkpoints."""
    return (
        f"run_dir {run_dir} already holds checkpoints (latest: {path.name}); pass --resume "
        "to continue that run, or choose another --run-dir"
    )


def read_checkpoint_meta(path: Path, model_cfg: MoEGPTConfig | None = None) -> dict:
    """Check that ``path`` is a complete, readable checkpoint (matching ``model_cfg``).

    Returns its meta.json. Raises ValueError naming what is wrong: a missing or unreadable file,
    a data file shorter than the metadata says, or a model shape that differs.
    """
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        saved = MoEGPTConfig.from_dict(meta["model"])
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"checkpoint {path} is corrupt: cannot read {meta_path.name} ({exc})"
        ) from exc
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format {meta.get('format')!r}; this moesaic reads "
            f"format {FORMAT_VERSION}"
        )
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # DCP raises pickle/EOF/OS errors for a damaged .metadata
        raise ValueError(
            f"checkpoint {path} is corrupt: cannot read its DCP .metadata ({exc})"
        ) from exc
    for info in (md.storage_data or {}).values():
        f = path / info.relative_path
        if not f.is_file() or f.stat().st_size < info.offset + info.length:
            raise ValueError(
                f"checkpoint {path} is corrupt: data file {f.name} is missing or short"
            )
    if model_cfg is not None:
        for name in SHAPE_FIELDS:
            old, new = attrgetter(name)(saved), attrgetter(name)(model_cfg)
            if old != new:
                raise ValueError(
                    f"checkpoint {path} is incompatible: model {name} is {old} in the "
                    f"checkpoint but {new} in this run"
                )
    return meta


def load_checkpoint(
    path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int
) -> tuple[int, int]:
    """Load ``path`` into this rank's model (and optimizer); returns (step, consumed).

    Works at any EP size: each rank reads the per-expert keys of the experts it holds.
    """
    if optimizer is not None:
        init_optimizer_state(optimizer)
    views = tensor_entries(model, optimizer)
    md = dcp.FileSystemReader(str(path)).read_metadata()
    missing = sorted(k for k in views if k not in md.state_dict_metadata)
    if missing:
        raise ValueError(
            f"checkpoint {path} is incompatible: it lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )
    # Load into fresh tensors, then copy: DCP never writes through our views.
    state = {k: v.detach().clone() for k, v in views.items()}
    state["train.step"] = torch.zeros((), dtype=torch.int64)
    state["train.consumed"] = torch.zeros((), dtype=torch.int64)
    rng_key = f"rng.{rank}"
    if rng_key in md.state_dict_metadata:
        state[rng_key] = torch.get_rng_state()
    try:
        with warnings.catch_warnings():
            # "assuming the intent is to load in a single process": yes, in `generate`.
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except Exception as exc:  # a damaged data file surfaces as one of many error types
        raise ValueError(f"checkpoint {path} could not be loaded: {str(exc)[:300]}") from exc
    with torch.no_grad():
        for k, v in views.items():
            if v.shape != state[k].shape:
                raise ValueError(
                    f"checkpoint {path} is incompatible: {k} has shape {tuple(state[k].shape)}, "
                    f"this model needs {tuple(v.shape)}"
                )
            v.copy_(state[k])
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
    return int(state["train.step"]), int(state["train.consumed"])


def load_model_for_inference(path: Path) -> tuple[MoEGPT, dict]:
    """The whole model (all experts, one process) from a checkpoint of any EP size."""
    meta = read_checkpoint_meta(path)
    model = MoEGPT(MoEGPTConfig.from_dict(meta["model"]))
    load_checkpoint(path, model=model, optimizer=None, rank=0)
    model.eval()
    return model, meta
