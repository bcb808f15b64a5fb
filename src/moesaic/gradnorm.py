"""Squared gradient norms for clipping and the health check, accumulated in float64.

``torch.linalg.vector_norm(g, dtype=torch.float64)`` reduces in float64 without materialising a
float64 copy of ``g``: on this machine's CPU, 20x faster than ``g.double().square().sum()`` (2.8
against 59 ms a step for the 20 M expert gradients of a 2-block, 28-expert model; the copy
and its square were 10-18% of an emulated 2-rank training step) and as exact (relative
difference 1e-13). Every schedule's norm goes through here.
"""

from __future__ import annotations

import torch

__all__ = ["square_norm"]


def square_norm(grad: torch.Tensor) -> torch.Tensor:
    """``sum(grad ** 2)`` as a 0-d float64 tensor on ``grad``'s device (``grad`` detached)."""
    return torch.linalg.vector_norm(grad.detach(), dtype=torch.float64).square()
