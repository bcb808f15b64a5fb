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
   are finite on every rank (one all-gather of flags, so that all ranks take the same branch),
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
from moesaic.gradnorm import square_norm
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
    """

    model: nn.Module
    loss_fn: LossFn
    grad_sync: GradientSync
    optimizer: torch.optim.Optimizer
    grad_clip: float = 0.0
    pipeline_degree: int = 1
    ar_chunk_bytes: int | None = None
    recorder: Recorder | None = None

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
    """

    ce: torch.Tensor
    aux: torch.Tensor
    grad_norm: float
    nonfinite: tuple[str, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)

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

    def norm_and_flags(
        self, ce: torch.Tensor, aux: torch.Tensor
    ) -> tuple[float | torch.Tensor, torch.Tensor]:
        """The global gradient norm (a float, or a 0-d tensor that ``finish`` reads with the
        flags) and every rank's health flags ``[P, F]`` (``HEALTH_FLAGS``: loss, aux loss, norm
        not finite; ``finish`` sets the last from the norm); a schedule may compute them
        earlier (flowmoe).

        One collective where every gradient is summed over one rank or over all of them (the
        EP x DP layout at DP 1; ``group_of``): each rank's squared norm of its own gradients
        travels with its flags in the flags' all-gather (``unreduced_and_flags``), and the
        all-rank gradients, equal everywhere, are counted here (``norm_with``). Otherwise (DP
        replicas, FSDP2 shards) the gradient rules' ``global_norm`` and a second collective."""
        sets = self._reduction_sets()
        if sets is None:
            norm = self.parts.grad_sync.global_norm(self.params)
            local_F = torch.stack(
                [
                    ~torch.isfinite(ce),
                    ~torch.isfinite(aux),
                    torch.tensor(not math.isfinite(norm), device=ce.device),
                ]
            ).to(torch.int64)
            return norm, self.parts.grad_sync.all_ranks(local_F.view(1, -1))
        own, shared = sets
        return self.norm_with(self.unreduced_and_flags(own, ce, aux, divided=True), shared)

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

    def unreduced_and_flags(
        self, params: Sequence[torch.Tensor], ce: torch.Tensor, aux: torch.Tensor, *, divided: bool
    ) -> torch.Tensor:
        """Every rank's ``[squared norm of params' gradients, loss flag, aux flag]`` ``[P, 3]``
        in one all-gather (``divided``: the gradients are final; else not yet divided by the
        gradient rules' divisor, as the pool leaves them)."""
        local = torch.zeros((), dtype=torch.float64, device=ce.device)
        for p in params:
            if p.grad is not None:
                local += square_norm(p.grad)
        if not divided:
            local /= float(self.parts.grad_sync.divisor) ** 2
        flags = torch.stack(
            [local, (~torch.isfinite(ce)).double(), (~torch.isfinite(aux)).double()]
        )
        return self.parts.grad_sync.all_ranks(flags.view(1, -1))

    def norm_with(
        self, early_P3: torch.Tensor, shared: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global norm from ``unreduced_and_flags``' all-gather plus ``shared``'s
        gradients (equal on every rank: counted once), left on the device for ``finish``'s
        one read, and the flags ``[P, F]`` (the norm's column set by ``finish``)."""
        sq = early_P3[:, 0].sum()
        for p in shared:
            if p.grad is not None:
                sq = sq + square_norm(p.grad)
        bad_P = torch.zeros_like(early_P3[:, :1])
        return sq.sqrt(), torch.cat([early_P3[:, 1:], bad_P], dim=1).to(torch.int64)

    def finish(self, ce: torch.Tensor, aux: torch.Tensor) -> StepResult:
        """Steps 4 of the contract, after the gradients are synchronised: check, clip, update."""
        parts = self.parts
        ce, aux = ce.detach(), aux.detach()
        with maybe_span(parts.recorder, "allreduce", "norm"):  # norm + health flags
            norm_or_tensor, flags_PF = self.norm_and_flags(ce, aux)
        norm, flags = _read_norm_and_flags(norm_or_tensor, flags_PF)
        nonfinite = []
        for i, what in enumerate(HEALTH_FLAGS):
            ranks = [r for r, row in enumerate(flags) if row[i]]
            if what == "gradients" and not math.isfinite(norm):
                nonfinite.append(f"gradients (global norm {norm})")
            elif ranks:
                nonfinite.append(f"{what} on rank(s) {ranks}")
        if nonfinite:
            parts.optimizer.zero_grad(set_to_none=True)
            return StepResult(ce=ce, aux=aux, grad_norm=norm, nonfinite=tuple(nonfinite))
        with maybe_span(parts.recorder, "optimizer", "optimizer"):  # clip + update
            if parts.grad_clip > 0 and norm > parts.grad_clip:
                grads = [p.grad for p in self.params if p.grad is not None]
                torch._foreach_mul_(grads, parts.grad_clip / (norm + 1e-6))  # one multi-tensor op
            parts.optimizer.step()
            parts.optimizer.zero_grad(set_to_none=True)
        return StepResult(ce=ce, aux=aux, grad_norm=norm)


def _read_norm_and_flags(
    norm: float | torch.Tensor, flags_PF: torch.Tensor
) -> tuple[float, list[list[int]]]:
    """One host read of every rank's flags and, when still on the device, the norm (brought
    to the flags' device, the control plane's, first)."""
    if isinstance(norm, float):
        return norm, flags_PF.tolist()
    norm_1 = norm.detach().double().view(1).to(flags_PF.device)
    values = torch.cat([norm_1, flags_PF.flatten().double()]).tolist()
    P, F = flags_PF.shape
    return values[0], [[int(v) for v in values[1 + r * F : 1 + (r + 1) * F]] for r in range(P)]
