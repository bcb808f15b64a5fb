"""Test helpers: the gloo world spawner, the relative tolerance rule, a host-sync counter and a
graph-counting torch.compile backend."""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from moesaic.comm.world import WorkerError, run_world

if TYPE_CHECKING:
    from moesaic.config import MoEConfig
    from moesaic.layer import MoELayer

# What torch's CUDA sync debug mode ("warn") says for each operation that makes the host wait
# for the GPU; not its one-time "prototype feature" notice, which a first GPU run (issue 27)
# counted as a sync by matching "synchroniz".
SYNC_WARNING = "called a synchronizing CUDA operation"


__all__ = [
    "GraphCounter",
    "HostSync",
    "HostSyncCounter",
    "WorkerError",
    "assert_close_to_ref",
    "ref_errors",
    "reference_world",
    "route_all_to_first_experts",
    "run_world",
]


def ref_errors(
    fast: torch.Tensor, ref: torch.Tensor, ref64: torch.Tensor, eps_dtype: torch.dtype
) -> dict[str, float | bool]:
    """The relative rule's figures: ``fast``'s and the same-dtype reference ``ref``'s max error
    against the float64 reference ``ref64``, the allowance ``2 * err(ref) + 4 ulps of
    eps_dtype at the tensor's scale``, and whether ``fast`` is within it (``ok``)."""
    truth = ref64.double()
    err_fast = (fast.double() - truth).abs().max().item() if truth.numel() else 0.0
    err_ref = (ref.double() - truth).abs().max().item() if truth.numel() else 0.0
    scale = max(truth.abs().max().item() if truth.numel() else 0.0, 1e-30)
    eps = 4 * torch.finfo(eps_dtype).eps * scale
    allowed = 2 * err_ref + eps
    return {
        "max_abs_err": err_fast,
        "max_rel_err": err_fast / scale,
        "ref_same_dtype_abs_err": err_ref,
        "eps": eps,
        "allowed_abs_err": allowed,
        "ok": bool(err_fast <= allowed),
    }


def assert_close_to_ref(
    fast: torch.Tensor, ref32: torch.Tensor, ref64: torch.Tensor, name: str = "tensor"
) -> None:
    """The relative rule for arithmetic paths: ``err(fast) <= 2 * err(ref32) + eps``.

    ``ref64`` is the reference run in float64 (the truth up to ~1e-16), ``ref32`` the same
    reference in the fast path's dtype: its error is what that dtype costs with an ordinary
    summation order, so a fast path may be at most twice as far from the truth. ``eps`` (4 ulps
    of float32 at the tensor's scale) absorbs the case where ref32 happens to be exact.
    """
    if fast.shape != ref64.shape:
        raise AssertionError(f"{name}: shape {tuple(fast.shape)} != {tuple(ref64.shape)}")
    e = ref_errors(fast, ref32, ref64, torch.float32)
    if not e["ok"]:
        raise AssertionError(
            f"{name}: max error {e['max_abs_err']:.3e} vs float64 reference exceeds "
            f"2 x reference-float32 error ({e['ref_same_dtype_abs_err']:.3e}) + eps "
            f"({e['eps']:.1e})"
        )


def reference_world(cfg: MoEConfig, sd: dict, xs: list, gs: list) -> dict:
    """The reference MoE over every rank's batch, in fp32 and fp64.

    Loss: ``sum_r (y_r * g_r).sum() + aux_r``. Returns ``{dtype: (ys, auxes, x_grads,
    param_grads)}``: per-rank outputs and aux losses, per-rank input gradients, and the
    gradients of the full (all-expert) parameters by name. With the "global"
    ``balance_loss_scope`` every rank's aux counts the loads of all ranks' tokens.
    """
    from moesaic.reference import ReferenceMoE

    out = {}
    for dtype in (torch.float32, torch.float64):
        ref = ReferenceMoE.from_full_state_dict(cfg, sd).to(dtype)
        xs_d = [x.detach().to(dtype).clone().requires_grad_() for x in xs]
        ys, auxes, terms = [], [], []
        every = torch.cat([x.detach().reshape(-1, cfg.hidden_size) for x in xs_d])
        balance_x = every if cfg.balance_loss_scope == "global" else None
        for x, g in zip(xs_d, gs):
            y, aux = ref(x, balance_x)
            ys.append(y)
            auxes.append(aux)
            terms.append((y * g.to(dtype)).sum() + aux)
        torch.stack(terms).sum().backward()
        grads = {name: p.grad for name, p in ref.named_parameters()}
        out[dtype] = (ys, auxes, [x.grad for x in xs_d], grads)
    return out


def route_all_to_first_experts(layer: MoELayer) -> dict:
    """Skew ``layer``'s router so that inputs with a large positive feature 0 go to experts 0
    and 1 (rank 0's); returns the new full state dict."""
    sd = layer.full_state_dict()
    sd["router.weight"].zero_()
    sd["router.weight"][0, 0], sd["router.weight"][1, 0] = 20.0, 10.0
    layer.load_full_state_dict(sd)
    return sd


# ---- host syncs -------------------------------------------------------------------------------

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_THIS_FILE = os.path.abspath(__file__)

# Ops that read a tensor's value on the host: on a GPU the host waits for every queued kernel.
_VALUE_READS = {"_local_scalar_dense", "equal", "allclose", "is_nonzero"}
# Ops whose output shape depends on the data: the host must read a count to allocate the output.
_DATA_SHAPED = {
    "nonzero",
    "masked_select",
    "bincount",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
}
_BOOL_INDEXED = {"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_"}
_COPIES = {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize"}


@dataclass(frozen=True, slots=True)
class HostSync:
    """One operation that would make the host wait for the device.

    Attributes:
        kind: ``"read"`` (a value read on the host: ``.item()``, ``int(t)``, ``.tolist()``),
            ``"shape"`` (an output shape that depends on the data), ``"to_host"`` (a copy to
            the CPU) or ``"to_device"`` (a blocking copy of host memory to the device).
        op: the operation (``aten.nonzero``, ``Tensor.tolist``, ``torch.tensor``, ...).
        where: the innermost moesaic frame that issued it (``moesaic/routing.py:141
            build_plan``), else the innermost frame outside torch.
        backward: the autograd node running when it was issued (``IndexBackward0``), None in
            the forward.
    """

    kind: str
    op: str
    where: str
    backward: str | None = None

    def __str__(self) -> str:
        node = f" in {self.backward}" if self.backward else ""
        return f"{self.op} [{self.kind}] at {self.where}{node}"


def _is_bool(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _classify(name: str, args: tuple, kwargs: dict) -> str | None:
    """The kind of host sync an aten op (name without ``aten.``/overload) causes, or None."""
    if name in _VALUE_READS:
        return "read"
    if name in _DATA_SHAPED:
        return "shape"
    if name == "repeat_interleave":  # repeats as a tensor: sized by their sum, unless given
        return "shape" if kwargs.get("output_size") is None else None
    if name in _BOOL_INDEXED:  # x[mask], x[mask] = v and their backward: a nonzero inside
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return "shape" if any(_is_bool(i) for i in indices or ()) else None
    if name in _COPIES:
        return _copy_kind(name, args, kwargs)
    if name in ("lift_fresh", "lift_fresh_copy"):  # torch.tensor(data) made on a device
        t = args[0]
        return "to_device" if t.device.type != "cpu" and not _Patches.constructing() else None
    return None


def _copy_kind(name: str, args: tuple, kwargs: dict) -> str | None:
    """``to_host`` for a copy from a device to the CPU; ``to_device`` for a blocking copy from
    the CPU to a device (CUDA synchronises the stream after a copy with non_blocking=False)."""
    if name == "_to_copy":
        src = args[0]
        dst_device = kwargs.get("device") or src.device
        non_blocking = kwargs.get("non_blocking", False)
    else:  # copy_(dst, src, non_blocking); _copy_from(src, dst, non_blocking)
        dst, src = (args[0], args[1]) if name == "copy_" else (args[1], args[0])
        dst_device = dst.device
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    src_cpu, dst_cpu = src.device.type == "cpu", torch.device(dst_device).type == "cpu"
    if dst_cpu and not src_cpu:
        return "to_host"
    if src_cpu and not dst_cpu and not non_blocking:
        return "to_device"
    return None


def _where(frame: FrameType | None) -> str:
    """The innermost moesaic frame (not this module), else the innermost frame outside torch."""
    fallback = None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _THIS_FILE:
            site = f"{path}:{frame.f_lineno} {frame.f_code.co_name}"
            if path.startswith(_PACKAGE_DIR + os.sep):
                rel = os.path.relpath(path, os.path.dirname(_PACKAGE_DIR))
                return f"{rel}:{frame.f_lineno} {frame.f_code.co_name}"
            if fallback is None and not path.startswith(_TORCH_DIR + os.sep):
                fallback = site
        frame = frame.f_back
    return fallback or "?"


class _Patches:
    """Wrappers around what the dispatcher never sees: ``Tensor.tolist`` (reads the storage
    directly) and ``torch.tensor`` / ``torch.as_tensor`` of host data onto a device (made under
    an exclusion of the Python dispatch key). Installed while any counter is active on any
    thread (a reference count under a lock: the patched attributes are process-wide); the
    wrappers count only in the counters on the calling thread's dispatch-mode stack."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _users: ClassVar[int] = 0
    _saved: ClassVar[dict[str, Any]] = {}
    # depth > 0 while a wrapped constructor runs on this thread (its lift_fresh is not recounted)
    _inside: ClassVar[threading.local] = threading.local()

    @classmethod
    def constructing(cls) -> bool:
        return getattr(cls._inside, "depth", 0) > 0

    @classmethod
    def acquire(cls) -> None:
        with cls._lock:
            cls._users += 1
            if cls._users > 1:
                return
            cls._saved = {
                "tolist": torch.Tensor.__dict__.get("tolist"),
                "tensor": torch.tensor,
                "as_tensor": torch.as_tensor,
            }
            original_tolist = torch.Tensor.tolist

            def tolist(self: torch.Tensor) -> Any:
                _record("read", "Tensor.tolist", sys._getframe(1))
                return original_tolist(self)

            torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
            torch.tensor = cls._constructor(torch.tensor, "torch.tensor")
            torch.as_tensor = cls._constructor(torch.as_tensor, "torch.as_tensor")

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            cls._users -= 1
            if cls._users > 0:
                return
            if cls._saved["tolist"] is None:
                del torch.Tensor.tolist
            else:
                torch.Tensor.tolist = cls._saved["tolist"]  # type: ignore[method-assign]
            torch.tensor = cls._saved["tensor"]
            torch.as_tensor = cls._saved["as_tensor"]

    @classmethod
    def _constructor(cls, original: Callable[..., torch.Tensor], name: str) -> Callable:
        def make(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            device = kwargs.get("device")
            if device is None and name == "torch.as_tensor" and len(args) > 1:
                device = args[1]
            target = torch.device(device) if device is not None else torch.get_default_device()
            python_data = not isinstance(data, torch.Tensor)
            if target.type != "cpu" and (python_data or data.device.type == "cpu"):
                _record("to_device", name, sys._getframe(1))
            elif device is not None and python_data:  # host data to x.device, x on the CPU
                _record("to_device", name, sys._getframe(1), strict_only=True)
            cls._inside.depth = getattr(cls._inside, "depth", 0) + 1
            try:
                return original(data, *args, **kwargs)
            finally:
                cls._inside.depth -= 1

        return make


def _record(kind: str, op: str, frame: FrameType | None, strict_only: bool = False) -> None:
    """Count ``op`` in every HostSyncCounter active on this thread (``strict_only``: in those
    made with ``strict_constructors``)."""
    counters = [
        m
        for m in _get_current_dispatch_mode_stack()
        if isinstance(m, HostSyncCounter) and (m.strict_constructors or not strict_only)
    ]
    if counters:
        event = HostSync(kind, op, _where(frame), _autograd_node())
        for c in counters:
            c._add(event)


def _autograd_node() -> str | None:
    node = torch._C._current_autograd_node()
    return node.name() if node is not None else None


class HostSyncCounter(TorchDispatchMode):
    """Counts the operations that would make the host wait for a GPU, on any device.

    What is counted (each event with its kind, op and the moesaic line that issued it):

    * value reads: ``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``,
      ``float(t)``), ``aten.equal``, ``aten.allclose`` and ``Tensor.tolist``;
    * data-dependent output shapes: ``nonzero`` (and ``torch.where(mask)``), ``masked_select``,
      ``unique*``, ``bincount`` (CUDA reads the max to size its output), ``repeat_interleave``
      of tensor repeats without ``output_size``, indexing and index_put with a bool mask
      (``x[mask]``, ``x[mask] = v`` and their backward); ``nonzero_static`` is not counted;
    * copies to the CPU (``_to_copy``/``copy_`` whose source is on another device), and
      blocking copies of host memory to a device (``non_blocking=False``: CUDA synchronises the
      stream after them), including ``torch.tensor(data, device=...)`` and
      ``torch.as_tensor`` of host data onto a device.

    On CPU there is no device, so some of these cannot be seen: ``.cpu()`` of a CPU tensor is
    a no-op that reaches no operator, and ``torch.tensor(data, device=x.device)`` makes no copy
    when ``x`` is on the CPU. ``strict_constructors=True`` counts the latter anyway (Python or
    NumPy data given an explicit device, whatever it is): code that passes ``device=x.device``
    copies host memory to the GPU on a GPU run. A copy to the ``meta`` device counts as one to
    a device (what the tests use).

    Threads: dispatch modes are thread-local, so only the operations of the thread that
    entered the counter are counted (and those of autograd engine threads running its
    backward, which inherit the mode); work handed to other threads (the taskflow executors,
    a prefetch thread) is not seen. Events are appended under a lock.

    Example::

        with HostSyncCounter() as syncs:
            loss = layer(x).sum()
            loss.backward()
        syncs.check(at_most=1, what="dropless fwd+bwd")
    """

    def __init__(self, *, strict_constructors: bool = False) -> None:
        super().__init__()
        self.strict_constructors = strict_constructors
        self.events: list[HostSync] = []
        self._events_lock = threading.Lock()

    def __enter__(self) -> HostSyncCounter:
        _Patches.acquire()
        try:
            super().__enter__()
        except BaseException:
            _Patches.release()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _Patches.release()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::", 1)[-1]
        kind = _classify(name, args, kwargs)
        if kind is not None:
            self._add(HostSync(kind, f"aten.{name}", _where(sys._getframe(1)), _autograd_node()))
        return func(*args, **kwargs)

    def _add(self, event: HostSync) -> None:
        with self._events_lock:
            self.events.append(event)

    @property
    def count(self) -> int:
        return len(self.events)

    def by_site(self) -> Counter[HostSync]:
        """How many times each (kind, op, where, backward) occurred."""
        return Counter(self.events)

    def report(self) -> str:
        """One line per site, most frequent first."""
        lines = [f"{n} x {event}" for event, n in self.by_site().most_common()]
        return "\n".join(lines) if lines else "no host syncs"

    def check(self, at_most: int, what: str = "") -> None:
        """AssertionError listing every site when more than ``at_most`` syncs were counted."""
        if self.count > at_most:
            raise AssertionError(
                f"{what or 'host syncs'}: {self.count} host syncs, budget {at_most}:\n"
                + self.report()
            )


class GraphCounter:
    """A ``torch.compile`` backend that counts graphs: ``made`` how many were compiled, and
    ``runs`` how many times each ran (by its index; clear it between steps). Each graph runs
    through the ``inner`` backend (a name ``torch._dynamo.lookup_backend`` knows).

    Example::

        graphs = GraphCounter()
        layer.compile(backend=graphs)
        ...
        assert sum(graphs.runs.values()) == 1  # this step's forward was one graph
    """

    def __init__(self, inner: str = "aot_eager") -> None:
        self.inner = inner
        self.made = 0
        self.runs: Counter[int] = Counter()

    def __call__(self, gm: torch.fx.GraphModule, example: list[Any]) -> Callable[..., Any]:
        from torch._dynamo import lookup_backend  # here: importing moesaic.testing stays light

        index, self.made = self.made, self.made + 1
        compiled = lookup_backend(self.inner)(gm, example)

        def run(*args: Any) -> Any:
            self.runs[index] += 1
            return compiled(*args)

        return run
