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
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

from moesaic.comm.collectives import EPGroup
from moesaic.config import MoEConfig
from moesaic.placement import ExpertPlacement
from moesaic.routing import RoutingPlan

if TYPE_CHECKING:
    from moesaic.cluster.spec import ClusterSpec

ExpertFn = Callable[[torch.Tensor, list[int]], torch.Tensor]

# What a strategy may declare in ``needs``: the fields of StrategyContext that must not be None.
NEEDS = ("topology", "plans")


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
        collectives: collectives the forward issued (the backward issues one all-to-all per
            forward all-to-all of rows); each costs at least one path latency on a network.
        peer_bytes_P: bytes sent to each rank of the group (0 for this rank): what a network
            model needs to see which links the traffic crosses.
    """

    dispatch_bytes: int = 0
    combine_bytes: int = 0
    meta_bytes: int = 0
    padded_rows: int = 0
    dropped_rows: int = 0
    collectives: int = 0
    peer_bytes_P: tuple[int, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.dispatch_bytes + self.combine_bytes + self.meta_bytes

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
        topology: the cluster description (HybridEP's cost model); None when not given.
        plans: compiled tile plans (the taskflow strategy); None when not given.
    """

    config: MoEConfig
    group: EPGroup
    placement: ExpertPlacement
    topology: ClusterSpec | None = None
    plans: Any = None


@dataclass(frozen=True, slots=True)
class StrategyOutput:
    """The combined output [T, H] and what this forward sent."""

    y_TH: torch.Tensor
    stats: CommStats


class MoEStrategy(ABC):
    """Moves routed tokens to the experts and their outputs back, combined.

    Subclasses set ``name`` (the registry key) and ``needs`` (which optional context fields,
    of ``NEEDS``, must be given) and implement ``forward``.
    """

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, ctx: StrategyContext) -> None:
        unknown = set(self.needs) - set(NEEDS)
        if unknown:
            raise TypeError(f"{type(self).__name__}.needs has unknown entries {sorted(unknown)}")
        self.ctx = ctx
        self.group = ctx.group
        self.placement = ctx.placement

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


HandleT = TypeVar("HandleT")


class DispatchCombineStrategy(MoEStrategy, Generic[HandleT]):
    """A strategy in three steps: ``dispatch`` rows, run the experts, ``combine`` them back.

    ``dispatch`` returns rows grouped by local expert, a typed handle (a frozen dataclass that
    ``combine`` needs) and the forward's statistics.
    """

    @abstractmethod
    def dispatch(
        self, x_TH: torch.Tensor, plan: RoutingPlan
    ) -> tuple[torch.Tensor, list[int], HandleT, CommStats]:
        """Returns ``(x_MH, counts_e, handle, stats)``: rows grouped by local expert."""

    @abstractmethod
    def combine(self, y_MH: torch.Tensor, handle: HandleT) -> torch.Tensor:
        """Expert outputs [M, H] -> the weighted sum per token [T, H]."""

    def forward(self, x_TH: torch.Tensor, plan: RoutingPlan, experts: ExpertFn) -> StrategyOutput:
        x_MH, counts_e, handle, stats = self.dispatch(x_TH, plan)
        y_MH = experts(x_MH, counts_e)
        return StrategyOutput(self.combine(y_MH, handle), stats)
