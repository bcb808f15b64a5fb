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
* ``train.step``, ``train.consumed`` (data position), ``rng.<rank>`` (torch's CPU RNG state)
  and, when the model is on a GPU, ``rng.cuda.<rank>`` (that device's RNG state).

Atomicity: ranks write into ``step_N.tmp``; each rank then hashes the data files it wrote
(a part of the manifest, outside any collective wait: ``ckpt_manifest``); rank 0 adds meta.json,
merges the parts into manifest.json, renames the directory to ``step_N`` and replaces
``latest``. A crash at any point leaves the previous checkpoint and ``latest`` intact; every
leftover ``*.tmp`` / ``*.old`` is removed before the next save, so a crashed save does not keep
the room the next one needs. :class:`Checkpointer` can save asynchronously
(``torch.distributed.checkpoint.async_save``: the state is copied to host memory, training goes
on while a thread writes and hashes it on a process group of its own, the ``ckpt`` lane); the
save is published when the next one starts and at the end of the run.

Integrity: ``ckpt_choice.read_checkpoint_meta`` checks every file against manifest.json, so a
damaged checkpoint is refused with one line naming the file, by ``--resume`` and by
``generate``; a resume whose newest checkpoint is damaged goes back to the newest intact one and
says so (``ckpt_choice.choose_resume_checkpoint``, the ranks sharing the hashing). Finding and
choosing a checkpoint is ``moesaic.train.ckpt_choice``'s; saving and loading are this module's. ``latest`` must name a
``step_<N>`` directory inside ``checkpoints/``. A save refuses non-finite parameters or optimizer
states (the ranks agree on it first), so a diverged run never replaces or prunes the last good
checkpoint. Reading never runs code from the checkpoint (``ckpt_reader``: metadata unpickled
with an allow-list, tensors with ``weights_only``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from moesaic.layer import is_expert_param
from moesaic.models.gpt import MoEGPT, MoEGPTConfig
from moesaic.strategies.registry import get_strategy
from moesaic.train.ckpt_choice import finished_checkpoints, read_checkpoint_meta, saved_model_config
from moesaic.train.ckpt_manifest import (
    MANIFEST,
    fsync_dir,
    merge_manifest,
    verify_manifest,
    write_atomic,
    write_part,
)
from moesaic.train.errors import (
    CheckpointError,
    checkpoint_cause,
    describe,
    first_failure,
    is_checkpoint_exception,
)
from moesaic.train.fsdp import reshard

__all__ = [
    "MANIFEST",
    "Checkpointer",
    "load_checkpoint",
    "load_model_for_inference",
    "save_checkpoint",
    "verify_manifest",
]

# 2: manifest.json with the sha256 of every file. Format-1 checkpoints (no manifest) still load,
# with the size check only.
FORMAT_VERSION = 2


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


def _own_storages(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` for DCP's asynchronous staging: each sharded entry (a DTensor: FSDP2,
    ``train/fsdp.py``) whose local tensor is a view into a larger storage (an expert's slice
    of the sharded expert weight, a shard of FSDP2's padded buffer) as a DTensor of a copy.
    Staging such a view failed in torch 2.13 ("Attempted to call copy_() on an invalid python
    storage"); the copy costs this rank's shards once more, which the staging copies anyway.
    Entries that are not DTensors are as they were."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in state.items():
        if isinstance(v, DTensor) and v.to_local()._base is not None:
            v = DTensor.from_local(
                v.to_local().clone(),
                v.device_mesh,
                v.placements,
                run_check=False,
                shape=v.shape,
                stride=v.stride(),
            )
        out[k] = v
    return out


def _barrier(layout, what: str, device: torch.device) -> None:
    # An all-reduce through EPGroup rather than dist.barrier: it waits with the deadline.
    layout.world.all_reduce(torch.zeros(1, device=device), what=what)


def _nonfinite_keys(state: dict[str, torch.Tensor]) -> list[str]:
    """The keys of the floating-point entries holding NaN or inf, with one host read per
    device (the flags are stacked on the device first): a value read per entry is a host sync
    each on a GPU, thousands for a large model."""
    from torch.distributed.tensor import DTensor  # (with DCP: only when saving)

    # a sharded entry (FSDP2, train/fsdp.py) is checked on this rank's shard: every rank
    # checks its own, and the ranks agree on the counts (_agree_finite)
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
    by_device: dict[torch.device, list[str]] = {}
    for k, v in local.items():
        if torch.is_tensor(v) and v.is_floating_point():
            by_device.setdefault(v.device, []).append(k)
    bad = []
    for keys in by_device.values():
        finite_N = torch.stack([torch.isfinite(local[k]).all() for k in keys])
        bad += [k for k, ok in zip(keys, finite_N.tolist(), strict=True) if not ok]
    return bad


def _agree_finite(layout, state: dict, step: int, root: Path, device: torch.device) -> None:
    """Raise CheckpointError on every rank if any rank's state holds NaN or inf.

    Doubles as the barrier before the save: one all-reduce of each rank's count.
    """
    bad = _nonfinite_keys(state)
    counts_P = torch.zeros(layout.world_size, dtype=torch.float64, device=device)
    counts_P[layout.rank] = len(bad)
    layout.world.all_reduce(counts_P, what="barrier before checkpoint save (finite check)")
    counts = counts_P.tolist()  # the one read of the agreement
    if not any(counts):
        return
    per_rank = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(counts) if c)
    example = f", e.g. {bad[0]}" if bad else ""
    latest = root / "latest"
    kept = latest.read_text().strip() if latest.is_file() else "none yet"
    raise CheckpointError(
        f"refusing to save checkpoint step {step}: {int(sum(counts))} tensors hold NaN or "
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


class DeviceRng(Protocol):
    """The RNG of an accelerator, as ``torch.cuda`` offers it for one device."""

    def get_rng_state(self) -> torch.Tensor: ...

    def set_rng_state(self, new_state: torch.Tensor) -> None: ...


@dataclasses.dataclass(frozen=True)
class _CudaRng:
    device: torch.device

    def get_rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, new_state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(new_state, self.device)


def device_rng(device: torch.device) -> DeviceRng | None:
    """The RNG of ``device`` beside torch's CPU one (CUDA's), None on the CPU. Dropout and any
    sampling on a GPU draw from it, so a resumed run restores it too. (A test stands one in on
    the CPU by replacing this function.)"""
    return _CudaRng(device) if device.type == "cuda" else None


def rng_entries(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``rng.<rank>`` (the CPU RNG) and, on a GPU, ``rng.<type>.<rank>`` (the device's)."""
    out = {f"rng.{rank}": torch.get_rng_state()}
    rng = device_rng(device)
    if rng is not None:
        out[f"rng.{device.type}.{rank}"] = rng.get_rng_state()
    return out


def _restore_rng(state: dict[str, torch.Tensor], rank: int, device: torch.device) -> None:
    if f"rng.{rank}" in state:
        torch.set_rng_state(state[f"rng.{rank}"])
    rng = device_rng(device)
    if rng is not None and f"rng.{device.type}.{rank}" in state:
        rng.set_rng_state(state[f"rng.{device.type}.{rank}"])


@dataclasses.dataclass(eq=False)
class _Save:
    """One save between its write and its publication."""

    root: Path
    step: int
    info: dict  # meta.json
    keep: int
    device: torch.device
    written: concurrent.futures.Future | None = None  # asynchronous: the write and the hashing

    @property
    def name(self) -> str:
        return f"step_{self.step:08d}"

    @property
    def tmp(self) -> Path:
        return self.root / f"{self.name}.tmp"

    @property
    def final(self) -> Path:
        return self.root / self.name


class Checkpointer:
    """The saves of one run (a collective: every rank calls each method, in the same order).

    Synchronous by default: :meth:`save` returns once the checkpoint is published. With
    ``asynchronous``, :meth:`save` copies the state to host memory and returns while a thread
    writes it (``torch.distributed.checkpoint.async_save`` on the ``ckpt`` lane, a process
    group of its own, so its collectives never interleave with training's) and hashes this
    rank's files; the checkpoint is published (renamed, ``latest`` replaced) by the next
    :meth:`save` or by :meth:`finish`, which the run calls at its end. A run that dies before
    then keeps its previous checkpoint.
    """

    def __init__(
        self,
        run_dir: str,
        *,
        layout,
        meta: dict,
        keep: int,
        asynchronous: bool = False,
        timeout_s: float = 300.0,
    ) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.layout, self.meta, self.keep = layout, meta, keep
        self._group = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        if asynchronous:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, "moesaic-checkpoint")
            if dist.is_initialized():
                self._group = _checkpoint_group(layout.world_size, timeout_s)
        self._pending: _Save | None = None

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        step: int,
        consumed: int,
        check_finite: bool = True,
    ) -> list[tuple[int, Path]]:
        """Checkpoint ``step``; returns the ``(step, path)`` of the checkpoints published by
        this call (the previous asynchronous one, this one when synchronous).

        Raises:
            CheckpointError: on every rank, when ``check_finite`` and some rank's parameters
                or optimizer states hold NaN or inf (nothing is written, nothing pruned); on
                the rank that failed, when writing failed (a full disk): the message names
                the cause.
        """
        published = self.finish()
        save, state = self._prepare(model, optimizer, step, consumed, check_finite)
        rank = self.layout.rank
        if self._thread is None:
            try:
                with _quiet_single_process():
                    _dcp().save(state, checkpoint_id=str(save.tmp), no_dist=_no_dist())
                write_part(save.tmp, rank)
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                raise self._failed(save, exc) from None
            return [*published, (step, self._publish(save))]
        try:
            with _quiet_single_process():
                response = _dcp().async_save(
                    _own_storages(state),
                    checkpoint_id=str(save.tmp),
                    process_group=self._group,
                    no_dist=_no_dist(),
                )
        except BaseException as exc:
            raise self._failed(save, exc) from None
        upload = getattr(response, "upload_completion", response)  # a Future either way
        save.written = self._thread.submit(_wait_and_hash, upload, save.tmp, rank)
        self._pending = save
        return published

    def finish(self) -> list[tuple[int, Path]]:
        """Publish the asynchronous save in flight, if any (after its write and hashing on
        every rank); returns its ``(step, path)``."""
        save, self._pending = self._pending, None
        if save is None:
            return []
        assert save.written is not None  # set by save() with every pending save
        try:
            save.written.result()
        except BaseException as exc:
            raise self._failed(save, exc) from None
        return [(save.step, self._publish(save))]

    def close(self) -> None:
        """Stop the writer thread (call :meth:`finish` first to keep the save in flight)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    def _prepare(self, model, optimizer, step, consumed, check_finite) -> tuple[_Save, dict]:
        layout = self.layout
        device = next(model.parameters()).device
        info = {**self.meta, "step": step, "consumed": consumed}
        save = _Save(self.root, step, info, self.keep, device)
        if layout.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CheckpointError(f"cannot create {self.root}: {describe(exc)}") from None
            clean_stale(self.root)
        # a unit FSDP2 still holds gathered (a forward no backward followed) registers its
        # unsharded parameters, which are neither the optimizer's keys nor this rank's shard
        reshard(model)
        state = tensor_entries(model, optimizer)
        if check_finite:
            _agree_finite(layout, state, step, self.root, device)
        else:
            _barrier(layout, "barrier before checkpoint save", device)
        state["train.step"] = torch.tensor(step, dtype=torch.int64)
        state["train.consumed"] = torch.tensor(consumed, dtype=torch.int64)
        state.update(rng_entries(layout.rank, device))
        return save, state

    def _publish(self, save: _Save) -> Path:
        """Every rank has hashed its files: rank 0 publishes, the others wait for it."""
        layout = self.layout
        _barrier(layout, "barrier after every rank hashed its checkpoint files", save.device)
        if layout.rank == 0:
            try:
                _publish(save, layout.world_size)
            except BaseException as exc:
                raise self._failed(save, exc) from None
        _barrier(layout, "barrier after checkpoint save", save.device)
        return save.final

    def _failed(self, save: _Save, exc: BaseException) -> BaseException:
        """The CheckpointError for a failed write (``exc`` itself for Ctrl-C and exits)."""
        if not (isinstance(exc, Exception) or is_checkpoint_exception(exc)):
            return exc  # KeyboardInterrupt, SystemExit
        if isinstance(exc, CheckpointError):
            return exc
        cause = _save_failure_cause(exc, save.root)  # before the room is given back
        if self.layout.rank == 0:
            shutil.rmtree(save.tmp, ignore_errors=True)  # give the room back
        return CheckpointError(f"saving checkpoint {save.name} in {save.root} failed: {cause}")


def _no_dist() -> bool:
    return not dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns "assuming the intent is to save in a single process": yes, a one-process run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        yield


def _wait_and_hash(upload: concurrent.futures.Future, tmp: Path, rank: int) -> None:
    """The checkpoint thread: wait for this rank's write, then hash what it wrote."""
    upload.result()
    write_part(tmp, rank)


def _checkpoint_group(world_size: int, timeout_s: float) -> Any:
    """The world's ``ckpt`` lane (a collective: every rank creates it, at the same point)."""
    from moesaic.comm.groups import registry

    reg = registry()
    ranks = list(range(world_size))
    reg.create([ranks], "ckpt", timeout_s, singletons=True)
    return reg.lookup(ranks, "ckpt")


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
    """Write checkpoint ``step`` synchronously (a collective: every rank calls it); see
    :meth:`Checkpointer.save`."""
    saver = Checkpointer(run_dir, layout=layout, meta=meta, keep=keep)
    published = saver.save(
        model, optimizer, step=step, consumed=consumed, check_finite=check_finite
    )
    return published[-1][1]


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


def _publish(save: _Save, world_size: int) -> None:
    """Rank 0: meta.json and manifest.json into ``save.tmp`` (the ranks' hashes merged), rename
    it to ``save.final``, point ``latest`` at it, prune."""
    root, tmp, final = save.root, save.tmp, save.final
    write_atomic(tmp / "meta.json", json.dumps({**save.info, "format": FORMAT_VERSION}, indent=1))
    merge_manifest(tmp, world_size)
    # The same step may exist from an attempt that died before updating ``latest`` (so it
    # is not the checkpoint ``latest`` names): move it aside, never delete it first.
    trash = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(tmp, final)
    fsync_dir(root)
    shutil.rmtree(trash, ignore_errors=True)
    write_atomic(root / "latest", final.name + "\n")
    # Prune only finished (manifest-bearing, hence finite) checkpoints older than this one:
    # never the one ``latest`` now names, never one a later step of another attempt wrote.
    for old in finished_checkpoints(root, final.name)[: -save.keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int
) -> tuple[int, int]:
    """Load ``path`` into this rank's model (and optimizer); returns (step, consumed).

    Works at any EP size: each rank reads the per-expert keys of the experts it holds.
    """
    from moesaic.train.ckpt_reader import SafeReader, read_metadata  # imports DCP (see _dcp)

    if optimizer is not None:
        init_optimizer_state(optimizer)
    views = tensor_entries(model, optimizer)
    md = read_metadata(path)
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
    device = next(model.parameters()).device
    rngs = {k: v for k, v in rng_entries(rank, device).items() if k in md.state_dict_metadata}
    state.update(rngs)
    try:
        with _quiet_single_process():  # in `generate`, a single process indeed
            _dcp().load(state, storage_reader=SafeReader(str(path)), no_dist=_no_dist())
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
    _restore_rng({k: state[k] for k in rngs}, rank, device)
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
    """The model of a ``--hf-config`` run (typed as what it stands in for: both are block
    models, ``moesaic.models.block_model.BlockModel``)."""
    from moesaic.models.hf_causal_lm import HFCausalLM

    return cast(MoEGPT, HFCausalLM(hf_config, cfg))
