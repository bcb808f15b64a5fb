"""A profile's compute re-timed to the machine's speed now (``moesaic simulate --retime``,
``moesaic plan --retime``).

A profile prices compute at the machine's speed while ``calibrate`` ran. A shared or
virtualised machine does not keep one speed: this project's 2-core VM ran the same 512^3 GEMM
at 145 to 300 GFLOPS within a day, and its model's operations at up to 1.8x their calibrated
times an hour later (``benchmarks/results/sim_unseen17_setup.json``). ``calibrate --model``
therefore also times a speed reference beside the operations (``OpCal.reference_s``: one
forward and backward of the model's block and head, :func:`moesaic.measure.opmeasure.reference_s`).
:func:`retime` times the same reference now and returns the profile slowed (or sped up) by
the ratio (:meth:`Profile.slowed`): its compute and CPU figures, not its network's.

It is one ratio for every operation: the reference mixes the model's GEMMs, attention and
small ops as a step does, so a machine that slowed unevenly (its GEMMs more than its small
ops) is rescaled by their mix, not per operation. On a GPU the device's speed does not drift
this way; a CUDA profile is refused.
"""

from __future__ import annotations

from typing import Any

from moesaic.checks import check_positive_int

__all__ = ["check_retimable", "retime", "speed_factor"]


def check_retimable(profile: Any) -> None:
    """Refuses a profile that cannot be re-timed, saying why: a GPU's, or one without a speed
    reference (measured before ``calibrate --model`` recorded one)."""
    if profile.device != "cpu":
        raise ValueError(
            f"--retime re-times a CPU profile; this one was measured on {profile.device!r} "
            "(a GPU's speed does not drift as a shared CPU's does)"
        )
    if profile.ops is None or profile.ops.reference_s <= 0:
        raise ValueError(
            "--retime needs a profile with a speed reference (profile.ops.reference_s > 0), "
            "which `moesaic calibrate --model` records since it was added; calibrate again"
        )


def speed_factor(profile: Any, reference_now_s: float) -> float:
    """How many times slower the machine runs than when ``profile`` was measured, from its
    reference timed now (``reference_now_s``)."""
    check_retimable(profile)
    if reference_now_s <= 0:
        raise ValueError(f"reference_now_s ({reference_now_s}) must be > 0")
    return reference_now_s / profile.ops.reference_s


def retime(profile: Any, *, repeats: int | None = None) -> tuple[Any, float]:
    """``(profile at the machine's speed now, factor)``: the reference of the profile's model
    timed here with its threads (``repeats`` calls, by default
    ``opmeasure.REFERENCE_REPEATS``, the median), ``factor`` = now / then."""
    from moesaic.measure.opmeasure import REFERENCE_REPEATS, reference_s

    repeats = REFERENCE_REPEATS if repeats is None else repeats
    check_positive_int("repeats", repeats)
    check_retimable(profile)  # before timing anything
    now = reference_s(profile.ops.model, threads=profile.ops.threads, repeats=repeats)
    factor = speed_factor(profile, now)
    why = f"reference {now * 1e3:.1f} ms now, {profile.ops.reference_s * 1e3:.1f} ms measured"
    return profile.slowed(factor, why=why), factor
