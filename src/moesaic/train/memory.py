"""What a training run measures of its memory per rank (issue 50 item 6).

* ``memory_bytes``: bytes this rank holds of parameters, gradients and optimizer state (a
  sharded tensor counts its local shard), taken right after the first optimizer step (the
  gradients are still held, AdamW's state has just been created).
* The step peak: the most bytes alive at once during the second step (the first steady one:
  AdamW's state exists from its start), from the end of the first optimizer step to the end of
  the second, and the bytes alive when it started (parameters, optimizer state, buffers, the
  data; not the first step's gradients, which are dropped before it starts). What
  the step adds above that is its working set: activations saved for the backward, FSDP2's
  gathered units, gradients, the optimizer's temporaries. On CUDA:
  ``torch.cuda.max_memory_allocated`` (the caching allocator's count; always on). On a CPU:
  :class:`LiveBytes`, a dispatch mode counting tensor storages on the step's thread, only with
  ``TrainConfig.measure_peak`` (it re-reads every live storage's size after each op, since
  FSDP2 frees and re-allocates its gathered parameters by resizing their storages outside the
  dispatcher: several times slower steps). Not seen by it: allocations outside tensors (gloo's
  own buffers) and on other threads (hybrid's prefetch thread).

The planner's prediction of the same figures: ``moesaic.sim.memory``.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moesaic.comm.collectives import EPGroup
from moesaic.layer import is_expert_param

__all__ = [
    "ALIVE_AT_START",
    "FIELDS",
    "MADE_SINCE",
    "LiveBytes",
    "MemoryBytes",
    "MemoryProbe",
    "memory_bytes",
    "storage_key",
]

# The per-rank record's fields (metrics.jsonl ``memory``), in this order.
FIELDS = (
    "params",
    "grads",
    "optimizer",
    "dense_params",
    "expert_params",
    "step_peak",
    "step_start",
)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass(frozen=True, slots=True)
class MemoryBytes:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards)."""

    params: int
    grads: int
    optimizer: int
    dense_params: int
    expert_params: int


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def memory_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> MemoryBytes:
    """Per-rank bytes of ``model``'s parameters and gradients and ``optimizer``'s state, as
    held on this rank (a sharded tensor counts its local shard)."""
    dense = expert = grads = 0
    for p in model.parameters():
        n = _nbytes(p)
        if is_expert_param(p):
            expert += n
        else:
            dense += n
        if p.grad is not None:
            grads += _nbytes(p.grad)
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            opt += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return MemoryBytes(
        params=dense + expert, grads=grads, optimizer=opt, dense_params=dense, expert_params=expert
    )


# The two shares of what a classifier does not name (see :class:`LiveBytes`; the window counted
# is a step's wherever the project counts one).
ALIVE_AT_START = "other, alive at the step's start"
MADE_SINCE = "other, made in the step"


class LiveBytes:
    """Live CPU tensor storage bytes, their peak and (with ``classify``) what was alive at the
    peak, counted by dispatch modes (:meth:`mode`, one per thread, all counting into this
    tally). :meth:`start` counts every tensor alive (a ``gc`` scan); then every storage an op
    returns is added until it is freed (``weakref.finalize``). After each op the sizes of all
    counted storages are read again: FSDP2 gathers into and frees its unsharded parameters'
    storages with ``UntypedStorage.resize_``, which no op reports.

    ``classify() -> {storage key: category}`` names the known storages (``storage_key``); at
    each new peak the live bytes are attributed to those categories, and the rest to
    :data:`ALIVE_AT_START` or :data:`MADE_SINCE` (``at_peak``)."""

    def __init__(self, classify: Callable[[], dict[int, str]] | None = None) -> None:
        self._classify = classify
        self._lock = threading.RLock()
        self._live: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.before: set[int] = set()  # storages alive at start()
        self.start_bytes = self.current = self.peak = 0
        self.at_peak: dict[str, int] = {}

    def mode(self) -> TorchDispatchMode:
        """A dispatch mode counting into this tally (enter it on the thread it counts)."""
        return _Counting(self)

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage (once, until it is freed); the peak is not updated here."""
        t = _local(t)
        if t.device.type != "cpu" or t.is_sparse or t.is_meta:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage
            return
        key = st._cdata
        with self._lock:
            if key not in self._live:
                self._live[key] = weakref.ref(st)
                weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        with self._lock:
            self._live.pop(key, None)
            self.before.discard(key)  # (a storage made later may take its address)

    def update(self) -> None:
        """Read every counted storage's size again; a new peak is recorded (and attributed)."""
        with self._lock:
            sizes = {}
            for key, ref in list(self._live.items()):
                st = ref()
                if st is not None:
                    sizes[key] = st.nbytes()
            self.current = sum(sizes.values())
            if self.current > self.peak:
                self.peak = self.current
                if self._classify is not None:
                    self.at_peak = self._attribute(sizes)

    def _attribute(self, sizes: dict[int, int]) -> dict[str, int]:
        assert self._classify is not None
        known = self._classify()
        out: dict[str, int] = {ALIVE_AT_START: 0, MADE_SINCE: 0}
        for key, n in sizes.items():
            other = ALIVE_AT_START if key in self.before else MADE_SINCE
            category = known.get(key, other)
            out[category] = out.get(category, 0) + n
        return out

    def start(self) -> None:
        """Count every tensor alive now; the peak starts from their bytes. Unreachable cycles
        are collected first: ``gc`` still lists their tensors, which a later collection frees
        (the count then fell below its start by what earlier code left in cycles)."""
        gc.collect()
        with warnings.catch_warnings():  # (isinstance on deprecated torch aliases warns)
            warnings.simplefilter("ignore")
            tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        for t in tensors:
            self.track(t)
        with self._lock:
            self.before = set(self._live)
            self.peak = -1  # the next update() records (and attributes) the start
            self.update()
            self.start_bytes = self.current


def storage_key(t: torch.Tensor) -> int:
    """The key :class:`LiveBytes` counts ``t``'s storage under (for ``classify``)."""
    return _local(t).untyped_storage()._cdata


class _Counting(TorchDispatchMode):
    """Every tensor an op returns goes to the tally; then the tally's sizes are read again."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # (torch's default imports dynamo on the first op: seconds)

    def __init__(self, tally: LiveBytes) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.tally.track(t)
        self.tally.update()
        return out


class _StepPeak:
    """The peak of the window between two optimizer steps, and the bytes at its start: CUDA's
    allocator statistics, or :class:`LiveBytes` on a CPU (``count_cpu``)."""

    def __init__(self, device: torch.device, count_cpu: bool) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.counter = LiveBytes() if (count_cpu and not self.cuda) else None
        self._mode: TorchDispatchMode | None = None
        self.start_bytes = self.peak = self._dropped = 0

    @property
    def active(self) -> bool:
        return self.cuda or self.counter is not None

    def open(self, dropped: int) -> None:
        """Start the window; ``dropped``: bytes alive now that the step frees before the next
        one starts (the gradients: ``zero_grad(set_to_none=True)`` after the update)."""
        self._dropped = dropped
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device) - dropped
        elif self.counter is not None:
            self.counter.start()
            self._mode = self.counter.mode()
            self._mode.__enter__()

    def leave(self) -> None:
        """Stop counting (idempotent)."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.counter is not None:
            self.leave()
            self.start_bytes = self.counter.start_bytes - self._dropped
            self.peak = self.counter.peak


class MemoryProbe:
    """A step post-hook on the optimizer: ``memory_bytes`` right after the first optimizer step
    that runs, and the peak of the second step (module docstring), where measured (CUDA; a CPU
    with ``count_cpu``)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        device: torch.device,
        count_cpu: bool = False,
    ) -> None:
        self.taken: MemoryBytes | None = None
        self._model = model
        self._peak = _StepPeak(device, count_cpu)
        self._steps = 0

        def hook(opt: torch.optim.Optimizer, *_: object) -> None:
            self._steps += 1
            if self._steps == 1:
                self.taken = memory_bytes(self._model, opt)
                if self._peak.active:
                    self._peak.open(dropped=self.taken.grads)
            elif self._steps == 2 and self._peak.active:
                self._peak.close()

        self._handle = optimizer.register_step_post_hook(hook)

    def gather(self, world: EPGroup) -> list[dict[str, int]]:
        """Every rank's record in rank order (a collective; zeros where nothing was taken: a
        rank without a step, a peak not measured or a run of one step)."""
        self._handle.remove()
        if self._steps == 1:
            self._peak.leave()  # a run of one step: no peak
        row = dict.fromkeys(FIELDS, 0)
        if self.taken is not None:
            row.update(
                params=self.taken.params,
                grads=self.taken.grads,
                optimizer=self.taken.optimizer,
                dense_params=self.taken.dense_params,
                expert_params=self.taken.expert_params,
            )
        if self._steps >= 2:
            row.update(step_peak=self._peak.peak, step_start=self._peak.start_bytes)
        row_1X = world.control_tensor([[row[f] for f in FIELDS]])
        rows = world.all_gather_dim0(row_1X, "all_gather of per-rank memory bytes").tolist()
        return [dict(zip(FIELDS, (int(v) for v in r), strict=True)) for r in rows]
