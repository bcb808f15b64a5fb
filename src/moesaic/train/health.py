"""Training health: non-finite steps, non-finite weights, and metrics that stay valid JSON.

A step whose loss, aux loss or gradients are not finite on any rank is never applied (see
``moesaic.schedule.base.TrainStep.finish``; every rank takes the same branch). The run then
stops with ``NonFiniteError`` (``on_nonfinite = "stop"``, the default) or goes on without that
update (``"skip"``, at most ``nonfinite_skip_limit`` steps in a row). Either way the
parameters stay finite, so checkpoints are only ever written from finite weights (and
``save_checkpoint`` refuses non-finite ones anyway); a stopped run keeps the checkpoints it had.
``metrics.jsonl`` records such a step with ``null`` for the non-finite numbers and a
``nonfinite`` list saying what and where.
"""

from __future__ import annotations


class NonFiniteError(ArithmeticError):
    """Training produced a non-finite loss, gradient or parameter (the run diverged)."""


def nonfinite_message(step: int, nonfinite: tuple[str, ...], *, skipped_in_a_row: int = 0) -> str:
    """The error of a run stopped by a non-finite step: the step, what, where, what to try.

    ``skipped_in_a_row`` > 0: the run skipped that many steps in a row (``on_nonfinite =
    "skip"``) and reached ``nonfinite_skip_limit``.
    """
    what = ", ".join(nonfinite)
    if skipped_in_a_row:
        why = f"{skipped_in_a_row} steps in a row were skipped (nonfinite_skip_limit)"
        hint = "lower --lr or set --grad-clip"
    else:
        why = "stopped before applying it (on_nonfinite = stop)"
        hint = "lower --lr, set --grad-clip, or pass --on-nonfinite skip"
    return (
        f"training diverged at step {step}: {what} not finite; {why}. Checkpoints already "
        f"written are intact; {hint}"
    )
