"""The end of every simulated training step: the health check's two tiny collectives, then the
optimizer.

Every schedule ends in ``TrainStep.finish`` (``moesaic.schedule.base``): the global gradient
norm and every rank's health flags (loss, aux loss, norm not finite) before the optimizer. How
they travel depends on the schedule:

* ``vanilla`` (and ``taskflow``, which runs under it): after the gradient all-reduce, the norm's
  one-float64 all-reduce over the expert-parallel group, then the flags' all-gather (3 values a
  rank), each blocking (``GradientSync.global_norm``, ``GradientSync.all_ranks``);
* the pipelined schedules (``moe-only``, ``flowmoe``): one all-gather of 3 values a rank (the
  unreduced gradients' squared norm and the two loss flags), issued when the backward ends and
  waited for while the last gradient all-reduce travels, on the world group
  (``_PipelinedStep._gather_early``); the reduced part of the norm needs no collective. That
  holds when every pooled gradient is reduced over all ranks or none, as at EP = world (every
  simulated run); with data-parallel replicas of the expert shards training falls back to
  vanilla's two calls, which this module does not price.

A tiny collective costs what one small call costs, the profile's measured all-reduce call
(``LinkModel.allreduce_call_s``), whatever its latency terms would say: traced inside training
on a 2-rank cluster (n+--+-, padded+vanilla, 8 steps) the norm's all-reduce took 0.6-6 ms
(median about 1.2) and the flags' all-gather 0.75-3 ms (about 1), where the calibrated call
was 0.9 ms. Before 2026-11-27 neither was priced. The norm's own compute stays in the
optimizer's price (``OpCal.optimizer``).
"""

from __future__ import annotations

from moesaic.sim.collectives import LinkModel, all_gather_s, all_reduce_s
from moesaic.sim.graph import SimGraph, SimTask

__all__ = ["FLAG_BYTES", "NORM_BYTES", "add_tail", "flags_s", "norm_s"]

NORM_BYTES = 8  # the expert shards' squared norm: one float64
FLAG_BYTES = 24  # a rank's [1, 3] flags (int64 under vanilla, float64 gathered early)
CONTROL = "control"  # the lane of the pipelined schedules' early gather (the world group)


def norm_s(link: LinkModel) -> float:
    """The norm's all-reduce: one float64 (the call floor, at least)."""
    return all_reduce_s(link, NORM_BYTES)


def flags_s(link: LinkModel) -> float:
    """The flags' all-gather, floored by the measured small call like an all-reduce."""
    return max(all_gather_s(link, FLAG_BYTES), link.allreduce_call_s)


def add_tail(
    g: SimGraph,
    link: LinkModel,
    lane: str,
    reduced: SimTask,
    optimizer_s: float,
    *,
    backward_end: SimTask | None = None,
) -> SimTask:
    """The health check and the optimizer after ``reduced`` (the last gradient all-reduce, on
    ``lane``). ``backward_end`` None: vanilla's blocking norm and flags on ``lane`` after it;
    else the pipelined schedules' early gather, issued on a lane of its own when
    ``backward_end`` ends, the optimizer waiting for it and for ``reduced``. Returns the
    optimizer's task."""
    optimizer = SimTask("optimizer", "optimizer", optimizer_s)
    if link.world_size < 2:
        return g.add("compute", optimizer, reduced)
    flags = SimTask("flags", "allreduce", flags_s(link), nbytes=FLAG_BYTES)
    if backward_end is None:
        norm = g.add(lane, SimTask("norm", "allreduce", norm_s(link), nbytes=NORM_BYTES), reduced)
        return g.add("compute", optimizer, g.add(lane, flags, norm))
    g.add(CONTROL, flags, backward_end)
    return g.add("compute", optimizer, (reduced, flags))
