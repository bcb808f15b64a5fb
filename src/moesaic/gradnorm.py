"""Squared gradient norms for clipping and the health check, accumulated in float64.

``g.double().square().sum()`` writes two float64 copies of every gradient: 49 ms for one
7.3 M-element expert weight gradient on one core of this machine. :func:`square_norm` reduces
in float64 without a copy of the whole tensor: ``torch.linalg.vector_norm(...,
dtype=torch.float64)`` over slices of ``CPU_SLICE`` elements, whose float64 conversion stays
in cache (2.8 ms for the same gradient; on the whole tensor at once 25 ms), and as exact
(relative difference 2e-14). Every schedule's norm goes through here.

A device reduces each gradient in one call, read in its own dtype and summed in fp32 (as
``clip_grad_norm_`` does), and only the per-tensor norms become float64: asked for a float64
norm, torch first converts the whole gradient to float64. On an H200 those conversions and
float64 reductions were about 30 ms of a 269 ms bf16 step of a 3.1 B-parameter Qwen3-MoE
(``benchmarks/results/gpu_train_step_h200.json``'s profile). fp32 sums of a tensor's squares
are exact to ~1e-7 relative with the GPU's tree reduction: a clipping threshold or a NaN
check does not see the difference.

Measured on whole steps (``benchmarks/results/norm_ab.json``: emulated 2- and 4-rank runs, old
and new code interleaved, two rounds): 0.88x the step for dropless under vanilla and flowmoe on
2 ranks (H 240, E 28, F 480), no change beyond the runs' spread (1.00-1.04x) for padded
moe-only on 2 ranks and for the 4-rank steps tried.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CPU_SLICE", "square_norm", "square_norm_sum"]

# Elements per float64 slice on a CPU (fastest of 16 K - 1 M measured: 64 K).
CPU_SLICE = 1 << 16


def square_norm(grad: torch.Tensor) -> torch.Tensor:
    """``sum(grad ** 2)`` as a 0-d float64 tensor on ``grad``'s device (``grad`` detached)."""
    g = grad.detach()
    if g.device.type != "cpu":
        return torch.linalg.vector_norm(g, dtype=_device_sum_dtype(g)).double().square()
    if g.numel() <= CPU_SLICE:
        return torch.linalg.vector_norm(g, dtype=torch.float64).square()
    parts = g.reshape(-1).split(CPU_SLICE)
    return (
        torch.stack([torch.linalg.vector_norm(x, dtype=torch.float64) for x in parts])
        .square()
        .sum()
    )


def square_norm_sum(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``sum(g ** 2 for g in grads)`` as a 0-d float64 tensor on ``device`` (zero when empty).

    On a device, torch's multi-tensor norm (``torch._foreach_norm``, what ``clip_grad_norm_``
    uses; fp32 sums, module docstring): a few launches for all gradients instead of one
    reduction per parameter. On a CPU :func:`square_norm` per gradient (the cache-sized
    float64 slices).
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    if not grads:
        return total
    on_cpu = [g for g in grads if g.device.type == "cpu"]
    on_device = [g.detach() for g in grads if g.device.type != "cpu"]
    for g in on_cpu:
        total += square_norm(g).to(device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in on_device:
        by_dtype.setdefault(_device_sum_dtype(g), []).append(g)
    for dtype, same in by_dtype.items():
        norms = torch._foreach_norm(same, 2, dtype=dtype)
        total += torch.stack([n.to(device, torch.float64) for n in norms]).square().sum()
    return total


def _device_sum_dtype(g: torch.Tensor) -> torch.dtype:
    """fp32 sums for half and fp32 gradients on a device (read as they are), float64 ones in
    float64."""
    return torch.float64 if g.dtype == torch.float64 else torch.float32
