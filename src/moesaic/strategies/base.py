"""The MoE execution interface every strategy implements, and the statistics it reports.

Shape legend: T tokens on this rank, H hidden, E experts, e local experts, P ranks, N kept
assignments sent by this rank, M rows received for the local experts.

A strategy gets the routed tokens (``x_TH`` and its ``RoutingPlan``) and the local experts (a
callable ``experts(x_MH, counts_e) -> y_MH`` over rows grouped by local expert) and returns the
combined output ``y_TH`` plus the statistics of that forward. How rows move (padded or exact
all-to-alls, moving experts instead of tokens, fused tile tasks) is the strategy's business; the
layer only routes before and accumulates the statistics after.

Every strategy must issue the same collectives in the same order on every rank of the group,
including ranks with no tokens, forward and backward, so that no rank hangs its peers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

from moesaic.comm.collectives import EPGroup, all_to_all_v
from moesaic.config import MoEConfig
from moesaic.placement import ExpertPlacement
from moesaic.routing import RoutingPlan
from moesaic.schedule_table import schedule_spec, schedules_where
from moesaic.strategy_options import StrategyOptions

if TYPE_CHECKING:
    from moesaic.cluster.spec import ClusterSpec
    from moesaic.trace import Recorder

ExpertFn = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]


@dataclass(slots=True)
class CommStats:
    """What one or more forwards sent to other ranks (self-sends are not counted).

    Several forwards add up field by field (``a + b``), so a layer can report everything since
    its statistics were last read. ``sum(peer_bytes_P) == total_bytes`` always holds.

    Attributes:
        dispatch_bytes: token rows sent to the experts' ranks.
        combine_bytes: expert output rows sent back.
        meta_bytes: counts and other metadata.
        padded_rows: zero rows the experts computed on (padding to a capacity).
        dropped_rows: routed assignments dropped by the capacity.
            Both are ints, or 0-d int64 tensors on the device where counting them on the host
            would be a host sync (``padded`` with a capacity: how many rows a rank kept is
            known only on the device); ``int()`` reads them when wanted.
        expert_bytes: expert weights sent to other ranks (``hybrid``'s gathers, compressed
            bytes when compressed) and their gradients sent back to the owners.
        collectives: collectives the forward issued (the backward issues one all-to-all per
            forward all-to-all of rows); each costs at least one path latency on a network.
        peer_bytes_P: bytes sent to each rank of the group (0 for this rank): what a network
            model needs to see which links the traffic crosses.
    """

    dispatch_bytes: int = 0
    combine_bytes: int = 0
    meta_bytes: int = 0
    padded_rows: int | torch.Tensor = 0
    dropped_rows: int | torch.Tensor = 0
    expert_bytes: int = 0
    collectives: int = 0
    peer_bytes_P: tuple[int, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.dispatch_bytes + self.combine_bytes + self.meta_bytes + self.expert_bytes

    def __add__(self, other: CommStats) -> CommStats:
        if not isinstance(other, CommStats):
            return NotImplemented
        a, b = self.peer_bytes_P, other.peer_bytes_P
        if a and b and len(a) != len(b):
            raise ValueError(f"cannot add stats of groups of {len(a)} and {len(b)} ranks")
        peers = tuple(x + y for x, y in zip(a, b)) if a and b else (a or b)
        summed: dict[str, Any] = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name != "peer_bytes_P"
        }
        return CommStats(**summed, peer_bytes_P=peers)


@dataclass(frozen=True, slots=True)
class StrategyContext:
    """Everything a strategy may need, built once by the layer.

    Attributes:
        config: the layer config.
        group: the expert-parallel group (with its deadline).
        placement: which rank holds which expert.
        topology: the cluster description (HybridEP's levels); None when not given.
    """

    config: MoEConfig
    group: EPGroup
    placement: ExpertPlacement
    topology: ClusterSpec | None = None


@dataclass(frozen=True, slots=True)
class StrategyOutput:
    """The combined output [T, H] and what this forward sent."""

    y_TH: torch.Tensor
    stats: CommStats


@dataclass(frozen=True, slots=True)
class Supports:
    """What a strategy runs under, declared once (``MoEStrategy.supports``) and checked once,
    before any worker starts (``check``), and again by whatever builds a pipelined step.

    Attributes:
        pipelined: whether it runs under a pipelined schedule (``ScheduleSpec.pipelined``:
            one that issues the strategy's dispatch and combine itself, stage by stage);
            every schedule that is not pipelined runs it.
        capacity: whether it honours ``capacity_factor`` (dropping what overflows).
        why: the reason for what it does not support, for the refusal.
        unsharded_why: empty when it runs with FSDP2 sharding (``--dp-shard`` /
            ``--dp-replicate``, ``train/fsdp.py``: the experts' weights are all-gathered
            around each call of the layer's ``GroupedExperts`` module); else why it does not.
    """

    pipelined: bool = True
    capacity: bool = True
    why: str = ""
    unsharded_why: str = ""

    def runs_under(self, schedule: str) -> bool:
        """Whether it runs under ``schedule`` (a registered name)."""
        return self.pipelined or not schedule_spec(schedule).pipelined

    def check(
        self,
        strategy: str,
        *,
        schedule: str | None = None,
        capacity: bool = False,
        sharded: bool = False,
    ) -> None:
        """Refuse a combination this strategy does not support.

        Raises:
            ValueError: naming the strategy, the schedule or option, and why.
        """
        if sharded and self.unsharded_why:
            raise ValueError(
                f"strategy {strategy!r} does not run with FSDP sharding (--dp-shard, "
                f"--dp-replicate): {self.unsharded_why}"
            )
        because = f": {self.why}" if self.why else ""
        if schedule is not None and not self.runs_under(schedule):
            runs = ", ".join(schedules_where("pipelined", False))
            raise ValueError(
                f"strategy {strategy!r} does not run under schedule {schedule!r} (a pipelined "
                f"one; it runs under {runs}){because}"
            )
        if capacity and not self.capacity:
            raise ValueError(
                f"strategy {strategy!r} does not support capacity_factor (leave it unset){because}"
            )


class StrategyHooks:
    """What a strategy does at the points of a training run between forwards, for all of its
    layers in one model (:meth:`MoEStrategy.training_hooks` builds it). Every method is
    called on every rank at the same point, so a hook may issue collectives; all do nothing
    here.
    """

    def after_optimizer_step(self) -> None:
        """Right after each applied optimizer step (the weights just changed): ``hybrid``
        starts the next forwards' expert gathers here."""

    def before_evaluation(self) -> None:
        """Before the validation forwards (no gradient, the weights unchanged since the last
        step)."""

    def close(self) -> None:
        """At the end of the run: release threads and streams."""


class MoEStrategy(ABC):
    """Moves routed tokens to the experts and their outputs back, combined.

    Subclasses set ``name`` (the registry key) and ``supports`` and implement ``forward``.
    """

    name: ClassVar[str] = ""
    # Only the vanilla schedule: a pipelined one issues a strategy's row all-to-alls itself,
    # which needs its dispatch/combine phases (``DispatchCombineStrategy``).
    supports: ClassVar[Supports] = Supports(
        pipelined=False,
        why="it has no dispatch/combine phases for a pipelined schedule to run as stages",
    )
    # True when the strategy computes with the expert weights itself (moving them, or running
    # them in its own tile tasks): ``experts`` must be the layer's GroupedExperts.
    needs_expert_weights: ClassVar[bool] = False
    # True when the strategy cannot run without a cluster description (``ctx.topology``):
    # ``moesaic bench layer`` leaves it out unless given ``--cluster``.
    needs_topology: ClassVar[bool] = False
    # The class of its options (``MoEConfig.options``; ``moesaic.strategy_options``): none by
    # default. It lives in a torch-free module named by the strategy's registry entry too
    # (``moesaic.strategy_table``), so that a config is validated without importing torch;
    # ``get_strategy`` checks that the two agree.
    options_class: ClassVar[type[StrategyOptions]] = StrategyOptions

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.group = ctx.group
        self.placement = ctx.placement

    @property
    def routing_placement(self) -> ExpertPlacement:
        """The placement the layer routes by (its plans' ``counts_Pe`` and row order).

        The layer's own placement, unless the strategy sends tokens elsewhere than to the
        experts' owners (``hybrid`` routes over its all-to-all group to the ranks that hold
        gathered copies).
        """
        return self.placement

    # ---- lifecycle hooks: what a run asks of the strategy outside its forwards ---------------

    @classmethod  # noqa: B027 (a hook: nothing to refuse is the default, not abstract)
    def check_levels(cls, config: MoEConfig, level_sizes: tuple[int, ...]) -> None:
        """Refuse ``config`` on an expert-parallel group whose cluster levels have
        ``level_sizes`` (outermost first; one level of the group's size without a cluster
        description), before any worker starts. Nothing to refuse by default.

        Raises:
            ValueError: starting with the ``MoEConfig`` field at fault (the caller prefixes
                where it comes from, e.g. ``model.moe.``).
        """

    @classmethod
    def training_hooks(
        cls,
        layers: Sequence[tuple[MoEStrategy, ExpertFn]],
        *,
        recorder: Recorder | None = None,
    ) -> StrategyHooks:
        """The hooks of a training run for ``layers`` (this class's strategies of one model,
        in layer order, each with its layer's experts); ``recorder`` receives their spans.
        Hooks that do nothing by default."""
        return StrategyHooks()

    @classmethod
    def inference_config(cls, config: MoEConfig) -> MoEConfig:
        """The config of this strategy's layers in a model that one process holds whole (a
        checkpoint of any EP size loaded for inference): ``config`` itself by default."""
        return config

    @abstractmethod
    def forward(self, x_TH: torch.Tensor, plan: RoutingPlan, experts: ExpertFn) -> StrategyOutput:
        """Run the experts on the routed tokens; returns ``y_TH`` (same dtype as the experts)."""

    # ---- helpers for the accounting every strategy does -------------------------------------

    def peer_bytes(self, sent_P: list[int], received_P: list[int], row_bytes: int) -> list[int]:
        """Bytes to each peer when rows go out as ``sent_P`` and come back as ``received_P``."""
        me = self.group.rank
        return [
            0 if p == me else (s + r) * row_bytes
            for p, (s, r) in enumerate(zip(sent_P, received_P))
        ]

    def off_rank(self, rows_P: list[int]) -> int:
        """Rows of a per-rank split that leave this rank."""
        return sum(rows_P) - rows_P[self.group.rank]

    def to_every_peer(self, nbytes: int) -> list[int]:
        """``nbytes`` to each other rank (a small all-to-all or all-reduce of metadata)."""
        return [0 if p == self.group.rank else nbytes for p in range(self.group.size)]


@dataclass(frozen=True, slots=True)
class ExchangeHandle:
    """What every dispatch/combine strategy's handle holds: the plan and the row splits.

    Attributes:
        plan: the routing plan of the dispatched tokens.
        in_splits_P: rows this rank sent to each rank (the dispatch all-to-all's input splits).
        out_splits_P: rows this rank received from each rank (its output splits).
    """

    plan: RoutingPlan
    in_splits_P: list[int]
    out_splits_P: list[int]

    def splits(self, kind: str, forward: bool) -> tuple[list[int], list[int]]:
        """``(send_P, recv_P)``: rows this rank sends to and receives from each rank of the
        exchange group in the ``kind`` all-to-all (``"dispatch"`` or ``"combine"``), of rows
        (``forward``) or of their gradients (the other way).

        The dispatch sends ``in_splits_P`` and receives ``out_splits_P``; the combine and the
        gradient of the dispatch swap them; the gradient of the combine swaps them back.
        """
        if kind not in EXCHANGE_KINDS:
            raise ValueError(f"kind must be one of {EXCHANGE_KINDS}, got {kind!r}")
        if (kind == "dispatch") == forward:
            return self.in_splits_P, self.out_splits_P
        return self.out_splits_P, self.in_splits_P


EXCHANGE_KINDS = ("dispatch", "combine")


@dataclass(frozen=True, slots=True)
class ExpertRun:
    """The experts that compute a phase strategy's rows, prepared once for one or more forwards.

    Attributes:
        fn: ``fn(x_MH, counts_e) -> y_MH`` over the received rows grouped by local expert.
        stats: what preparing them sent (``hybrid``'s expert gathers; nothing by default).
        finish_backward: for a pipelined step, the call that completes the backward of the
            experts once every chunk's expert stage has run its own (``hybrid``: the gathered
            copies' gradients reduced to their owners once, not once per chunk); None when
            the chunks' backward already reaches the parameters.
        wait: for a pipelined step, completes what preparing started (``hybrid``: waits for
            the gathers it issued); the schedule calls it before the block's first expert
            stage, so the stages before it overlap the transfer. None: ready at once.
    """

    fn: ExpertFn
    stats: CommStats = field(default_factory=CommStats)
    finish_backward: Callable[[], None] | None = None
    wait: Callable[[], None] | None = None


HandleT = TypeVar("HandleT", bound=ExchangeHandle)


@dataclass(frozen=True, slots=True)
class Outbound(Generic[HandleT]):
    """The local half of a dispatch, before the row all-to-all.

    Attributes:
        rows: the rows to send ``[sum(handle.in_splits_P), H]``, in destination-rank order.
        handle: what the later phases need.
        stats: the forward's communication (dispatch and combine).
    """

    rows: torch.Tensor
    handle: HandleT
    stats: CommStats


class DispatchCombineStrategy(MoEStrategy, Generic[HandleT]):
    """A strategy in three steps: ``dispatch`` rows, run the experts, ``combine`` them back.

    Each step that communicates is cut at its row all-to-all into phases, so that a pipelined
    schedule can issue the all-to-alls itself (asynchronously) and run the phases as separate
    stages; ``dispatch`` and ``combine`` are exactly the phases around a blocking all-to-all:

    * ``dispatch_send(x_TH, plan) -> Outbound``: the rows to send and their splits (any small
      metadata exchange, e.g. the counts, happens here, synchronously);
    * the dispatch all-to-all: ``in_splits_P`` rows out, ``out_splits_P`` rows in;
    * ``dispatch_recv(rows, handle) -> (x_MH, counts_e)``: rows grouped by local expert;
    * the experts;
    * ``combine_send(y_MH, handle)``: the expert outputs in the received rows' order;
    * the combine all-to-all (splits swapped);
    * ``combine_recv(rows, handle) -> y_NH``: the outputs in the plan's row order, which
      ``plan.unpermute`` weights and sums per token.
    """

    supports: ClassVar[Supports] = Supports()  # every schedule runs the phases
    dispatch_what: ClassVar[str] = "dispatch all_to_all_v"
    combine_what: ClassVar[str] = "combine all_to_all_v"

    @property
    def exchange_group(self) -> EPGroup:
        """The group the row all-to-alls run on (the expert-parallel group unless the strategy
        exchanges rows over a subgroup, as ``hybrid`` does over its offset group); the handles'
        splits have one entry per rank of it."""
        return self.group

    def prepare_experts(self, experts: ExpertFn, *, pipelined: bool = False) -> ExpertRun:
        """The experts that compute the rows ``dispatch_recv`` returns: the layer's own by
        default. A pipelined schedule calls this once per step before its first stage
        (``pipelined=True``: the R chunks of the step share the result and the schedule calls
        ``finish_backward`` after the last chunk's expert backward); the vanilla ``forward``
        calls it once per forward."""
        # the stats given, not left to the field's default_factory: Dynamo failed to trace
        # that factory call inside a compiled layer (a graph break)
        return ExpertRun(experts, CommStats())

    @abstractmethod
    def dispatch_send(self, x_TH: torch.Tensor, plan: RoutingPlan) -> Outbound[HandleT]:
        """The rows to send, their splits and the statistics (before the row all-to-all)."""

    @abstractmethod
    def dispatch_recv(
        self, rows: torch.Tensor, handle: HandleT
    ) -> tuple[torch.Tensor, Sequence[int]]:
        """Received rows -> ``(x_MH, counts_e)``: rows grouped by local expert."""

    @abstractmethod
    def combine_send(self, y_MH: torch.Tensor, handle: HandleT) -> torch.Tensor:
        """Expert outputs [M, H] -> the rows to send back (the received rows' order)."""

    @abstractmethod
    def combine_recv(self, rows: torch.Tensor, handle: HandleT) -> torch.Tensor:
        """Rows received back -> ``y_NH``, the outputs in the plan's (expert-grouped) order."""

    def dispatch(
        self, x_TH: torch.Tensor, plan: RoutingPlan
    ) -> tuple[torch.Tensor, Sequence[int], HandleT, CommStats]:
        """Returns ``(x_MH, counts_e, handle, stats)``: rows grouped by local expert."""
        out = self.dispatch_send(x_TH, plan)
        h = out.handle
        send, recv = h.splits("dispatch", forward=True)
        rows = all_to_all_v(out.rows, self.exchange_group, send, recv, self.dispatch_what)
        x_MH, counts_e = self.dispatch_recv(rows, h)
        return x_MH, counts_e, h, out.stats

    def combine(self, y_MH: torch.Tensor, handle: HandleT) -> torch.Tensor:
        """Expert outputs [M, H] -> the weighted sum per token [T, H]."""
        rows = self.combine_send(y_MH, handle)
        send, recv = handle.splits("combine", forward=True)
        rows = all_to_all_v(rows, self.exchange_group, send, recv, self.combine_what)
        return handle.plan.unpermute(self.combine_recv(rows, handle))

    def forward(self, x_TH: torch.Tensor, plan: RoutingPlan, experts: ExpertFn) -> StrategyOutput:
        run = self.prepare_experts(experts)
        x_MH, counts_e, handle, stats = self.dispatch(x_TH, plan)
        y_MH = run.fn(x_MH, counts_e)
        return StrategyOutput(self.combine(y_MH, handle), run.stats + stats)
