"""Squared gradient norms for clipping and the health check, accumulated in float64.

``g.double().square().sum()`` writes two float64 copies of every gradient: 49 ms for one
7.3 M-element expert weight gradient on one core of this machine. :func:`square_norm` reduces
in float64 without a copy of the whole tensor: ``torch.linalg.vector_norm(...,
dtype=torch.float64)`` over slices of ``CPU_SLICE`` elements, whose float64 conversion stays
in cache (2.8 ms for the same gradient; on the whole tensor at once 25 ms), and as exact
(relative difference 2e-14). A device reduces the whole tensor in one call. Every schedule's
norm goes through here.

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
    if g.device.type != "cpu" or g.numel() <= CPU_SLICE:
        return torch.linalg.vector_norm(g, dtype=torch.float64).square()
    parts = g.reshape(-1).split(CPU_SLICE)
    return (
        torch.stack([torch.linalg.vector_norm(x, dtype=torch.float64) for x in parts])
        .square()
        .sum()
    )


def square_norm_sum(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``sum(g ** 2 for g in grads)`` as a 0-d float64 tensor on ``device`` (zero when empty).

    On a device, torch's multi-tensor norm (``torch._foreach_norm`` in float64, what
    ``clip_grad_norm_`` uses): a few launches for all gradients instead of one reduction per
    parameter. On a CPU :func:`square_norm` per gradient (the cache-sized float64 slices).
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    if not grads:
        return total
    on_cpu = [g for g in grads if g.device.type == "cpu"]
    on_device = [g.detach() for g in grads if g.device.type != "cpu"]
    for g in on_cpu:
        total += square_norm(g).to(device)
    if on_device:
        norms = torch._foreach_norm(on_device, 2, dtype=torch.float64)
        total += torch.stack([n.to(device) for n in norms]).square().sum()
    return total
