"""The training-step interface: one optimizer step as a replaceable object.

Shape legend: B sequences, T positions, V vocabulary, P ranks, F health flags.

Every schedule does, for this rank's batch:

1. the forward(s): ``vanilla`` runs the whole batch at once; FlowMoE's block pipeline will cut
   it into R microbatch chunks and interleave the blocks' ``attention_stage`` and
   ``expert_stage`` (``models/gpt.py``) across chunks;
2. ``moesaic.aux_loss(model)`` exactly once per backward, after every forward that backward
   covers. The MoE layers add up each forward's aux loss until it is read, and reading resets
   it, so one read per backward gives that backward the aux loss of all its forwards (never a
   layer's ``aux_loss`` attribute, which would be one chunk's);
3. the backward and the gradient synchronisation through ``parts.grad_sync``: all at once after
   the backward (``grad_sync.sync``), or parameter by parameter as gradients become ready (a
   post-accumulate-grad hook per parameter feeding a chunked all-reduce pool: ``group_of(p)``
   says over which ranks ``p``'s gradient is summed, ``divisor`` by what it is then divided);
4. ``finish``: the global gradient norm, a check that the loss, the aux loss and the gradients
   are finite on every rank (one all-reduce of the flags, with the norm's parts and the
   caller's statistics, so that all ranks take the same branch: ``step_sums``),
   then clipping and the optimizer step, or no update at all when something was non-finite.
   What to do about a non-finite step (stop, skip) is the caller's policy, not the schedule's.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from torch import nn

from moesaic.checks import check_int, check_non_negative, check_positive_int
from moesaic.comm.collectives import EPGroup
from moesaic.gradnorm import square_norm_sum
from moesaic.schedule_table import ScheduleSpec, schedule_spec
from moesaic.trace import Recorder, maybe_span

# (logits_BTV, y_BT) -> the scalar mean loss of those tokens. A schedule that cuts the batch
# into R equal chunks weighs each chunk's loss by 1 / R, so the step's loss is unchanged.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

HEALTH_FLAGS = ("loss", "aux_loss", "gradients")


class GradientSync(Protocol):
    """How gradients are combined across ranks (``moesaic.train.parallel.GradientSync``).

    A schedule that reduces gradients itself (per parameter, while the backward runs) must sum
    ``p.grad`` over ``group_of(p)`` and divide by ``divisor`` for every parameter, including one
    whose gradient never arrived on this rank (reduce zeros): every rank must issue the same
    collectives in the same order, or a peer waits until the deadline.
    """

    @property
    def divisor(self) -> int:
        """What a summed gradient is divided by (the world size: the loss is a mean of ranks)."""
        ...

    def group_of(self, param: torch.Tensor) -> EPGroup:
        """The group over which ``param``'s gradient is summed."""
        ...

    def sync(self, params: Sequence[torch.Tensor]) -> None:
        """Sum and divide every gradient of ``params`` at once (after the whole backward)."""
        ...

    def global_norm(self, params: Sequence[torch.Tensor]) -> float:
        """The global gradient norm after ``sync``; the same float on every rank."""
        ...

    def all_ranks(self, flags_F: torch.Tensor) -> torch.Tensor:
        """Every rank's ``flags_F``, stacked in rank order ``[P, F]`` (a collective)."""
        ...

    def sum_ranks(self, values_N: torch.Tensor) -> torch.Tensor:
        """``values_N`` summed over every rank, on the control plane (a collective)."""
        ...


# (ce, aux) -> a float64 vector of this rank's figures of the step (the training loop's loss,
# aux loss and expert loads), summed over every rank with the health flags in one collective
StatisticsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(kw_only=True, slots=True)
class StepParts:
    """What a schedule works on, fixed for a run.

    Attributes:
        model: maps ``x_BT`` to ``logits_BTV``; its MoE layers' aux loss is read through
            ``moesaic.aux_loss(model)``.
        loss_fn: ``(logits_BTV, y_BT) -> scalar`` mean loss (see ``LossFn``).
        grad_sync: the gradient rules of this rank's layout.
        optimizer: stepped once per step unless the step was non-finite.
        grad_clip: clip the global gradient norm to this before the update (0 = off).
        pipeline_degree: R, the chunks a pipelined schedule cuts this rank's batch into along
            the batch dimension (``--pipeline-degree``; must divide the batch; ``vanilla``
            runs the whole batch at once and needs 1).
        ar_chunk_bytes: Sp, the size of the gradient all-reduce chunks of the communication
            pool (``--ar-chunk``); None = tuned online.
        recorder: where the schedule records its tasks' spans (``moesaic.trace``); None = no
            timeline.
        statistics: called once per step after its forwards (``StatisticsFn``); its vector
            travels with the health flags and comes back summed over the ranks in
            ``StepResult.statistics`` (None: nothing).
    """

    model: nn.Module
    loss_fn: LossFn
    grad_sync: GradientSync
    optimizer: torch.optim.Optimizer
    grad_clip: float = 0.0
    pipeline_degree: int = 1
    ar_chunk_bytes: int | None = None
    recorder: Recorder | None = None
    statistics: StatisticsFn | None = None

    def __post_init__(self) -> None:
        check_non_negative("grad_clip", self.grad_clip)
        check_int("pipeline_degree", self.pipeline_degree, 1)
        if self.ar_chunk_bytes is not None:
            check_positive_int("ar_chunk_bytes", self.ar_chunk_bytes)


@dataclass(kw_only=True, slots=True)
class StepResult:
    """What one step did.

    Attributes:
        ce: this rank's loss (detached; the mean over its tokens).
        aux: this rank's aux loss, summed over the step's forwards (detached).
        grad_norm: global gradient norm before clipping (same on every rank; may be nan/inf).
        nonfinite: what was not finite, on which ranks (e.g. ``"loss on rank(s) [1]"``); empty
            when the step was applied. The same on every rank.
        metrics: schedule-specific figures for the metrics file (e.g. overlap ratios).
        statistics: ``StepParts.statistics``' vector summed over every rank, read on the host
            (empty without it).
    """

    ce: torch.Tensor
    aux: torch.Tensor
    grad_norm: float
    nonfinite: tuple[str, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    statistics: list[float] = field(default_factory=list)

    @property
    def applied(self) -> bool:
        """True when the optimizer updated the parameters."""
        return not self.nonfinite


class TrainStep(ABC):
    """One optimizer step of a schedule (see the module docstring for the contract).

    Args:
        parts: the model, loss, gradient rules and optimizer of the run.
    """

    # The schedule's name in ``moesaic.schedule_table``, where its traits are declared.
    name: ClassVar[str]

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self.params = list(parts.model.parameters())

    @property
    def spec(self) -> ScheduleSpec:
        """This schedule's traits (``moesaic.schedule_table``)."""
        return schedule_spec(self.name)

    @abstractmethod
    def run(self, x_BT: torch.Tensor, y_BT: torch.Tensor) -> StepResult:
        """Forward, backward, synchronise and (if all is finite) update on this rank's batch."""

    def norm_and_sums(
        self, ce: torch.Tensor, aux: torch.Tensor
    ) -> tuple[float | torch.Tensor, torch.Tensor]:
        """The global gradient norm (a float, or a 0-d tensor that ``finish`` reads with the
        sums) and the step's sums over every rank ``[_SUMS + statistics]`` (``step_sums``); a
        schedule may compute them earlier (flowmoe).

        One collective where every gradient is summed over one rank or over all of them (the
        EP x DP layout at DP 1; ``group_of``): each rank's squared norm of its own gradients
        is summed with the flags and the statistics, and the all-rank gradients, equal
        everywhere, are counted here (``norm_with``). Otherwise (DP replicas, FSDP2 shards)
        the gradient rules' ``global_norm`` first, a collective of its own."""
        sets = self._reduction_sets()
        if sets is None:
            norm = self.parts.grad_sync.global_norm(self.params)
            return norm, self.step_sums([], ce, aux, divided=True)
        own, shared = sets
        return self.norm_with(self.step_sums(own, ce, aux, divided=True), shared)

    def _reduction_sets(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """This step's parameters whose gradient is summed over this rank alone and over every
        rank; None when some are summed over other sets (or not per parameter)."""
        sync = self.parts.grad_sync
        try:
            groups = [sync.group_of(p) for p in self.params]
        except NotImplementedError:  # sharded: FSDP2 reduces them
            return None
        world = max((g.size for g in groups), default=1)
        if any(1 < g.size < world for g in groups):
            return None
        own: list[torch.Tensor] = [p for p, g in zip(self.params, groups) if g.size == 1]
        shared: list[torch.Tensor] = [p for p, g in zip(self.params, groups) if g.size > 1]
        return own, shared

    def step_sums(
        self, params: Sequence[torch.Tensor], ce: torch.Tensor, aux: torch.Tensor, *, divided: bool
    ) -> torch.Tensor:
        """Summed over every rank in one all-reduce: the squared norm of ``params``' gradients
        (each rank's own), the ranks whose loss and aux loss are not finite (``_SUMS``), then
        ``StepParts.statistics`` (called here, once per step). ``divided``: the gradients are
        final; else not yet divided by the gradient rules' divisor, as the pool leaves them."""
        grads = [p.grad for p in params if p.grad is not None]
        local = square_norm_sum(grads, ce.device)
        if not divided:
            local /= float(self.parts.grad_sync.divisor) ** 2
        parts = [local.view(1), _bad(ce).view(1), _bad(aux).view(1)]
        if self.parts.statistics is not None:
            parts.append(self.parts.statistics(ce, aux).to(local.device, torch.float64))
        return self.parts.grad_sync.sum_ranks(torch.cat(parts))

    def norm_with(
        self, sums: torch.Tensor, shared: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global norm from ``step_sums``' squared norm plus ``shared``'s gradients (equal
        on every rank: counted once), left on the device for ``finish``'s one read; the sums."""
        grads = [p.grad for p in shared if p.grad is not None]
        sq = sums[0] + square_norm_sum(grads, grads[0].device) if grads else sums[0]
        return sq.sqrt(), sums

    def _nonfinite_ranks(self, ce: torch.Tensor, aux: torch.Tensor) -> list[list[int]]:
        """Which ranks' loss and aux loss were not finite ``[P][2]`` (a collective, only on a
        step every rank knows to be non-finite)."""
        local = torch.stack([_bad(ce), _bad(aux)]).to(torch.int64).view(1, -1)
        return self.parts.grad_sync.all_ranks(local).tolist()

    def finish(self, ce: torch.Tensor, aux: torch.Tensor) -> StepResult:
        """Steps 4 of the contract, after the gradients are synchronised: check, clip, update."""
        parts = self.parts
        ce, aux = ce.detach(), aux.detach()
        with maybe_span(parts.recorder, "allreduce", "norm"):  # norm + health flags
            norm_or_tensor, sums = self.norm_and_sums(ce, aux)
        norm, values = _read_norm_and_sums(norm_or_tensor, sums)
        statistics = values[_SUMS:]
        nonfinite = []
        if values[1] or values[2]:  # some rank's loss or aux loss: which (every rank asks)
            flags = self._nonfinite_ranks(ce, aux)
            for i, what in enumerate(HEALTH_FLAGS[:2]):
                ranks = [r for r, row in enumerate(flags) if row[i]]
                if ranks:
                    nonfinite.append(f"{what} on rank(s) {ranks}")
        if not math.isfinite(norm):
            nonfinite.append(f"gradients (global norm {norm})")
        if nonfinite:
            parts.optimizer.zero_grad(set_to_none=True)
            return StepResult(
                ce=ce, aux=aux, grad_norm=norm, nonfinite=tuple(nonfinite), statistics=statistics
            )
        with maybe_span(parts.recorder, "optimizer", "optimizer"):  # clip + update
            if parts.grad_clip > 0 and norm > parts.grad_clip:
                grads = [p.grad for p in self.params if p.grad is not None]
                torch._foreach_mul_(grads, parts.grad_clip / (norm + 1e-6))  # one multi-tensor op
            parts.optimizer.step()
            parts.optimizer.zero_grad(set_to_none=True)
        return StepResult(ce=ce, aux=aux, grad_norm=norm, statistics=statistics)


# step_sums' leading entries: squared norm, ranks with a non-finite loss, with a non-finite aux
_SUMS = 3


def _bad(t: torch.Tensor) -> torch.Tensor:
    return (~torch.isfinite(t)).to(torch.float64)


def _read_norm_and_sums(norm: float | torch.Tensor, sums: torch.Tensor) -> tuple[float, list]:
    """One host read of the step's sums and, when still on the device, the norm (brought to
    the sums' device, the control plane's, first)."""
    if isinstance(norm, float):
        return norm, sums.tolist()
    values = torch.cat([norm.detach().double().view(1).to(sums.device), sums]).tolist()
    return values[0], values[1:]
