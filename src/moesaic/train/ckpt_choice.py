"""Which checkpoint: finding a run's checkpoints, checking one, choosing the one to resume from.

``latest_checkpoint`` follows ``RUN_DIR/checkpoints/latest`` (which must name a ``step_<N>``
directory of the run); :func:`read_checkpoint_meta` checks a checkpoint is complete and intact
(every file against manifest.json, the data files against DCP's metadata) and that its model
shape matches the run's; a resume whose newest checkpoint is damaged goes back to the newest
intact one and says so (:func:`newest_intact_checkpoint` in one process,
:func:`choose_resume_checkpoint` as a collective, the ranks sharing the hashing). Saving and
loading are ``moesaic.train.checkpoint``'s (the layout of a checkpoint is described there).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path

import torch

from moesaic.models.config import MoEGPTConfig, with_legacy_architecture
from moesaic.train.ckpt_manifest import (
    MANIFEST,
    damage_message,
    damaged_file_index,
    verify_manifest,
)
from moesaic.train.errors import CheckpointDamaged, CheckpointError, describe

# The formats this moesaic reads (1: no manifest, the size check only; 2: manifest.json).
READABLE_FORMATS = (1, 2)


# What ``latest`` may name: a checkpoint directory of this run, nothing else.
_STEP_NAME = re.compile(r"step_[0-9]+")


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


def finished_checkpoints(root: Path, upto: str) -> list[Path]:
    """Finished checkpoints up to step name ``upto``, oldest first (those with a manifest)."""
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.suffix and p.name <= upto]
    return sorted(p for p in done if (p / MANIFEST).is_file())


def latest_checkpoint(run_dir: str) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` (via ``latest``), or None if there is none."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint pointer {pointer} is unreadable ({describe(exc)})"
        ) from None
    path = root / name
    # Only a checkpoint of this run: "../../../../etc" would send a resume to /etc/meta.json.
    if not _STEP_NAME.fullmatch(name) or path.is_symlink():
        raise CheckpointError(
            f"checkpoint pointer {pointer} names {name!r}; it must name a step_<N> directory "
            f"inside {root}"
        )
    if not path.is_dir():
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
    path: Path,
    model_cfg: MoEGPTConfig | None = None,
    *,
    verify: bool = True,
    check_meta: Callable[[Path, dict], None] | None = None,
) -> dict:
    """Check that ``path`` is a complete, intact checkpoint (matching ``model_cfg``).

    Returns its meta.json. Raises CheckpointError (a ValueError) naming what is wrong: a missing
    or unreadable file, a file whose size or sha256 differs from manifest.json (when ``verify``),
    a data file shorter than the metadata says, or a model shape that differs. ``check_meta``
    (e.g. the data's tokenizer against the run's) runs before the shapes are compared, so its
    refusal names the cause rather than a shape it implies.
    """
    from moesaic.train.ckpt_reader import read_metadata  # imports DCP (see _dcp)

    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        saved = saved_model_config(meta)
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointDamaged(
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
    md = read_metadata(path)  # never unpickles anything but metadata types
    for info in (md.storage_data or {}).values():
        f = path / info.relative_path
        if not f.is_file() or f.stat().st_size < info.offset + info.length:
            raise CheckpointDamaged(
                f"checkpoint {path} is corrupt: data file {f.name} is missing or short"
            )
    if check_meta is not None:
        check_meta(path, meta)
    if model_cfg is not None:
        for name in SHAPE_FIELDS:
            old, new = attrgetter(name)(saved), attrgetter(name)(model_cfg)
            if old != new:
                raise CheckpointError(
                    f"checkpoint {path} is incompatible: model {name} is {old} in the "
                    f"checkpoint but {new} in this run"
                )
    return meta


def newest_intact_checkpoint(
    run_dir: str,
    model_cfg: MoEGPTConfig | None = None,
    check_meta: Callable[[Path, dict], None] | None = None,
) -> tuple[Path, dict, list[str]] | None:
    """The newest intact checkpoint of ``run_dir`` (one process hashing every file: the
    launcher, ``generate``): ``(path, meta, damage)`` where ``damage`` has one line for each
    newer checkpoint that is damaged; None when there is no checkpoint.

    Raises:
        CheckpointDamaged: every checkpoint is damaged (the line names the newest's damage).
        CheckpointError: the newest is refused or incompatible (never passed over silently).
    """

    def check(path: Path) -> tuple[str | None, dict]:
        try:
            return None, read_checkpoint_meta(path, model_cfg, check_meta=check_meta)
        except CheckpointDamaged as exc:
            return str(exc), {}

    return _newest_passing(run_dir, check)


def choose_resume_checkpoint(
    run_dir: str,
    model_cfg: MoEGPTConfig,
    layout,
    device: torch.device,
    check_meta: Callable[[Path, dict], None] | None = None,
) -> tuple[Path, dict, list[str]] | None:
    """:func:`newest_intact_checkpoint` as a collective of every rank: each hashes its share
    of the files (outside any collective wait), then one all-reduce per checkpoint tried
    agrees on the first damaged file, so every rank resumes from the same checkpoint.
    ``check_meta`` as in :func:`read_checkpoint_meta` (the same outcome on every rank)."""

    def check(path: Path) -> tuple[str | None, dict]:
        code, mine, meta = 0, None, {}
        try:
            meta = read_checkpoint_meta(path, model_cfg, verify=False, check_meta=check_meta)
            index = None
            if meta["format"] >= 2:
                index = damaged_file_index(path, layout.rank, layout.world_size)
            code = 0 if index is None else 2 + index
        except CheckpointDamaged as exc:
            code, mine = 1, str(exc)
        codes_P = torch.zeros(layout.world_size, dtype=torch.int64, device=device)
        codes_P[layout.rank] = code
        layout.world.all_reduce(codes_P, what="agreement on a checkpoint's integrity")
        bad = [(r, c) for r, c in enumerate(codes_P.tolist()) if c]
        if not bad:
            return None, meta
        rank, code = bad[0]
        if code >= 2:  # a file of the manifest: the same line on every rank
            return damage_message(path, code - 2), {}
        return mine or f"checkpoint {path} is corrupt (found by rank {rank})", {}

    return _newest_passing(run_dir, check)


def _newest_passing(
    run_dir: str, check: Callable[[Path], tuple[str | None, dict]]
) -> tuple[Path, dict, list[str]] | None:
    """The first of ``latest`` and the finished checkpoints before it, newest first, that
    ``check`` finds intact (``check`` returns ``(damage line or None, meta)``)."""
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return None
    candidates = [
        latest,
        *(p for p in reversed(finished_checkpoints(latest.parent, latest.name)) if p != latest),
    ]
    damage: list[str] = []
    for path in candidates:
        line, meta = check(path)
        if line is None:
            return path, meta, damage
        damage.append(line)
    if len(candidates) == 1:
        raise CheckpointDamaged(damage[0])
    raise CheckpointDamaged(f"{damage[0]}; no older checkpoint in {latest.parent} is intact either")


def resume_note(path: Path, damage: list[str]) -> str | None:
    """The line a resume prints when it passed over damaged checkpoints (None if it did not)."""
    if not damage:
        return None
    return f"{damage[0]}; resuming from {path.name}, the newest intact checkpoint"
