"""Sequential executor: runs a validated plan's tasks on one process with real tensors.

Shape legend: T tokens per rank, H hidden, F expert hidden, A = 2F (SwiGLU) or F (GELU), E
experts, e local experts, K top-k, P ranks, S slot rows.

This is the executor that proves a plan right, not a fast one: the event engine
(``taskflow.engine``, the same one the deadlock check runs) consumes the schedule's queues in
plan order (whichever head is ready), keeps the plan's event counters, never runs a task before
its dependent event reached its threshold, and launches each task's handler (the task type's
``handler`` in ``moe_graphs.TASK_TYPES``) in one thread. A plan is validated once
(``validate.ensure_validated``: a plan object that passed the check is not checked again). Puts to this rank are local copies;
puts to another rank are ``torch.distributed`` point-to-point messages. Every receive this rank
will ever get is posted (``irecv``) before its first send, tagged by (operator, destination
tile), so no send order of any rank can deadlock gloo's matching; waits are bounded by
``timeout_s`` and a late or dead peer becomes a ``CollectiveError`` naming the tile.

Per step the runtime takes only routing-derived offsets (``StepRouting``: which tokens fill which
slot rows, and the row counts of the slots every rank receives, one small all-to-all) and fresh
zeroed buffers and counters, as the paper's SSC runtime does. A tile handles only the valid rows
of its slots; a tile with none still completes and fires its events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from moesaic.comm.collectives import CollectiveError, EPGroup, Pending
from moesaic.routing import RoutingPlan
from moesaic.taskflow.engine import EventEngine, Stall
from moesaic.taskflow.moe_graphs import TASK_TYPES
from moesaic.taskflow.plan import Plan
from moesaic.taskflow.runtime.executors import EngineLanes, engine_lanes
from moesaic.taskflow.runtime.handlers import HANDLERS, RETURN_LAYOUT, Segment
from moesaic.taskflow.tasks import BufferSpec, Region, TaskDescriptor
from moesaic.taskflow.validate import ensure_validated

SAVED = ("x_recv", "h", "a", "y_ret")
# Message tags: (tag class << 24) | destination tile; the class is the put type's ``put_tag``,
# offset by this for backward plans so that no two puts of a forward-backward pair share one.
_BACKWARD_TAG_OFFSET = 4


@dataclass(kw_only=True, slots=True)
class StepRouting:
    """Routing-derived offsets of one step on one rank.

    Attributes:
        tokens_E: per expert slot, this rank's tokens routed to it, in token order (the rows
            of the expert's slot on its rank, and of its return slot here).
        weights_E: their combine weights (fp32, detached).
        weights_TK: the combine weights per token and choice (fp32, detached).
        ret_row_TK: row of the return buffer holding the expert output of choice (t, k).
        dropped_TK: True where the capacity dropped choice (t, k) (it contributes nothing and
            gets no gradient); None when nothing was dropped.
        send_counts_E: rows this rank sends to each global expert.
        recv_counts_eP: rows this rank receives for local expert j from source rank s.
    """

    tokens_E: list[torch.Tensor]
    weights_E: list[torch.Tensor]
    weights_TK: torch.Tensor
    ret_row_TK: torch.Tensor
    dropped_TK: torch.Tensor | None
    send_counts_E: list[int]
    recv_counts_eP: list[list[int]]


def step_routing(plan: Plan, routing: RoutingPlan, group: EPGroup) -> StepRouting:
    """Offsets for one step; exchanges the per-slot row counts with one all-to-all."""
    b = plan.bucket
    T, K, E, P, e, S = b.tokens, b.top_k, b.experts, b.ep_size, b.local_experts, b.slot_rows
    if tuple(routing.topk_ids_TK.shape) != (T, K):
        raise ValueError(
            f"routing has topk_ids_TK of shape {tuple(routing.topk_ids_TK.shape)}; the plan's "
            f"bucket needs (tokens={T}, top_k={K})"
        )
    if routing.counts_E.numel() != E:
        raise ValueError(f"routing has {routing.counts_E.numel()} experts; the plan has {E}")
    placement = routing.placement
    if placement.ep_size != P:
        raise ValueError(
            f"routing places experts over {placement.ep_size} ranks; the plan's bucket has "
            f"ep_size {P}"
        )
    # The plans number experts by dispatch slot (rank r's local expert j is slot r * e + j);
    # with a non-contiguous placement a global expert id maps to its slot.
    counts_E = routing.counts_E.cpu()
    slots = [g for ids in placement.experts_of_rank for g in ids]  # expert of each slot
    counts = counts_E if placement.is_contiguous else counts_E[slots]
    worst = int(counts.max())
    if worst > S:
        raise ValueError(
            f"routing sends {worst} rows to one expert, more than the bucket's slot_rows ({S}); "
            "compile a plan for a larger bucket (see slot_rows_for)"
        )
    order_N = routing.order_N.cpu()  # sorted by slot, then token
    token_N, k_N = order_N // K, order_N % K
    weights_N = routing.topk_weights_TK.detach().float().cpu()[token_N, k_N]
    starts = torch.cumsum(counts, 0) - counts
    expert_N = torch.repeat_interleave(torch.arange(E), counts)
    ret_row_TK = torch.zeros(T, K, dtype=torch.long)  # dropped choices: row 0, masked out
    ret_row_TK[token_N, k_N] = expert_N * S + torch.arange(order_N.numel()) - starts[expert_N]
    kept_TK = routing.kept_TK.cpu()
    # Control plane: on the device the group takes (a pure NCCL group raises on CPU tensors).
    send = counts.view(P, e).to(group.control_device, copy=True)
    recv = torch.empty_like(send)
    group.all_to_all_single(recv, send, what="taskflow slot counts")
    return StepRouting(
        tokens_E=list(token_N.split(counts.tolist())),
        weights_E=list(weights_N.split(counts.tolist())),
        weights_TK=routing.topk_weights_TK.detach().float().cpu(),
        ret_row_TK=ret_row_TK,
        dropped_TK=None if bool(kept_TK.all()) else ~kept_TK,
        send_counts_E=counts.tolist(),
        recv_counts_eP=recv.t().tolist(),
    )


class StepRows:
    """Valid-row bookkeeping of one step of one plan on this rank (every executor's handlers
    read it): how many rows of each slot are valid, on this rank and, for puts, on the target."""

    def __init__(self, plan: Plan, bufs: dict[str, torch.Tensor], route: StepRouting) -> None:
        self.plan, self.bufs, self.route = plan, bufs, route
        self.memo: dict[str, torch.Tensor] = {}  # per-step values handlers derive once
        b = plan.bucket
        self.P, self.e, self.S, self.me = b.ep_size, b.local_experts, b.slot_rows, plan.rank

    def count(self, buffer: str, rank: int, slot: int) -> int:
        """Valid rows of slot ``slot`` of ``buffer`` on ``rank`` (receive or return layout)."""
        if buffer in RETURN_LAYOUT:
            if rank == self.me:
                return self.route.send_counts_E[slot]
            return self.route.recv_counts_eP[slot - self.me * self.e][rank]
        j, s = divmod(slot, self.P)
        if rank == self.me:
            return self.route.recv_counts_eP[j][s]
        return self.route.send_counts_E[rank * self.e + j]

    def segments(self, r: Region) -> list[Segment]:
        """Valid row ranges of ``r``, one per slot it touches (empty ones left out)."""
        out = []
        for slot in range(r.start // self.S, (r.stop - 1) // self.S + 1):
            a, z = max(r.start, slot * self.S), min(r.stop, (slot + 1) * self.S)
            v = max(0, min(z - a, self.count(r.buffer, r.rank, slot) - (a - slot * self.S)))
            if v:
                out.append(Segment(start=a, stop=a + v, slot=slot))
        return out


class _Run(StepRows):
    """One execution of one plan on this rank."""

    def __init__(
        self,
        plan: Plan,
        bufs: dict[str, torch.Tensor],
        route: StepRouting,
        group: EPGroup,
        timeout_s: float,
        device: torch.device,
    ) -> None:
        super().__init__(plan, bufs, route)
        self.group = group
        self.timeout_s = timeout_s  # the caller's bound on every wait (run_forward's)
        self.device = device
        self.pending: dict[int, list] = {}
        self.sends: list[tuple[Pending, str]] = []
        self.payloads: list[torch.Tensor] = []  # kept alive until their sends complete
        self.trace: list[int] = []
        # the put type of every operator (a remote write names only the sender's operator)
        self.op_type = {t.op: t.task_type for t in plan.tasks}
        self.tag_offset = _BACKWARD_TAG_OFFSET if plan.direction == "backward" else 0
        lanes, thresholds = cast(
            EngineLanes, plan.memo("lanes", lambda p: engine_lanes(p.graph, p.schedule, p.rank))
        )
        self.engine: EventEngine[TaskDescriptor] = EventEngine(
            lanes,
            thresholds,
            launch=self.launch,
            on_stall=self.on_stall,
        )

    # -- communication ----------------------------------------------------------------------------
    def _tag(self, op: str, r: Region) -> int:
        tile = r.start // self.plan.bucket.tile_m
        if tile >= 1 << 24:
            raise ValueError(f"tile index {tile} of {r.buffer!r} does not fit a message tag")
        return ((TASK_TYPES[self.op_type[op]].put_tag + self.tag_offset) << 24) | tile

    def put(self, t: TaskDescriptor, r: Region, rows: torch.Tensor) -> None:
        """Write ``rows`` at the start of region ``r`` (local copy or a message)."""
        if r.rank == self.me:
            self.bufs[r.buffer][r.start : r.start + rows.shape[0]].copy_(rows)
            return
        payload = rows.contiguous()
        work = self.group.isend(payload, r.rank, self._tag(t.op, r), what=f"{t.label} put")
        self.sends.append((work, f"{t.label} -> rank {r.rank}"))
        self.payloads.append(payload)

    def post_receives(self) -> None:
        for k, w in enumerate(self.plan.remote_writes):
            works = []
            for r in w.regions:
                rows = sum(s.stop - s.start for s in self.segments(r))
                if rows:
                    view = self.bufs[r.buffer][r.start : r.start + rows]
                    tag = self._tag(w.op, r)
                    works.append(self.group.irecv(view, w.rank, tag, what=f"{w.op} receive"))
            if works:
                self.pending[k] = works
            else:  # nothing to carry: the write is complete as far as this rank can tell
                self._fire(w.trigger_events)

    def _wait(self, work: Pending, what: str) -> None:
        try:
            work.wait(self.timeout_s)
        except CollectiveError as exc:
            raise CollectiveError(
                f"taskflow {what} failed on rank {self.me}/{self.P} within "
                f"{self.timeout_s:g}s: a peer died, hung or runs another plan. "
                f"Cause: {str(exc.__cause__ or exc).splitlines()[0][:300]}"
            ) from exc

    def complete_remote(self, k: int) -> None:
        w = self.plan.remote_writes[k]
        for work in self.pending.pop(k):
            self._wait(work, f"receive of {w.op}[{w.task_index}] from rank {w.rank}")
        self._fire(w.trigger_events)

    # -- the engine's callbacks ------------------------------------------------------------------
    def _fire(self, events) -> None:
        for ev in events:
            self.engine.fire(ev)

    def launch(self, t: TaskDescriptor) -> None:
        HANDLERS[TASK_TYPES[t.task_type].handler](self, t)

    def on_stall(self, stalls: list[Stall]) -> bool:
        """No queue head is ready: wait for a receive that feeds one of them."""
        blocked = {int(s.job.wait) for s in stalls if isinstance(s.job.wait, int)}
        writes = self.plan.remote_writes
        feeding = [k for k in self.pending if blocked & set(writes[k].trigger_events)]
        if not feeding:
            raise RuntimeError(
                f"taskflow plan stalled on rank {self.me} waiting on events {sorted(blocked)} "
                "with no receive pending; the plan passed validation, so this is a bug"
            )
        self.complete_remote(feeding[0])
        return True

    def run(self) -> None:
        self.post_receives()
        self.trace = [cast(int, uid) for uid in self.engine.run().order]  # jobs keyed by uid
        for k in list(self.pending):
            self.complete_remote(k)
        for work, what in self.sends:
            self._wait(work, f"send of {what}")
        self.payloads.clear()


def _check_world_plan(plan: Plan, group: EPGroup) -> None:
    if plan.bucket.ep_size != group.size or plan.rank != group.rank:
        raise ValueError(
            f"plan is for rank {plan.rank} of {plan.bucket.ep_size}; this process is rank "
            f"{group.rank} of an expert-parallel group of {group.size}"
        )
    mine = group.control_tensor([int(plan.fingerprint[:15], 16)])
    every = group.all_gather_dim0(mine, what="taskflow plan fingerprints")
    if bool((every != mine).any()):
        raise ValueError(
            "the ranks of this group run plans compiled for different buckets or options "
            f"(fingerprints {[hex(int(v)) for v in every]})"
        )


def check_step(
    plan: Plan,
    group: EPGroup | None,
    timeout_s: float,
    direction: str,
    *,
    world_checked: bool = False,
) -> EPGroup:
    """Before a step of any executor: the direction, the plan validated (once per plan object)
    and, unless ``world_checked`` (the caller already ran this check for this plan on every
    rank at the same step), every rank of the group on a plan of the same world and direction
    (one all-gather); returns the group."""
    if plan.direction != direction:
        raise ValueError(
            f"plan is a {plan.direction} plan; run_{direction} needs a {direction} one"
        )
    ensure_validated(plan)  # never run an unvalidated plan; a validated one is checked once
    group = group or EPGroup(None, timeout_s)
    if not world_checked:
        _check_world_plan(plan, group)
    return group


def make_buffers(
    plan: Plan,
    inputs: dict[str, torch.Tensor],
    ref: torch.Tensor,
    work: Callable[[BufferSpec], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The step's buffers: the inputs (shape-checked, in ``ref``'s dtype) and the work and
    output buffers (``work(spec)``; default fresh zeros like ``ref``)."""
    bufs = {}
    for spec in plan.buffers:
        if spec.kind == "input":
            t = inputs[spec.name]
            t = t.reshape(spec.rows, spec.cols) if t.dim() == 3 else t
            if tuple(t.shape) != (spec.rows, spec.cols):
                raise ValueError(
                    f"{spec.name} has shape {tuple(t.shape)}; the plan needs "
                    f"({spec.rows}, {spec.cols})"
                )
            bufs[spec.name] = t.detach().to(ref.dtype).contiguous()
        elif work is not None:
            bufs[spec.name] = work(spec)
        else:
            bufs[spec.name] = ref.new_zeros(spec.rows, spec.cols)
    return bufs


def check_tagged_messages(ranks: int, backend: str) -> None:
    """This runtime posts every receive first and matches messages by tag: refuse a backend
    that ignores tags (NCCL pairs point-to-point messages by issue order per peer, so a tile
    would land in another tile's receive) before anything is posted."""
    if ranks > 1 and backend != "gloo":
        raise ValueError(
            f"the sequential taskflow runtime matches its {ranks} ranks' messages by tag, which "
            f"backend {backend!r} ignores (its receives, all posted first, would take other "
            "tiles): run it on CPU tensors (gloo), or use the taskflow strategy's runtime"
        )


def _execute(plan, inputs, routing, group, timeout_s, direction):
    ref = inputs["dy_TH" if direction == "backward" else "x_TH"]
    group = group or EPGroup(None, timeout_s)
    check_tagged_messages(group.size, group.backend_of(ref.device.type))
    group = check_step(plan, group, timeout_s, direction)
    bufs = make_buffers(plan, inputs, ref)
    route = step_routing(plan, routing, group)
    run = _Run(plan, bufs, route, group, timeout_s, ref.device)
    run.run()
    return bufs, run.trace


@dataclass(kw_only=True, slots=True)
class ForwardResult:
    """Output of a forward plan, the activations its backward plan needs, the executed order."""

    y_TH: torch.Tensor
    saved: dict[str, torch.Tensor]
    trace: list[int]
    route: StepRouting | None = None


@dataclass(kw_only=True, slots=True)
class BackwardResult:
    """Gradients from a backward plan (weight gradients of this rank's local experts)."""

    dx_TH: torch.Tensor
    dtopk_weights_TK: torch.Tensor
    dw1_eHF: torch.Tensor
    dw3_eHF: torch.Tensor | None
    dw2_eFH: torch.Tensor
    trace: list[int]

    @classmethod
    def from_buffers(
        cls, plan: Plan, bufs: dict[str, torch.Tensor], trace: list[int]
    ) -> BackwardResult:
        """The gradients in a backward plan's output buffers, shaped per expert."""
        b = plan.bucket
        e, H, F = b.local_experts, b.hidden, b.ffn
        return cls(
            dx_TH=bufs["dx_TH"],
            dtopk_weights_TK=bufs["dtopk_TK"],
            dw1_eHF=bufs["dw1"].view(e, H, F),
            dw3_eHF=bufs["dw3"].view(e, H, F) if "dw3" in bufs else None,
            dw2_eFH=bufs["dw2"].view(e, F, H),
            trace=trace,
        )


def expert_inputs(plan, w1_eHF, w2_eFH, w3_eHF):
    """The plan's weight inputs by buffer name (w3 required for a SwiGLU plan)."""
    ws = {"w1": w1_eHF, "w2": w2_eFH}
    if plan.bucket.activation == "swiglu":
        if w3_eHF is None:
            raise ValueError("w3_eHF is required for a SwiGLU plan")
        ws["w3"] = w3_eHF
    return ws


def run_forward(
    plan: Plan,
    x_TH: torch.Tensor,
    routing: RoutingPlan,
    w1_eHF: torch.Tensor,
    w2_eFH: torch.Tensor,
    w3_eHF: torch.Tensor | None = None,
    *,
    group: EPGroup | None = None,
    timeout_s: float = 60.0,
) -> ForwardResult:
    """Run a forward plan: the MoE-FFN output of this rank's tokens (no autograd graph).

    Args:
        plan: the forward plan of this rank (validated before it runs unless this plan object
            already passed ``check_plan``, e.g. on compile or load).
        x_TH: this rank's tokens.
        routing: this rank's dropless routing (``Router`` / ``build_plan`` with ``ep_size=P``).
        w1_eHF, w2_eFH, w3_eHF: this rank's local expert weights (w3 for SwiGLU only).
        group: the expert-parallel group (None: a single process).
        timeout_s: bound on every wait for a peer.
    """
    inputs = {"x_TH": x_TH, **expert_inputs(plan, w1_eHF, w2_eFH, w3_eHF)}
    bufs, trace = _execute(plan, inputs, routing, group, timeout_s, "forward")
    return ForwardResult(y_TH=bufs["y_TH"], saved={k: bufs[k] for k in SAVED}, trace=trace)


def run_backward(
    plan: Plan,
    dy_TH: torch.Tensor,
    routing: RoutingPlan,
    saved: dict[str, torch.Tensor],
    w1_eHF: torch.Tensor,
    w2_eFH: torch.Tensor,
    w3_eHF: torch.Tensor | None = None,
    *,
    group: EPGroup | None = None,
    timeout_s: float = 60.0,
) -> BackwardResult:
    """Run a backward plan: gradients of the tokens, the routing weights and the local experts.

    ``saved`` is ``ForwardResult.saved`` of the same step. The gradient of the routing weights
    lets the caller finish the router's backward with autograd
    (``topk_weights_TK.backward(dtopk_weights_TK)``).
    """
    inputs = {"dy_TH": dy_TH, **expert_inputs(plan, w1_eHF, w2_eFH, w3_eHF), **saved}
    bufs, trace = _execute(plan, inputs, routing, group, timeout_s, "backward")
    return BackwardResult.from_buffers(plan, bufs, trace)
