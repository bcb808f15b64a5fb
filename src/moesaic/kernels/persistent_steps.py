"""Where taskflow's steps run: in the persistent Triton kernel or on a host runtime (one rule,
read by the strategy when it picks its runtime, by the runtime per step, and by
``TaskflowOptions.check_run`` before a run starts). Imports neither torch nor Triton."""

from __future__ import annotations

from moesaic.kernels import triton_available

__all__ = ["persistent_steps"]


def persistent_steps(kernels: str, activation: str, device: str) -> bool:
    """Whether taskflow's steps on ``device`` (a device type) run in the persistent Triton
    kernel (``taskflow.runtime.persistent``: device puts, no transport) rather than on a host
    runtime (``taskflow.runtime.concurrent``: tiles sent by the options' ``transport``): with
    ``kernels="triton"`` every step (GELU experts are refused when the runtime is built); with
    "auto", the default, the CUDA steps of a SwiGLU layer when Triton is installed."""
    if kernels == "triton":
        return True
    return kernels == "auto" and activation == "swiglu" and device == "cuda" and triton_available()
