"""Checkpoints through torch.distributed.checkpoint (DCP): atomic, resumable, EP-resharding.

Layout of ``RUN_DIR/checkpoints/``::

    step_00000400/       one DCP checkpoint (.metadata, __<rank>_0.distcp), meta.json and
                         manifest.json (size and sha256 of every other file)
    latest               the name of the newest complete checkpoint (replaced atomically)

Keys of the DCP state dict:

* ``model.<param>``: replicated parameters (equal on every rank; DCP writes one copy), and the
  same for persistent buffers (the routers' ``score_bias``: replicated, so any EP size loads
  it whole; one missing from an older checkpoint keeps its initial value);
* ``model.<layer>.experts.<w>.<g>``: global expert g's slice of an expert parameter, so a rank
  saves and loads exactly the experts it holds, whatever the EP size was at save time;
* ``optim.<same key>.<state>``: AdamW's ``exp_avg`` / ``exp_avg_sq`` (per expert for experts)
  and ``optim.<param>.step``;
* ``train.step``, ``train.consumed`` (data position), ``rng.<rank>`` (torch RNG states).

Atomicity: ranks write into ``step_N.tmp``; rank 0 then adds meta.json and manifest.json,
renames the directory to ``step_N`` and replaces ``latest``. A crash at any point leaves the
previous checkpoint and ``latest`` intact; every leftover ``*.tmp`` / ``*.old`` is removed before
the next save, so a crashed save does not keep the room the next one needs.

Integrity: :func:`read_checkpoint_meta` checks every file against manifest.json, so a damaged
checkpoint is refused with one line naming the file, by ``--resume`` and by ``generate``. A save
refuses non-finite parameters or optimizer states (the ranks agree on it first), so a diverged
run never replaces or prunes the last good checkpoint.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import warnings
from operator import attrgetter
from pathlib import Path
from types import ModuleType
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from moesaic.layer import is_expert_param
from moesaic.models.config import with_legacy_architecture
from moesaic.models.gpt import MoEGPT, MoEGPTConfig
from moesaic.strategies.registry import get_strategy
from moesaic.train.errors import (
    CheckpointError,
    checkpoint_cause,
    describe,
    first_failure,
    is_checkpoint_exception,
)

# 2: manifest.json with the sha256 of every file. Format-1 checkpoints (no manifest) still load,
# with the size check only.
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
MANIFEST = "manifest.json"
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
    "moe_layer_freq",
    "norm",
    "positions",
    "moe.num_experts",
    "moe.top_k",
    "moe.ffn_hidden_size",
    "moe.activation",
    "moe.num_shared_experts",
    "moe.shared_expert_hidden_size",
    "moe.shared_expert_gate",
)


def _dcp() -> ModuleType:
    """``torch.distributed.checkpoint``, imported when a checkpoint is read or written: it
    brings DTensor and sympy (about 1 s of a 2-core machine's CPU), which the launcher and a
    run that neither saves nor resumes need not pay at start-up."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _expert_first_id(model: nn.Module, name: str) -> int:
    # An MoE layer's first_expert (an int; nn.Module.__getattr__ is typed Tensor | Module).
    return cast(int, model.get_submodule(name.rsplit(".", 1)[0]).first_expert)


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
    out.update(buffer_entries(model))
    return out


def buffer_entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{model.<buffer>: tensor}`` of the persistent buffers (all replicated)."""
    persistent = set(model.state_dict(keep_vars=True))
    return {f"model.{n}": b for n, b in model.named_buffers() if n in persistent}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
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


def _nonfinite_keys(state: dict[str, torch.Tensor]) -> list[str]:
    return [
        k
        for k, v in state.items()
        if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all())
    ]


def _agree_finite(layout, state: dict, step: int, root: Path, device: torch.device) -> None:
    """Raise CheckpointError on every rank if any rank's state holds NaN or inf.

    Doubles as the barrier before the save: one all-reduce of each rank's count.
    """
    bad = _nonfinite_keys(state)
    counts_P = torch.zeros(layout.world_size, dtype=torch.float64, device=device)
    counts_P[layout.rank] = len(bad)
    layout.world.all_reduce(counts_P, what="barrier before checkpoint save (finite check)")
    if not bool(counts_P.any()):
        return
    per_rank = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(counts_P.tolist()) if c)
    example = f", e.g. {bad[0]}" if bad else ""
    latest = root / "latest"
    kept = latest.read_text().strip() if latest.is_file() else "none yet"
    raise CheckpointError(
        f"refusing to save checkpoint step {step}: {int(counts_P.sum())} tensors hold NaN or "
        f"inf ({per_rank}{example}); the last good checkpoint ({kept}) is kept"
    )


def clean_stale(root: Path) -> list[Path]:
    """Remove what crashed saves left in ``root`` (``*.tmp``, ``*.old``); returns them.

    Call only while holding the run directory (the run lock): a concurrent save's ``.tmp``
    would be removed too.
    """
    removed = []
    for p in sorted(root.glob("*.tmp")) + sorted(root.glob("step_*.old")):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def _sha256(path: Path) -> str:
    # hashlib.file_digest is Python 3.11+; we support 3.10.
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(ckpt: Path) -> None:
    """Record the size and sha256 of every file of ``ckpt`` in its manifest.json."""
    files = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(ckpt.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    _write_atomic(ckpt / MANIFEST, json.dumps({"algorithm": "sha256", "files": files}, indent=1))


def verify_manifest(ckpt: Path) -> None:
    """Raise CheckpointError unless every file listed in manifest.json is intact."""
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        items = [(str(n), int(e["size"]), str(e["sha256"])) for n, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupt: cannot read {MANIFEST} ({describe(exc)})"
        ) from None
    for name, size, digest in items:
        f = ckpt / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: file {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {ckpt} is corrupt: file {name} has {f.stat().st_size} bytes, "
                f"{MANIFEST} says {size}"
            )
        if _sha256(f) != digest:
            raise CheckpointError(
                f"checkpoint {ckpt} is corrupt: file {name} does not match its sha256 in "
                f"{MANIFEST} (damaged after it was written)"
            )


def _complete(root: Path, upto: str) -> list[Path]:
    """Finished checkpoints up to step name ``upto``, oldest first (those with a manifest)."""
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.suffix and p.name <= upto]
    return sorted(p for p in done if (p / MANIFEST).is_file())


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
    check_finite: bool = True,
) -> Path:
    """Write checkpoint ``step`` atomically (a collective: every rank calls it).

    Raises:
        CheckpointError: on every rank, when ``check_finite`` and some rank's parameters or
            optimizer states hold NaN or inf (nothing is written, nothing pruned); on the rank
            that failed, when writing failed (a full disk): the message names the cause.
    """
    root = Path(run_dir) / "checkpoints"
    name = f"step_{step:08d}"
    tmp, final = root / f"{name}.tmp", root / name
    if layout.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create {root}: {describe(exc)}") from None
        clean_stale(root)
    device = next(model.parameters()).device
    state = tensor_entries(model, optimizer)
    if check_finite:
        _agree_finite(layout, state, step, root, device)
    else:
        _barrier(layout, "barrier before checkpoint save", device)
    state["train.step"] = torch.tensor(step, dtype=torch.int64)
    state["train.consumed"] = torch.tensor(consumed, dtype=torch.int64)
    state[f"rng.{layout.rank}"] = torch.get_rng_state()
    try:
        with warnings.catch_warnings():
            # "assuming the intent is to save in a single process": yes, a one-process run.
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            _dcp().save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        if layout.rank == 0:
            _publish(root, tmp, final, {**meta, "step": step, "consumed": consumed}, keep)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if not (isinstance(exc, Exception) or is_checkpoint_exception(exc)):
            raise  # KeyboardInterrupt, SystemExit
        cause = _save_failure_cause(exc, root)  # before the room is given back
        if layout.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # give the room back
        raise CheckpointError(f"saving checkpoint {name} in {root} failed: {cause}") from None
    _barrier(layout, "barrier after checkpoint save", device)
    return final


# Below this many free bytes the file system of a failed save counts as full.
_FULL_DISK_BYTES = 1 << 20


def _save_failure_cause(exc: BaseException, root: Path) -> str:
    """One line for a failed save, naming a full disk however the writer reported it.

    A full disk surfaces as ``ENOSPC`` from a plain write, but torch's zip writer reports the
    same short write as ``[enforce fail at inline_container.cc] unexpected pos ...`` and the
    errno is lost; a save that failed with almost no room left on ``root``'s file system failed
    for lack of room whatever the message said.
    """
    found = first_failure(exc) if is_checkpoint_exception(exc) else (None, exc)
    if found is None:
        return checkpoint_cause(exc)
    rank, inner = found
    where = "" if rank is None else f" (on rank {rank})"
    if not isinstance(inner, OSError) and _free_bytes(root) < _FULL_DISK_BYTES:
        return os.strerror(errno.ENOSPC) + where
    return describe(inner) + where


def _free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system (large if unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


def _publish(root: Path, tmp: Path, final: Path, info: dict, keep: int) -> None:
    """Rank 0: meta.json and manifest into ``tmp``, rename it to ``final``, point ``latest``."""
    _write_atomic(tmp / "meta.json", json.dumps({**info, "format": FORMAT_VERSION}, indent=1))
    write_manifest(tmp)
    # The same step may exist from an attempt that died before updating ``latest`` (so it
    # is not the checkpoint ``latest`` names): move it aside, never delete it first.
    trash = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(trash, ignore_errors=True)
    _write_atomic(root / "latest", final.name + "\n")
    # Prune only finished (manifest-bearing, hence finite) checkpoints older than this one:
    # never the one ``latest`` now names, never one a later step of another attempt wrote.
    for old in _complete(root, final.name)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: str) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` (via ``latest``), or None if there is none."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not name or not path.is_dir():
        raise CheckpointError(
            f"checkpoint pointer {pointer} names {name!r}, which is not a directory"
        )
    return path


def already_has_checkpoints(run_dir: str, path: Path) -> str:
    """The message for a fresh run pointed at a run directory that has checkpoints."""
    return (
        f"run_dir {run_dir} already holds checkpoints (latest: {path.name}); pass --resume "
        "to continue that run, or choose another --run-dir"
    )


def check_resume_step(path: Path, meta: dict, steps: int) -> None:
    """Raise ValueError when checkpoint ``path`` (at ``meta['step']``) is past ``steps``."""
    step = int(meta["step"])
    if step > steps:
        raise ValueError(
            f"--resume: checkpoint {path.name} is at step {step}, past --steps {steps}; "
            f"pass --steps greater than {step} to train further"
        )


def saved_model_config(meta: dict) -> MoEGPTConfig:
    """The model a checkpoint's ``meta`` describes (one saved before ``norm`` and ``positions``
    existed used LayerNorm and learned positions: ``with_legacy_architecture``)."""
    return MoEGPTConfig.from_dict(with_legacy_architecture(meta["model"]))


def read_checkpoint_meta(
    path: Path, model_cfg: MoEGPTConfig | None = None, *, verify: bool = True
) -> dict:
    """Check that ``path`` is a complete, intact checkpoint (matching ``model_cfg``).

    Returns its meta.json. Raises CheckpointError (a ValueError) naming what is wrong: a missing
    or unreadable file, a file whose size or sha256 differs from manifest.json (when ``verify``),
    a data file shorter than the metadata says, or a model shape that differs.
    """
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        saved = saved_model_config(meta)
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} is corrupt: cannot read {meta_path.name} ({describe(exc)})"
        ) from None
    fmt = meta.get("format")
    if fmt not in READABLE_FORMATS:
        raise CheckpointError(
            f"checkpoint {path} has format {fmt!r}; this moesaic reads formats "
            f"{', '.join(map(str, READABLE_FORMATS))}"
        )
    if verify and fmt >= 2:
        verify_manifest(path)
    try:
        md = _dcp().FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # DCP raises pickle/EOF/OS errors for a damaged .metadata
        raise CheckpointError(
            f"checkpoint {path} is corrupt: cannot read its DCP .metadata ({describe(exc)})"
        ) from None
    for info in (md.storage_data or {}).values():
        f = path / info.relative_path
        if not f.is_file() or f.stat().st_size < info.offset + info.length:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: data file {f.name} is missing or short"
            )
    if model_cfg is not None:
        for name in SHAPE_FIELDS:
            old, new = attrgetter(name)(saved), attrgetter(name)(model_cfg)
            if old != new:
                raise CheckpointError(
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
    md = _dcp().FileSystemReader(str(path)).read_metadata()
    for key in buffer_entries(model):  # a buffer the checkpoint predates keeps its init
        if key not in md.state_dict_metadata:
            views.pop(key)
    missing = sorted(k for k in views if k not in md.state_dict_metadata)
    if missing:
        raise CheckpointError(
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
            _dcp().load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except BaseException as exc:  # a damaged file: many error types, CheckpointException too
        if not (isinstance(exc, Exception) or is_checkpoint_exception(exc)):
            raise  # KeyboardInterrupt, SystemExit
        cause = checkpoint_cause(exc) if is_checkpoint_exception(exc) else describe(exc)
        raise CheckpointError(f"checkpoint {path} could not be loaded: {cause}") from None
    with torch.no_grad():
        for k, v in views.items():
            if v.shape != state[k].shape:
                raise CheckpointError(
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
    cfg = saved_model_config(meta)
    # One process holds every expert: the strategy says what its layers run as then.
    moe = get_strategy(cfg.moe.dispatcher).inference_config(cfg.moe)
    cfg = dataclasses.replace(cfg, moe=moe)
    model = MoEGPT(cfg) if "hf_config" not in meta else _hf_model(meta["hf_config"], cfg)
    load_checkpoint(path, model=model, optimizer=None, rank=0)
    model.eval()
    return model, meta


def _hf_model(hf_config: dict, cfg: MoEGPTConfig) -> MoEGPT:
    """The model of a ``--hf-config`` run (typed as what it stands in for: it has the
    ``forward``, ``moe_layers``, ``config`` and ``generate`` of an MoEGPT)."""
    from moesaic.train.hf_model import HFCausalLM

    return cast(MoEGPT, HFCausalLM(hf_config, cfg))
