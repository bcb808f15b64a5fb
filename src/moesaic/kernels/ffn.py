"""The Triton expert path the layer calls when ``MoEConfig.kernels`` is "triton" (all of it) or
"fused" (``permute``, ``combine``, ``swiglu_act`` around the library's grouped GEMMs, and
the router's ``route`` after its gate GEMM).

Shape legend: T tokens, K top-k, H hidden, F expert hidden, M rows, e local experts.

Imports Triton (through the kernel modules): reach it only through ``moesaic.kernels.load()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moesaic.kernels.combine import combine
from moesaic.kernels.grouped_gemm import grouped_gemm
from moesaic.kernels.permute import permute
from moesaic.kernels.router import route
from moesaic.kernels.swiglu import grouped_swiglu
from moesaic.kernels.swiglu_act import swiglu_act

__all__ = [
    "combine",
    "expert_ffn",
    "grouped_gemm",
    "grouped_swiglu",
    "permute",
    "route",
    "swiglu_act",
]


def expert_ffn(
    x_MH: torch.Tensor,
    offs_e: torch.Tensor,
    w1_eHF: torch.Tensor,
    w3_eHF: torch.Tensor | None,
    w2_eFH: torch.Tensor,
) -> torch.Tensor:
    """``experts.expert_ffn`` on the kernels: SwiGLU fused into the first GEMM (``w3_eHF``
    given), else GELU (torch's, between two grouped GEMMs); weights cast to x's dtype."""
    w1_eHF, w2_eFH = w1_eHF.to(x_MH.dtype), w2_eFH.to(x_MH.dtype)
    if w3_eHF is not None:
        h_MF = grouped_swiglu(x_MH, w1_eHF, w3_eHF.to(x_MH.dtype), offs_e)
    else:
        h_MF = F.gelu(grouped_gemm(x_MH, w1_eHF, offs_e))
    return grouped_gemm(h_MF, w2_eFH, offs_e)
