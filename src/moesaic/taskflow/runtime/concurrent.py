"""The MoE-FFN plans on the concurrent executors, with one-sided tile puts: ``TaskflowRuntime``.

Shape legend: T tokens per rank, H hidden, F expert hidden, E experts, e local experts, K top-k,
P ranks, S slot rows.

One runtime per MoE layer (it owns the layer's transports, ``comm.channel.PutTransport``: the
gloo :class:`~moesaic.comm.channel.PutChannel`, a process group made once, and on CUDA
``comm.symmetric.SymmetricMemoryChannel``; ``comm.symmetric.pick_transport`` picks one per step
from the ``transport`` switch, the tensors' device and whether symmetric memory is available).
Per shape bucket it compiles the forward and backward plans once (``compile_plan``, validated)
and allocates the **receive window** once (by the step's transport: symmetric memory must be
mapped when it is allocated): one flat tensor holding the plan's incoming buffers (forward
``x_recv`` and ``y_ret``, backward ``g_recv`` and ``dx_ret``), the same size on every rank (the
bucket is agreed by the group), so that a put names its destination by an element offset that
is the same on every rank: FlashDMoE's symmetric layout, its incoming cells ordered (expert,
source rank, slot) as the plans' rows are.

A step (``forward`` / ``backward``):

1. the sequential executor's checks (``check_step``: direction, validation, and on a bucket's
   first step the world's plan fingerprint) and routing offsets (``step_routing``: one all-to-all of slot counts, which also
   fences steps: no rank puts step n+1 rows before every rank finished step n);
2. remote writes that carry no valid row this step are signalled locally at once (both sides
   know it from the counts), and the channel starts receiving exactly the other puts;
3. the executor (``static``: one worker per queue in compiled order; ``dynamic``: scheduler and
   processors) runs the task handlers of the sequential executor (``handlers.py``: the same
   task definitions). A handler's puts to other ranks are collected per task and sent when it
   ends, per destination in order; the last message to a destination carries that
   destination's trigger events, so its counters move only once every row has landed.

Only valid rows travel (payload-efficient). Errors: a dead or silent peer is a
``CollectiveError`` within ``timeout_s`` from the waits, the scheduler or the channel; a step
whose routing does not fit the bucket is refused before any transfer (``step_routing``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from moesaic.checks import check_one_of, check_positive, check_positive_int
from moesaic.comm.channel import PutChannel, PutTransport
from moesaic.comm.collectives import EPGroup
from moesaic.comm.symmetric import (
    TRANSPORTS,
    SymmetricMemoryChannel,
    pick_transport,
    symmetric_available,
)
from moesaic.routing import RoutingPlan
from moesaic.taskflow.bucket import CompileOptions, ShapeBucket, slot_rows_for
from moesaic.taskflow.compile import compile_plan
from moesaic.taskflow.moe_graphs import TASK_TYPES
from moesaic.taskflow.plan import Plan
from moesaic.taskflow.runtime.executors import (
    EXECUTORS,
    EngineLanes,
    engine_lanes,
    make_counters,
    run_dynamic,
    run_static,
)
from moesaic.taskflow.runtime.handlers import HANDLERS
from moesaic.taskflow.runtime.sequential import (
    SAVED,
    BackwardResult,
    ForwardResult,
    StepRouting,
    StepRows,
    check_step,
    expert_inputs,
    make_buffers,
    step_routing,
)
from moesaic.taskflow.tasks import Region, TaskDescriptor
from moesaic.trace import Recorder

__all__ = ["RECEIVE_BUFFERS", "TaskflowRuntime"]

# The buffers other ranks put into: they live in the symmetric receive window.
RECEIVE_BUFFERS = frozenset({"x_recv", "y_ret", "g_recv", "dx_ret"})


@dataclass(frozen=True, slots=True)
class _Window:
    """One bucket's receive window for one direction and dtype: flat data, buffer offsets."""

    data: torch.Tensor
    offsets: dict[str, tuple[int, int, int]]  # name -> (element offset, rows, cols)

    def view(self, name: str) -> torch.Tensor:
        off, rows, cols = self.offsets[name]
        return self.data[off : off + rows * cols].view(rows, cols)


def _window(plan: Plan, allocate: Callable[[int], torch.Tensor]) -> _Window:
    """``plan``'s receive buffers in one flat tensor of ``allocate(numel)`` (zeroed)."""
    offsets, off = {}, 0
    for spec in plan.buffers:
        if spec.name in RECEIVE_BUFFERS and spec.kind != "input":  # not the saved copies
            offsets[spec.name] = (off, spec.rows, spec.cols)
            off += spec.rows * spec.cols
    return _Window(data=allocate(max(off, 1)), offsets=offsets)


class _Step(StepRows):
    """One step of one plan on the concurrent executors: the handlers' ``run`` object."""

    def __init__(self, plan, bufs, route, window: _Window, channel: PutTransport | None) -> None:
        super().__init__(plan, bufs, route)
        self.window, self.channel = window, channel
        self.outbox: dict[int, list[tuple[Region, torch.Tensor]]] = {}

    # -- what the handlers call -------------------------------------------------------------------
    def put(self, t: TaskDescriptor, r: Region, rows: torch.Tensor) -> None:
        if r.rank == self.me:
            self.bufs[r.buffer][r.start : r.start + rows.shape[0]].copy_(rows)
        else:  # sent when the task ends (one task runs on one thread: no lock needed)
            self.outbox.setdefault(t.uid, []).append((r, rows))

    # -- what the executor calls ------------------------------------------------------------------
    def launch(self, t: TaskDescriptor) -> None:
        HANDLERS[TASK_TYPES[t.task_type].handler](self, t)
        out = self.outbox.pop(t.uid, None)
        if not out:
            return
        last = {r.rank: k for k, (r, _) in enumerate(out)}
        assert self.channel is not None  # a group of one never puts to another rank
        for k, (r, rows) in enumerate(out):
            events = [ref.event for ref in t.trigger_events if ref.rank == r.rank]
            off, _, cols = self.window.offsets[r.buffer]
            flat = rows.reshape(-1).contiguous()
            self.channel.put(
                flat, r.rank, off + r.start * cols, events if last[r.rank] == k else ()
            )

    def expected_puts(self, counters) -> int:
        """Signal the remote writes that carry no row this step; the messages the rest send."""
        expected = 0
        for w in self.plan.remote_writes:
            n = sum(len(self.segments(r)) for r in w.regions)
            if n == 0:
                for ev in w.trigger_events:
                    counters.bump(ev)
            expected += n
        return expected


class TaskflowRuntime:
    """Runs one MoE layer's forward and backward plans on a concurrent executor.

    Construction is collective over the members of ``group`` (the put channel's process group).

    Args:
        group: the expert-parallel group.
        executor: ``"static"`` (two-queue workers, compiled order) or ``"dynamic"`` (FlashDMoE's
            scheduler and processor pool).
        processors: processor threads of the dynamic executor.
        tile_m: dispatch tile rows; ``gmm_tile_m``: GMM / activation / combine tile rows.
        options: compile options (RATR, interleaving).
        timeout_s: bound on every wait for a peer.
        recorder: records executed tasks (lanes per queue or processor, and the subscriber).
        transport: how tiles move (``comm.symmetric.TRANSPORTS``): ``"gloo"`` (the default:
            CPU tensors), ``"auto"`` (symmetric memory for CUDA tensors on several ranks when
            available, else gloo) or ``"symmetric"`` (also on one rank: its window and fences).
            Symmetric memory is opt-in until its CUDA path has run on a GPU.
    """

    def __init__(
        self,
        group: EPGroup,
        *,
        executor: str = "static",
        processors: int = 2,
        tile_m: int = 128,
        gmm_tile_m: int | None = None,
        options: CompileOptions | None = None,
        timeout_s: float = 60.0,
        recorder: Recorder | None = None,
        transport: str = "gloo",
    ) -> None:
        self.group = group
        self.transport = check_one_of("transport", transport, TRANSPORTS)
        self.executor = check_one_of("executor", executor, EXECUTORS)
        self.processors = check_positive_int("processors", processors)
        self.tile_m = check_positive_int("tile_m", tile_m)
        self.gmm_tile_m = gmm_tile_m
        self.options = options or CompileOptions()
        self.timeout_s = check_positive("timeout_s", timeout_s)
        self.recorder = recorder
        # created at the first step that puts through it (a collective of the world, which
        # every rank reaches together: the step's bucket is agreed), so a run whose tiles go
        # through symmetric memory, or a group of one, holds no "puts" lane
        self._gloo: PutChannel | None = None
        # no collective: symmetric memory is mapped per window (``window``)
        self._symmetric = (
            SymmetricMemoryChannel(group, timeout_s)
            if transport != "gloo" and symmetric_available(group)
            else None
        )
        self._last: PutTransport | None = self._gloo
        self._plans: dict[ShapeBucket, tuple[Plan, Plan]] = {}
        self._windows: dict[tuple[ShapeBucket, str, torch.dtype, str], _Window] = {}
        self._scratch: dict[tuple, torch.Tensor] = {}
        self._checked: set[tuple[ShapeBucket, str]] = set()
        self._up: tuple[torch.Tensor, torch.Tensor, tuple, torch.Tensor] | None = None
        self._lock = threading.Lock()

    # -- buckets and plans ------------------------------------------------------------------------
    def bucket(
        self, routing: RoutingPlan, *, hidden: int, ffn: int, activation: str
    ) -> ShapeBucket | None:
        """The bucket of a step, the same on every rank (one all-reduce of this rank's largest
        expert load and token count): slot rows for the largest (source rank, expert) load and
        the most tokens of any rank (a rank with fewer pads, see ``pad_routing``). None when
        no rank has a token."""
        T, K = routing.topk_ids_TK.shape
        worst = int(routing.counts_E.max()) if routing.counts_E.numel() else 0
        agreed = self.group.control_tensor([worst, T])
        self.group.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, what="taskflow bucket")
        if int(agreed[1]) == 0:
            return None
        return ShapeBucket(
            tokens=int(agreed[1]),
            hidden=hidden,
            ffn=ffn,
            experts=routing.counts_E.numel(),
            top_k=K,
            ep_size=self.group.size,
            slot_rows=slot_rows_for(int(agreed[0]), self.gmm_tile_m or self.tile_m),
            tile_m=self.tile_m,
            gmm_tile_m=self.gmm_tile_m,
            activation=activation,
        )

    def plans(self, bucket: ShapeBucket) -> tuple[Plan, Plan]:
        """The (forward, backward) plans of this rank for ``bucket``, compiled once."""
        with self._lock:
            if bucket not in self._plans:
                rank = self.group.rank
                self._plans[bucket] = (
                    compile_plan(bucket, "forward", rank, self.options),
                    compile_plan(bucket, "backward", rank, self.options),
                )
            return self._plans[bucket]

    @property
    def channel(self) -> PutTransport | None:
        """The transport of the latest step (None before the first step)."""
        return self._last

    def transport_for(self, device: torch.device) -> PutTransport | None:
        """The transport of a step on ``device`` (``comm.symmetric.pick_transport``)."""
        ready = self._symmetric is not None
        kind = pick_transport(self.transport, device.type, self.group.size, ready)
        if kind == "symmetric":
            return self._symmetric
        if kind == "gloo" and self._gloo is None:
            self._gloo = PutChannel(self.group, self.timeout_s)
        return self._gloo if kind == "gloo" else None

    def window(self, plan: Plan, dtype: torch.dtype, device: torch.device) -> _Window:
        """``plan``'s receive window, allocated once per bucket by the step's transport (a
        collective for symmetric memory: every rank reaches a bucket's first step)."""
        key = (plan.bucket, plan.direction, dtype, str(device))
        with self._lock:
            if key not in self._windows:
                channel = self.transport_for(device)
                events = max(1, len(plan.graph.events))

                def allocate(numel: int) -> torch.Tensor:
                    if channel is None:
                        return torch.zeros(numel, dtype=dtype, device=device)
                    return channel.window(numel, dtype, device, events)

                self._windows[key] = _window(plan, allocate)
            return self._windows[key]

    def scratch(self, plan: Plan, spec, ref: torch.Tensor) -> torch.Tensor:
        """A work buffer of ``plan`` that no step keeps: allocated once per bucket."""
        key = (plan.bucket, spec.name, ref.dtype, str(ref.device))
        with self._lock:
            if key not in self._scratch:
                self._scratch[key] = ref.new_empty(spec.rows, spec.cols)
            return self._scratch[key]

    def _w_up(self, w1: torch.Tensor, w3: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[w1 | w3]`` ([e, H, 2F]), rebuilt only when a weight changed (in-place optimizer
        steps bump the version counters)."""
        key = (w1._version, w3._version, dtype)
        with self._lock:
            up = self._up
            # the tensors themselves are kept (not their addresses), so identity is exact
            if up is None or up[0] is not w1 or up[1] is not w3 or up[2] != key:
                cat = torch.cat([w1.detach(), w3.detach()], dim=2).to(dtype)
                up = self._up = (w1, w3, key, cat)
            return up[3]

    def world_checked(self, plan: Plan) -> bool:
        """Whether ``plan``'s world check (fingerprint all-gather) already ran on every rank."""
        return (plan.bucket, plan.direction) in self._checked

    def window_bytes(self) -> int:
        """Bytes of every receive window allocated so far."""
        return sum(w.data.numel() * w.data.element_size() for w in self._windows.values())

    # -- steps ------------------------------------------------------------------------------------
    def _check_step(self, plan: Plan, direction: str) -> EPGroup:
        """``check_step`` of a step of ``plan``: the world check (an all-gather of plan
        fingerprints) runs on a bucket's first step only, which every rank reaches together (the
        bucket is agreed by all of them). Returns the step's group."""
        key = (plan.bucket, direction)
        group = check_step(
            plan, self.group, self.timeout_s, direction, world_checked=key in self._checked
        )
        self._checked.add(key)
        return group

    def _run(self, plan, inputs, routing, direction):
        group = self._check_step(plan, direction)
        ref = inputs["dy_TH" if direction == "backward" else "x_TH"]
        # NCCL supports neither host threads per queue nor receives from any source, and gloo's
        # point-to-point hands the window's raw pointer to TCP (no device copy): device tiles
        # between ranks need symmetric memory (pick_transport refuses them otherwise).
        channel = self.transport_for(ref.device)
        self._last = channel
        window = self.window(plan, ref.dtype, ref.device)

        def work(spec):
            # Every valid row is written before it is read and padding rows are never read,
            # so nothing needs zeroing. Receive buffers live in the window, scratch that is
            # neither saved nor returned is kept per bucket (no page faults per step), the
            # rest (saved activations, outputs) is fresh.
            if spec.name in RECEIVE_BUFFERS:
                return window.view(spec.name)
            if spec.kind == "work" and spec.name not in SAVED:
                return self.scratch(plan, spec, ref)
            return ref.new_empty(spec.rows, spec.cols)

        bufs = make_buffers(plan, inputs, ref, work)
        route: StepRouting = step_routing(plan, routing, group)  # also the step fence
        step = _Step(plan, bufs, route, window, channel)
        if "w3" in inputs:  # [w1 | w3] once per weight version, shared by forward and backward
            step.memo["w_up"] = self._w_up(inputs["w1"], inputs["w3"], ref.dtype)
        counters = make_counters(plan.graph, plan.rank)
        expected = step.expected_puts(counters)
        if channel is not None:
            channel.begin(window.data, counters, expected, self.recorder)
        try:
            if self.executor == "static":
                # the same lanes the sequential executor hands the event engine, kept per plan
                lanes = plan.memo("lanes", lambda p: engine_lanes(p.graph, p.schedule, p.rank))
                run_static(
                    plan.graph,
                    plan.schedule,
                    plan.rank,
                    step.launch,
                    counters,
                    timeout_s=self.timeout_s,
                    recorder=self.recorder,
                    lanes=cast(EngineLanes, lanes),
                )
            else:
                run_dynamic(
                    plan.graph,
                    plan.schedule,
                    plan.rank,
                    step.launch,
                    counters,
                    processors=self.processors,
                    timeout_s=self.timeout_s,
                    recorder=self.recorder,
                )
        except BaseException as exc:
            if channel is not None:
                channel.fail(f"rank {plan.rank} stopped its step: {exc}")
                with contextlib.suppress(Exception):  # the executor's error is the one to report
                    channel.finish()
            raise
        if channel is not None:
            channel.finish()
        return bufs, route

    def forward(
        self,
        plan: Plan,
        x_TH: torch.Tensor,
        routing: RoutingPlan,
        w1_eHF: torch.Tensor,
        w2_eFH: torch.Tensor,
        w3_eHF: torch.Tensor | None = None,
        *,
        save: bool = True,
    ) -> ForwardResult:
        """One forward step (like ``run_forward``). With ``save`` the activations the backward
        plan needs are kept, those in the window as copies, so the window is free for the next
        step before this one's backward; without it (no backward will run) nothing is kept."""
        inputs = {"x_TH": x_TH, **expert_inputs(plan, w1_eHF, w2_eFH, w3_eHF)}
        bufs, route = self._run(plan, inputs, routing, "forward")
        saved = {}
        if save:
            saved = {k: bufs[k].clone() if k in RECEIVE_BUFFERS else bufs[k] for k in SAVED}
        return ForwardResult(y_TH=bufs["y_TH"], saved=saved, trace=[], route=route)

    def backward(
        self,
        plan: Plan,
        dy_TH: torch.Tensor,
        routing: RoutingPlan,
        saved: dict[str, torch.Tensor],
        w1_eHF: torch.Tensor,
        w2_eFH: torch.Tensor,
        w3_eHF: torch.Tensor | None = None,
    ) -> BackwardResult:
        """One backward step (like ``run_backward``)."""
        inputs = {"dy_TH": dy_TH, **expert_inputs(plan, w1_eHF, w2_eFH, w3_eHF), **saved}
        bufs, _ = self._run(plan, inputs, routing, "backward")
        return BackwardResult.from_buffers(plan, bufs, [])
