"""Test helpers: the gloo world spawner and the relative tolerance rule."""

from __future__ import annotations

import torch

from moesaic.comm.world import WorkerError, run_world

__all__ = ["WorkerError", "assert_close_to_ref", "run_world"]


def assert_close_to_ref(
    fast: torch.Tensor, ref32: torch.Tensor, ref64: torch.Tensor, name: str = "tensor"
) -> None:
    """The relative rule for arithmetic paths: ``err(fast) <= 2 * err(ref32) + eps``.

    ``ref64`` is the reference run in float64 (the truth up to ~1e-16), ``ref32`` the same
    reference in the fast path's dtype: its error is what that dtype costs with an ordinary
    summation order, so a fast path may be at most twice as far from the truth. ``eps`` (4 ulps
    of float32 at the tensor's scale) absorbs the case where ref32 happens to be exact.
    """
    if fast.shape != ref64.shape:
        raise AssertionError(f"{name}: shape {tuple(fast.shape)} != {tuple(ref64.shape)}")
    truth = ref64.double()
    err_fast = (fast.double() - truth).abs().max().item() if truth.numel() else 0.0
    err_ref = (ref32.double() - truth).abs().max().item() if truth.numel() else 0.0
    scale = truth.abs().max().item() if truth.numel() else 0.0
    eps = 4 * torch.finfo(torch.float32).eps * max(scale, 1e-30)
    if not err_fast <= 2 * err_ref + eps:
        raise AssertionError(
            f"{name}: max error {err_fast:.3e} vs float64 reference exceeds "
            f"2 x reference-float32 error ({err_ref:.3e}) + eps ({eps:.1e})"
        )
