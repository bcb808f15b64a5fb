"""The pipelined schedules: ``moe-only`` (Tutel/ScheMoE) and ``flowmoe`` (FlowMoE).

Both run the block pipeline of ``schedule/pipeline.py`` (R = ``StepParts.pipeline_degree``
chunks) and send their all-to-alls through a ``CommPool`` (``schedule/pool.py``):

* ``moe-only``: only the MoE layer is pipelined: each block's attention and gate run for every
  chunk before its first all-to-all, every combine completes before the next block starts, and
  the gradients are all-reduced after the backward (``reduce_in_backward=False``);
* ``flowmoe``: attention and gate are pipelined with the all-to-alls too (Eqs. 2-5), and the
  gradients leave in Sp-byte all-reduce chunks during the backward, in the gaps between
  all-to-alls (Alg. 2). Sp is ``StepParts.ar_chunk_bytes``, or tuned online (``SpTuner``: rank
  0 observes its step times, its choice is sent to every rank before each step).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moesaic.checks import check_positive_int
from moesaic.layer import is_expert_param
from moesaic.schedule.base import StepParts, StepResult, TrainStep
from moesaic.schedule.pipeline import BlockPipeline, check_degree
from moesaic.trace import Recorder, maybe_span

if TYPE_CHECKING:
    from moesaic.schedule.pool import CommPool
    from moesaic.schedule.tuner import SpTuner

__all__ = ["FlowMoEStep", "MoeOnlyStep"]

# Bounds of the tuned Sp, relative to the replicated gradients' bytes G: from G / 64 (many
# small chunks: more gaps filled, more per-collective latency) to G (one chunk per buffer).
# At least 4 KiB: below that a gloo all-reduce costs its latency, whatever its size.
TUNE_MIN_BYTES = 4096
TUNE_CHUNKS = 64


class _PipelinedStep(TrainStep):
    """A step that runs ``BlockPipeline`` and reduces gradients through a ``CommPool``."""

    def __init__(self, parts: StepParts) -> None:
        super().__init__(parts)
        self.degree = check_positive_int("pipeline_degree", parts.pipeline_degree)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.recorder = (
            parts.recorder if parts.recorder is not None else Recorder(self.rank, enabled=False)
        )
        self.pipeline = BlockPipeline(
            parts.model,
            degree=self.degree,
            overlap_attention=self.spec.overlaps_attention,
            recorder=parts.recorder,
            schedule=self.name,
        )
        self.tuner = None
        sp = parts.ar_chunk_bytes
        if sp is None:
            sp = self._default_chunk_bytes()
        self._pool: CommPool | None = None
        self._chunk_bytes = sp
        self._early: torch.Tensor | None = None  # the step's sums, from _gather_early

    @property
    def tuner(self) -> SpTuner | None:
        """The online Sp tuner (flowmoe without a given Sp), or None.

        Setting one (also after steps were run) starts its windows at the next step: every
        rank takes its ``current()`` then and after every ``iters_per_sample`` observed steps,
        so each of its samples is timed at its own Sp (counted from the last step before, a
        window would straddle two samples)."""
        return self._tuner

    @tuner.setter
    def tuner(self, tuner: SpTuner | None) -> None:
        self._tuner = tuner
        self._observed = 0  # steps observed since the tuner was set (the same on every rank)

    @property
    def pool(self) -> CommPool:
        """The communication pool, built on the first step (a collective: new process groups).

        It reduces every gradient but those of parameters FSDP2 shards (``DTensor``s,
        ``train/fsdp.py``): FSDP2 reduce-scatters those in the backward itself."""
        if self._pool is None:
            from moesaic.schedule.pool import CommPool

            self._pool = CommPool(
                grad_sync=self.parts.grad_sync,
                params=[p for p in self.params if not isinstance(p, DTensor)],
                chunk_bytes=self._chunk_bytes,
                recorder=self.recorder,
                timeout_s=self.pipeline.timeout_s,
                reduce_in_backward=self.spec.reduce_in_backward,
                a2a_groups=[
                    layer.exchange_strategy().exchange_group
                    for _, _, layer in self.pipeline.moe_blocks
                ],
            )
        return self._pool

    def _replicated_bytes(self) -> int:
        return sum(
            p.numel() * p.element_size()
            for p in self.params
            if p.requires_grad and not is_expert_param(p)
        )

    def _default_chunk_bytes(self) -> int:
        """Sp when not given: one chunk per gradient buffer (all of it after the backward)."""
        return max(TUNE_MIN_BYTES, sum(p.numel() * p.element_size() for p in self.params))

    def run(self, x_BT: torch.Tensor, y_BT: torch.Tensor) -> StepResult:
        check_degree(self.degree, x_BT.shape[0])
        t0 = time.perf_counter()
        pool = self.pool
        pool.chunk_bytes = self._next_chunk_bytes()
        pool.begin_step()
        ce, aux = self.pipeline.run(x_BT, y_BT, self.parts.loss_fn, pool)
        self._early = None
        pool.finish(while_waiting=lambda: self._gather_early(ce.detach(), aux.detach()))
        result = self.finish(ce, aux)
        self._observe(time.perf_counter() - t0)
        result.metrics["ar_chunk_bytes"] = float(pool.chunk_bytes)
        return result

    def _gather_early(self, ce: torch.Tensor, aux: torch.Tensor) -> None:
        """While the last all-reduce chunks travel: the squared norm of the gradients that are
        not reduced (expert shards without replicas: final but for the divisor) and the loss
        flags and statistics, in one all-reduce (``TrainStep.step_sums``; ``norm_and_sums``
        adds the reduced gradients' part). Only when every reduced gradient is reduced over
        all ranks (then equal on every rank); otherwise nothing here and
        ``TrainStep.norm_and_sums`` runs after the reduction."""
        sets = self.pool.reduction_sets()
        world = dist.get_world_size() if self.pool.active else 1
        if not sets:  # every gradient sharded (FSDP2): grad_sync.global_norm counts them
            return
        if any(1 < len(ranks) < world for ranks, _ in sets):
            return
        own = [p for ranks, params in sets if len(ranks) == 1 for p in params]
        with maybe_span(self.parts.recorder, "allreduce", "norm", part="unreduced"):
            self._early = self.step_sums(own, ce, aux, divided=False)

    def norm_and_sums(
        self, ce: torch.Tensor, aux: torch.Tensor
    ) -> tuple[float | torch.Tensor, torch.Tensor]:
        """The global norm from the early all-reduce (every rank's unreduced part) plus the
        reduced gradients' part (``TrainStep.norm_with``), with no collective left here."""
        early = self._early
        if early is None:
            return super().norm_and_sums(ce, aux)
        shared = [p for ranks, ps in self.pool.reduction_sets() if len(ranks) > 1 for p in ps]
        return self.norm_with(early, shared)

    def _next_chunk_bytes(self) -> int:
        return self._chunk_bytes

    def _observe(self, seconds: float) -> None:
        """Hook for the online tuner (flowmoe)."""

    def close(self) -> None:
        """Remove the pool's gradient hooks."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class MoeOnlyStep(_PipelinedStep):
    """Pipelining inside the MoE layer only (Tutel/ScheMoE); all-reduce after the backward."""

    name = "moe-only"


class FlowMoEStep(_PipelinedStep):
    """FlowMoE: attention, gate, all-to-alls and experts pipelined in R chunks, gradient
    all-reduce chunks of Sp bytes in the all-to-alls' gaps, Sp tuned online when not given."""

    name = "flowmoe"

    def __init__(self, parts: StepParts) -> None:
        super().__init__(parts)
        if parts.ar_chunk_bytes is None:
            from moesaic.schedule.tuner import SpTuner

            high = max(2 * TUNE_MIN_BYTES, self._replicated_bytes())
            low = max(TUNE_MIN_BYTES, high // TUNE_CHUNKS)
            self.tuner = SpTuner(low=low, high=high)
            self._chunk_bytes = self.tuner.current()

    def _next_chunk_bytes(self) -> int:
        """Rank 0's tuner decides; every rank takes its choice (one tiny all-gather), only
        where the choice can have changed: the tuner moves once per ``iters_per_sample``
        observed steps (``SpTuner.observe``), so the other steps keep the agreed Sp without a
        collective (5x fewer control-plane all-gathers at the default)."""
        if self.tuner is None or self._observed % self.tuner.iters_per_sample:
            return self._chunk_bytes
        mine = self.tuner.current() if self.rank == 0 else 0
        flags = self.parts.grad_sync.all_ranks(torch.tensor([[mine]], dtype=torch.int64))
        self._chunk_bytes = int(flags[0, 0])
        return self._chunk_bytes

    def _observe(self, seconds: float) -> None:
        self._observed += 1
        if self.tuner is not None and self.rank == 0:
            self.tuner.observe(seconds)
