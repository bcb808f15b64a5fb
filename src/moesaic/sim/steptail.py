"""The end of every simulated training step: the step's control collective, then the optimizer.

Every schedule ends in ``TrainStep.finish`` (``moesaic.schedule.base``): the global gradient
norm, every rank's health flags (loss, aux loss not finite) and the loop's statistics (loss,
aux loss, each MoE layer's expert loads) summed over every rank in **one all-reduce**
(``TrainStep.step_sums``, :func:`control_bytes` of float64), read once before the optimizer.
Where it travels depends on the schedule:

* ``vanilla`` (and ``taskflow``, which runs under it): after the gradient all-reduce, blocking;
* the pipelined schedules (``moe-only``, ``flowmoe``): issued when the backward ends, with the
  unreduced gradients' part of the norm, and waited for while the last gradient all-reduce
  travels, on the world group (``_PipelinedStep._gather_early``, lane ``CONTROL``);
* under FSDP2 sharding the gradient rules' own norm first (``GradientSync.global_norm``, a
  collective of its own), then the sums: two calls in turn.

It is priced as one all-reduce issued alone (:func:`control_s`): its closed form, at least the
profile's measured alone call (``allreduce_alone_call_s``, ``calibrate --cluster``), else the
stream's call. Alone, each exchange of gloo's ring waits for its receiver's ready message
before the data travel, which a stream's next call hides: on w32a's cluster (3 ranks, 4 ms)
one call alone took 38.7 ms against 17.8 ms a call in a stream, on w32c's (8 ranks on 2 cores
across a 1.2 ms link) 41.6 against 7.7, and traced inside training the step's collective
(``"norm"``) took 36.6 and 35-49 ms there (``benchmarks/results/sim_alone_calls.json``, rule
32's traces). Until 2026-12-05 the tail was priced as two calls of the stream (a norm all-reduce
and a flags all-gather, as training ran them before 2026-12-03): 16 ms on both clusters. The
norm's own compute stays in the optimizer's price (``OpCal.optimizer``).
"""

from __future__ import annotations

from moesaic.sim.collectives import LinkModel, all_reduce_s
from moesaic.sim.graph import SimGraph, SimTask

__all__ = ["CONTROL", "add_tail", "control_bytes", "control_s"]

CONTROL = "control"  # the lane of the pipelined schedules' early collective (the world group)
# float64 values of the control collective beside the experts' loads: the unreduced norm's
# square, the loss and aux-loss flags, the loss and the aux loss (``TrainStep.step_sums``)
CONTROL_HEAD = 5
NORM_BYTES = 8  # FSDP2's own norm: one float64


def control_bytes(layers: int, experts: int) -> int:
    """Bytes of the step's control all-reduce: the five head values and each MoE layer's
    expert loads, float64 (layers with a score bias add their loads again, not priced)."""
    return 8 * (CONTROL_HEAD + layers * experts)


def control_s(link: LinkModel, nbytes: float) -> float:
    """One all-reduce of ``nbytes`` issued alone: its closed form, at least the measured alone
    call (module docstring)."""
    return max(all_reduce_s(link, nbytes), link.allreduce_alone_call_s)


def add_tail(
    g: SimGraph,
    link: LinkModel,
    lane: str,
    reduced: SimTask,
    optimizer_s: float,
    *,
    nbytes: int,
    backward_end: SimTask | None = None,
    own_norm: bool = False,
) -> SimTask:
    """The control collective of ``nbytes`` and the optimizer after ``reduced`` (the last
    gradient all-reduce, on ``lane``). ``backward_end`` None: blocking on ``lane`` after it;
    else issued on a lane of its own when ``backward_end`` ends, the optimizer waiting for it
    and for ``reduced``. ``own_norm``: FSDP2's norm all-reduce first, on ``lane``. Returns the
    optimizer's task."""
    optimizer = SimTask("optimizer", "optimizer", optimizer_s)
    if link.world_size < 2:
        return g.add("compute", optimizer, reduced)
    sums = SimTask("norm", "allreduce", control_s(link, nbytes), nbytes=nbytes)
    if own_norm:
        norm = SimTask("gnorm", "allreduce", control_s(link, NORM_BYTES), nbytes=NORM_BYTES)
        reduced = g.add(lane, norm, reduced)
        backward_end = None  # the sums wait for the norm
    if backward_end is None:
        return g.add("compute", optimizer, g.add(lane, sums, reduced))
    g.add(CONTROL, sums, backward_end)
    return g.add("compute", optimizer, (reduced, sums))
