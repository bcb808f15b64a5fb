"""The MoE-FFN plans on the device: one launch of the persistent Triton kernel per direction
(``kernels.persistent``) for one rank, for a world of V **virtual ranks** on one device, or for
one of several **real peers** on one node.

Shape legend: T tokens, H hidden, F expert hidden, E experts, e local experts, P ranks, S slot
rows, V ranks in one launch.

* ``rank_launch`` / ``virtual_launch`` build a ``kernels.persistent.Launch``: the lowered rows
  (``taskflow.lower``) in topological order, the step's routing (``lower.step_tables``), the
  buffers, and the two tables of element offsets a row adds to reach another rank's counters
  (``psig``) and put targets (``pdata``): ``peer_offsets`` of the ranks' tensors, whichever
  way they were allocated. Virtual ranks: every buffer ``[V * rows, cols]`` in one allocation,
  rank r's share its r-th block, the rows of all ranks interleaved in the world's topological
  order, ``HOME`` = r. A real peer: its own rows, ``HOME`` = 0, the offsets of the peers'
  symmetric-memory buffers. Same kernel, same code; only the offsets differ.
* ``run_virtual``: the forward or backward plans of every rank of a world run in one launch on
  one device (CI runs it under Triton's interpreter at V = 2 and 4).
* ``PersistentRuntime``: ``TaskflowRuntime`` whose steps run in the kernel
  (``dispatcher="taskflow"`` with ``kernels="triton"``, or ``"auto"`` on CUDA; other steps on
  the host runtime). EP 1: one launch, no peer. EP > 1: real peers through
  ``torch.distributed._symmetric_memory`` (the receive window and the counters rendezvous-ed
  per bucket), refused before anything starts where it cannot run (``check_peers``). Per step:
  the routing offsets exchanged (``step_routing``'s all-to-all), one launch on the bucket's
  next counter set and window at its next epoch (``taskflow.runtime.epochs``: never zeroed, no
  host sync before the launch). On CUDA a launch's error word is read at the next launch of
  its bucket and direction (``Started``), so the host waits for the launch of a step ago, not
  for the one it queues: a ``TaskError`` surfaces one step late.

SwiGLU plans only.
"""

from __future__ import annotations

import socket
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, cast

import torch

from moesaic.checks import check_one_of
from moesaic.comm.collectives import EPGroup
from moesaic.comm.symmetric import CudaSymmetricMemory, symmetric_available
from moesaic.kernels import require_triton
from moesaic.kernels import task_ops as ops
from moesaic.kernels.persistent_steps import persistent_steps
from moesaic.routing import RoutingPlan
from moesaic.taskflow.lower import DeviceTables, StepTables, WorldTables, lower, step_tables
from moesaic.taskflow.plan import Plan
from moesaic.taskflow.runtime.concurrent import RECEIVE_BUFFERS, TaskflowRuntime, _Window, _window
from moesaic.taskflow.runtime.epochs import SETS, EpochSignals
from moesaic.taskflow.runtime.sequential import StepRouting, make_buffers, step_routing

if TYPE_CHECKING:
    from moesaic.kernels.persistent import Started  # imports Triton

__all__ = [
    "PersistentRuntime",
    "check_peers",
    "peer_offsets",
    "rank_launch",
    "run_virtual",
    "virtual_launch",
    "virtual_signals",
    "world_events",
]


def peer_offsets(tensors: Sequence[torch.Tensor], me: int) -> list[int]:
    """Element offsets from ``tensors[me]`` to every ``tensors[r]`` (one dtype): what a kernel
    adds to its own pointer to reach rank r's. Virtual ranks: blocks of one allocation; real
    peers: the mappings of a symmetric-memory buffer."""
    size = tensors[me].element_size()
    base = tensors[me].data_ptr()
    out = []
    for r, t in enumerate(tensors):
        delta = t.data_ptr() - base
        if t.dtype != tensors[me].dtype or delta % size:
            raise ValueError(
                f"rank {r}'s tensor ({t.dtype}, {delta} bytes from rank {me}'s) is not a whole "
                f"number of {tensors[me].dtype} elements away"
            )
        out.append(delta // size)
    return out


def check_peers(group: EPGroup, device: torch.device) -> str | None:
    """Why the persistent kernel cannot put to ``group``'s ranks from ``device``, or None.

    Puts are stores into the peers' memory: every rank must be a CUDA device of one node with
    torch's symmetric memory and peer access to every other rank's device (NVLink or PCIe
    P2P). Checked before anything starts (``PersistentRuntime``, and the first step)."""
    if group.size == 1:
        return None
    if device.type != "cuda":
        return f"its puts store into peer GPUs' memory; the tensors are on {device.type}"
    if not symmetric_available(group):
        return "torch's symmetric memory is unavailable (needs torch.distributed initialised)"
    hosts = group.all_gather_dim0(
        group.control_tensor([zlib.crc32(socket.gethostname().encode())]), what="persistent hosts"
    )
    if len(set(hosts.tolist())) > 1:
        return f"the {group.size} ranks span {len(set(hosts.tolist()))} hosts; peers map one node"
    devs = group.all_gather_dim0(
        group.control_tensor([device.index or 0]), what="persistent devices"
    ).tolist()
    me = device.index or 0
    for r, d in enumerate(devs):
        if d != me and not torch.cuda.can_device_access_peer(me, d):
            return f"cuda:{me} has no peer access to rank {r}'s cuda:{d}"
    return None


def rank_launch(
    tables: DeviceTables,
    step: StepTables,
    bufs: dict[str, torch.Tensor],
    *,
    tokens: int,
    counters: torch.Tensor,
    psig: list[int],
    pdata: list[int],
    scope: str = "gpu",
    epoch: int = 1,
):
    """The ``Launch`` of one rank (EP 1, or a real peer with the peers' offsets), waits met at
    ``epoch`` times the thresholds (``counters`` used by ``epoch - 1`` launches before)."""
    from moesaic.kernels.persistent import Launch  # imports Triton

    dev = tables.tasks.device
    return Launch(
        direction=tables.direction,
        tasks=tables.launch_rows(),
        triggers=tables.triggers,
        trigger_ranks=tables.trigger_ranks,
        counters=counters,
        psig=torch.tensor(psig, dtype=torch.int64, device=dev),
        pdata=torch.tensor(pdata, dtype=torch.int64, device=dev),
        step={f.name: getattr(step, f.name) for f in fields(step)},
        bufs=bufs,
        tokens=tokens,
        hidden=tables.hidden,
        ffn=tables.ffn,
        top_k=tables.top_k,
        local_experts=tables.local_experts,
        ep_size=tables.ep_size,
        slot_rows=tables.slot_rows,
        scope=scope,
        epoch=epoch,
    )


def virtual_launch(
    world: WorldTables,
    steps: Sequence[StepTables],
    bufs: dict[str, torch.Tensor],
    *,
    tokens: int,
    counters: torch.Tensor | None = None,
    epoch: int = 1,
):
    """The ``Launch`` of every rank of ``world`` at once: ``bufs`` are ``[V * rows, cols]``
    (rank r's share is block r), the steps' tables are stacked, the rows interleaved in the
    world's topological order with ``HOME`` = rank and their trigger slices shifted;
    ``counters`` (``V * world_events(world)``, default zeros) used by ``epoch - 1`` launches
    before."""
    from moesaic.kernels.persistent import PUT_TARGETS, Launch  # imports Triton

    V = len(world.ranks)
    t0 = world.ranks[0]
    dev = t0.tasks.device
    starts = [0]
    for t in world.ranks:
        starts.append(starts[-1] + t.triggers.numel())
    rows = []
    for r, t in enumerate(world.ranks):
        own = t.tasks.clone()
        own[:, ops.HOME] = r
        own[:, ops.TRIG0] += starts[r]
        rows.append(own)
    order = world.order.to(dev)
    base = torch.tensor([0] + [t.tasks.shape[0] for t in world.ranks], device=dev).cumsum(0)
    tasks = torch.cat(rows)[base[order[:, 0]] + order[:, 1]].contiguous()
    n_ev = world_events(world)
    if counters is None:
        counters = torch.zeros(V * n_ev, dtype=torch.int32, device=dev)
    if counters.numel() != V * n_ev:
        raise ValueError(f"counters ({counters.numel()}) must hold V * events = {V * n_ev}")

    def blocks(t: torch.Tensor) -> list[torch.Tensor]:
        return list(t.view(V, -1).unbind(0))

    psig = [o for me in range(V) for o in peer_offsets(blocks(counters), me)]
    targets = [n for n in PUT_TARGETS if n in bufs]
    pdata = [o for me in range(V) for o in peer_offsets(blocks(bufs[targets[0]]), me)]
    for name in targets[1:]:
        if [o for me in range(V) for o in peer_offsets(blocks(bufs[name]), me)] != pdata:
            raise ValueError(f"put target {name} must have {targets[0]}'s rank stride")
    step = {
        f.name: torch.cat([getattr(s, f.name).flatten() for s in steps]) for f in fields(steps[0])
    }
    return Launch(
        direction=t0.direction,
        tasks=tasks,
        triggers=torch.cat([t.triggers for t in world.ranks]),
        trigger_ranks=torch.cat([t.trigger_ranks for t in world.ranks]),
        counters=counters,
        psig=torch.tensor(psig, dtype=torch.int64, device=dev),
        pdata=torch.tensor(pdata, dtype=torch.int64, device=dev),
        step=step,
        bufs=bufs,
        tokens=tokens,
        hidden=t0.hidden,
        ffn=t0.ffn,
        top_k=t0.top_k,
        local_experts=t0.local_experts,
        ep_size=t0.ep_size,
        slot_rows=t0.slot_rows,
        epoch=epoch,
    )


def world_events(world: WorldTables) -> int:
    """Counters one rank of ``world`` needs in a virtual-rank launch (its most events)."""
    return max(t.thresholds.numel() for t in world.ranks) or 1


def virtual_signals(world: WorldTables, device: torch.device | str = "cpu") -> EpochSignals:
    """Fresh signals for the virtual-rank launches of ``world`` (``run_virtual``)."""
    return EpochSignals.zeros(len(world.ranks) * world_events(world), device)


class _SlotCounts:
    """``step_routing``'s slot-count all-to-all among V virtual ranks of one process: each
    rank's receive row s is what rank s sends it (``sent``, recorded by a first pass)."""

    control_device = torch.device("cpu")

    def __init__(self, sent: list[torch.Tensor] | None, me: int = 0) -> None:
        self.sent, self.me = sent, me
        self.recorded: list[torch.Tensor] = []

    def all_to_all_single(self, recv: torch.Tensor, send: torch.Tensor, what: str = "") -> None:
        if self.sent is None:
            self.recorded.append(send.clone())
            recv.zero_()
        else:
            recv.copy_(torch.stack([s[self.me] for s in self.sent]))


def virtual_routes(plans: Sequence[Plan], routings: Sequence[RoutingPlan]) -> list[StepRouting]:
    """Every virtual rank's ``step_routing`` (the slot counts exchanged in process)."""
    record = _SlotCounts(None)
    for plan, routing in zip(plans, routings):
        step_routing(plan, routing, cast(EPGroup, record))
    return [
        step_routing(plan, routing, cast(EPGroup, _SlotCounts(record.recorded, plan.rank)))
        for plan, routing in zip(plans, routings)
    ]


def run_virtual(
    world: WorldTables,
    plans: Sequence[Plan],
    inputs: Sequence[dict[str, torch.Tensor]],
    routings: Sequence[RoutingPlan],
    *,
    programs: int | None = None,
    spin: int | None = None,
    trace: bool = False,
    signals: EpochSignals | None = None,
) -> tuple[list[dict[str, torch.Tensor]], list[int] | None]:
    """Run one direction of a world's plans (rank r's at index r, ``world`` their lowered
    tables) in one launch on the inputs' device: every rank's buffers (by the plan's names)
    and the order of the rows run (with ``trace``). ``signals`` (``virtual_signals``): the
    counters of earlier launches of this world and direction, taken up at their next set and
    epoch (default: fresh counters, epoch 1)."""
    require_triton()
    from moesaic.kernels.persistent import run_tables  # imports Triton

    ref = inputs[0]["dy_TH" if plans[0].direction == "backward" else "x_TH"]
    per_rank = [make_buffers(p, i, ref) for p, i in zip(plans, inputs)]
    bufs = {name: torch.cat([b[name] for b in per_rank]) for name in per_rank[0]}
    routes = virtual_routes(plans, routings)
    world = world.to(ref.device)
    steps = [step_tables(t, r, ref.device) for t, r in zip(world.ranks, routes)]
    counters, epoch = None, 1
    if signals is not None:
        s, epoch = signals.advance()
        counters = signals.counters[s]
    launch = virtual_launch(
        world, steps, bufs, tokens=plans[0].bucket.tokens, counters=counters, epoch=epoch
    )
    done = run_tables(launch, programs=programs, spin=spin, trace=trace)
    V = len(plans)
    out = [{name: b.view(V, -1, b.shape[1])[r] for name, b in bufs.items()} for r in range(V)]
    return out, done


@dataclass(frozen=True, slots=True)
class _Peers:
    """One bucket and direction's device state on a rank: the epoch signals, the receive
    windows, one a counter set (empty at EP 1: the put targets are fresh buffers) and the
    offset tables (the same for either set: each is at one offset in every rank's
    allocation)."""

    signals: EpochSignals
    windows: tuple[_Window, ...]
    psig: list[int]
    pdata: list[int]


class PersistentRuntime(TaskflowRuntime):
    """``TaskflowRuntime`` whose steps run in one launch of the persistent kernel per
    direction; EP > 1 through real peers on one node (symmetric memory).

    Args:
        group: the expert-parallel group.
        kernels: "triton" (every step in the kernel; CPU tensors only under Triton's
            interpreter) or "auto" (the kernel for CUDA tensors, the host runtime,
            ``TaskflowRuntime``'s, for the others).
        activation: the layer's activation (SwiGLU only).
        programs: the launch's grid (default: ``kernels.persistent.device_programs``).
        **kwargs: ``TaskflowRuntime``'s (tile sizes, compile options, timeout, recorder, the
            host runtime's executor and transport).
    """

    def __init__(
        self,
        group: EPGroup,
        *,
        kernels: str = "triton",
        activation: str = "swiglu",
        programs: int | None = None,
        **kwargs,
    ) -> None:
        if activation != "swiglu":
            raise ValueError(
                f"dispatcher 'taskflow' with kernels='triton' runs SwiGLU experts only (got "
                f"activation {activation!r}); use kernels='torch'"
            )
        super().__init__(group, **kwargs)
        self.kernels = check_one_of("kernels", kernels, ("triton", "auto"))
        self.programs = programs
        self._tables: dict[tuple, DeviceTables] = {}
        self._peers: dict[tuple, _Peers] = {}
        self._pending: dict[tuple, Started] = {}
        self._memory: CudaSymmetricMemory | None = None

    def uses_kernel(self, device: torch.device) -> bool:
        """Whether a step on ``device`` runs in the kernel (else on the host runtime)."""
        return persistent_steps(self.kernels, "swiglu", device.type)

    def tables(self, plan: Plan, device: torch.device) -> DeviceTables:
        """``plan``'s device tables on ``device``, lowered and moved once."""
        key = (plan.bucket, plan.direction, str(device))
        if key not in self._tables:
            host = cast(DeviceTables, plan.memo("device_tables", lower))
            self._tables[key] = host.to(device)
        return self._tables[key]

    def peers(self, plan: Plan, ref: torch.Tensor) -> _Peers:
        """The signals, receive windows and offset tables of ``plan``'s bucket on ``ref``'s
        device, made once: at EP 1 plain counters and offsets 0; at EP > 1 the counters and
        the windows in symmetric memory (``epochs.SETS`` of each, in one allocation each) and
        the offsets of every peer's (a collective every rank reaches at the bucket's first
        step), refused first where peers cannot be reached (``check_peers``)."""
        key = self._key(plan, ref)
        if key in self._peers:
            return self._peers[key]
        n_ev = max(1, len(plan.graph.events))
        if self.group.size == 1:
            self._peers[key] = _Peers(EpochSignals.zeros(n_ev, ref.device), (), [0], [0])
            return self._peers[key]
        why = check_peers(self.group, ref.device)
        if why is not None:
            raise ValueError(
                f"dispatcher 'taskflow' with kernels='triton' at EP {self.group.size}: {why}"
            )
        if self._memory is None:
            self._memory = CudaSymmetricMemory(self.group)
        mem, me = self._memory, self.group.rank
        whole: list[torch.Tensor] = []

        def allocate(numel: int) -> torch.Tensor:  # SETS windows in one allocation
            whole.append(mem.allocate(SETS * numel, ref.dtype, ref.device))
            return whole[0][:numel]

        first = _window(plan, allocate)
        size = first.data.numel()
        windows = tuple(
            _Window(data=whole[0][s * size : (s + 1) * size], offsets=first.offsets)
            for s in range(SETS)
        )
        counters = mem.allocate(SETS * n_ev, torch.int32, ref.device)
        self._peers[key] = _Peers(
            EpochSignals(counters.view(SETS, n_ev)),
            windows,
            peer_offsets(mem.peers(counters), me),
            peer_offsets(mem.peers(whole[0]), me),
        )
        return self._peers[key]

    @staticmethod
    def _key(plan: Plan, ref: torch.Tensor) -> tuple:
        return (plan.bucket, plan.direction, ref.dtype, str(ref.device))

    def _run(self, plan, inputs, routing, direction):
        ref = inputs["dy_TH" if direction == "backward" else "x_TH"]
        if not self.uses_kernel(ref.device):
            return super()._run(plan, inputs, routing, direction)
        group = self._check_step(plan, direction)
        require_triton()
        from moesaic.kernels.persistent import start_tables  # imports Triton

        peers = self.peers(plan, ref)
        key = self._key(plan, ref)
        last = self._pending.pop(key, None)
        if last is not None:  # the previous launch of this bucket and direction: its error
            last.result()  # waits for that launch only (queued a step ago), not this one
        s, epoch = peers.signals.advance()  # no zeroing, no sync: see taskflow.runtime.epochs
        if peers.windows:
            window = peers.windows[s]

            def work(spec):  # the put targets in the symmetric window, the rest fresh
                if spec.name in RECEIVE_BUFFERS:
                    return window.view(spec.name)
                return ref.new_zeros(spec.rows, spec.cols)

            bufs = make_buffers(plan, inputs, ref, work)
        else:
            bufs = make_buffers(plan, inputs, ref)
        route = step_routing(plan, routing, group)  # with peers, also the step fence
        tables = self.tables(plan, ref.device)
        launch = rank_launch(
            tables,
            step_tables(tables, route, ref.device),
            bufs,
            tokens=plan.bucket.tokens,
            counters=peers.signals.counters[s],
            psig=peers.psig,
            pdata=peers.pdata,
            scope="sys" if group.size > 1 else "gpu",
            epoch=epoch,
        )
        started = start_tables(launch, programs=self.programs)
        if ref.device.type == "cuda":
            self._pending[key] = started  # checked at this key's next launch
        else:  # the interpreter ran it already: checking costs no wait
            started.result()
        return bufs, route
