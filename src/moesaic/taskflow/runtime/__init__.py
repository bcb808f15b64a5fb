"""Executors of compiled taskflow plans. Only the sequential one exists so far."""

from moesaic.taskflow.runtime.sequential import (
    BackwardResult,
    ForwardResult,
    StepRouting,
    run_backward,
    run_forward,
    step_routing,
)

__all__ = [
    "BackwardResult",
    "ForwardResult",
    "StepRouting",
    "run_backward",
    "run_forward",
    "step_routing",
]
