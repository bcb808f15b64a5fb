"""The training loss's cross-entropy rows on a GPU: one read of the logits for the forward, one
read and one write for the backward, in fp32 math on logits kept in their dtype.

Shape legend: N rows (tokens), V vocabulary.

``train.lm_loss`` on a CPU (and on a GPU without Triton) upcasts ``loss_chunk`` rows at a
time and runs torch's reductions on them: per chunk an fp32 copy, a max, an exp, a sum and a
gather in the forward, a copy, a softmax, a scale, a scatter and a downcast in the backward,
about 12 passes over the vocabulary-wide tensor. On an H200 that was ~25 ms of a 269 ms
Qwen3-MoE step (16k tokens, V 151936; ``benchmarks/results/gpu_train_step_h200.json``), where
torchtitan's compiled loss took ~6 ms. Here one program per row:

* forward (``_ce_fwd``): an online log-sum-exp over the row in ``BLOCK_V`` columns (running
  max and rescaled sum), and the target's logit; both fp32, one read of the row;
* backward (``_ce_bwd``): ``(exp(z - lse) - onehot(y)) * scale`` written in the logits' dtype,
  rounded once (``scale`` is 0 on ignored rows, ``g / n`` on the others).

The values equal the chunked torch path's up to fp32 summation order (tests/kernels, under
the interpreter, against ``lm_loss``'s torch path and float64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moesaic.kernels._jit import cast_out
from moesaic.kernels._launch import check_device, check_float

# Columns per step of a row: 4096 bf16 are 8 KB, 16 elements per thread of 8 warps. Not tuned.
BLOCK_V = 4096


@triton.jit
def _ce_fwd(
    z_ptr, y_ptr, lse_ptr, picked_ptr, V, stride, BLOCK_V: tl.constexpr, IGNORE: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per-lane running max
    s = tl.zeros([BLOCK_V], tl.float32)  # per-lane sum of exp(z - m)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        z = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        # a lane still at -inf (only -inf or masked columns so far) shifts by 0, not by -inf:
        # exp(-inf - 0) adds nothing where exp(-inf - -inf) would be NaN
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        s = s * tl.exp(m - shift) + tl.exp(z - shift)
        m = m_new
    row_max = tl.max(m, axis=0)
    shift_row = tl.where(row_max > float("-inf"), row_max, 0.0)
    total = tl.sum(s * tl.exp(m - shift_row), axis=0)
    tl.store(lse_ptr + row, shift_row + tl.log(total))
    y = tl.load(y_ptr + row)
    ok = y != IGNORE
    target = tl.load(base + tl.where(ok, y, 0)).to(tl.float32)
    tl.store(picked_ptr + row, tl.where(ok, target, 0.0))


@triton.jit
def _ce_bwd(z_ptr, y_ptr, lse_ptr, scale_ptr, g_ptr, V, stride, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    out = g_ptr + row * stride
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)
    y = tl.load(y_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        ok = c < V
        z = tl.load(base + c, mask=ok, other=0.0).to(tl.float32)
        p = tl.exp(z - lse) * scale
        p = tl.where(c == y, p - scale, p)
        tl.store(out + c, cast_out(p, out.dtype.element_ty), mask=ok)


def _check(logits_NV: torch.Tensor, y_N: torch.Tensor) -> None:
    check_float("logits", logits_NV)
    check_device("logits", logits_NV)
    if logits_NV.dim() != 2 or logits_NV.stride(1) != 1:
        raise ValueError(
            f"logits must be a row-contiguous [N, V] tensor, got shape "
            f"{tuple(logits_NV.shape)} strides {logits_NV.stride()}"
        )
    if y_N.shape != logits_NV.shape[:1]:
        raise ValueError(f"targets must be [N] = [{logits_NV.shape[0]}], got {tuple(y_N.shape)}")


def ce_rows(
    logits_NV: torch.Tensor, y_N: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, fp32: ``logsumexp(logits)`` and the target's logit (0 where the target is
    ``ignore_index``)."""
    _check(logits_NV, y_N)
    N, V = logits_NV.shape
    lse_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    picked_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    if N:
        _ce_fwd[(N,)](
            logits_NV,
            y_N,
            lse_N,
            picked_N,
            V,
            logits_NV.stride(0),
            BLOCK_V=BLOCK_V,
            IGNORE=ignore_index,
            num_warps=8,
        )
    return lse_N, picked_N


def ce_rows_grad(
    logits_NV: torch.Tensor, y_N: torch.Tensor, lse_N: torch.Tensor, scale_N: torch.Tensor
) -> torch.Tensor:
    """``(softmax(logits) - onehot(y)) * scale`` per row in the logits' dtype (``lse`` from
    ``ce_rows``; ``y`` any valid column where ``scale`` is 0)."""
    _check(logits_NV, y_N)
    N, V = logits_NV.shape
    grad_NV = torch.empty_like(logits_NV)
    if N:
        _ce_bwd[(N,)](
            logits_NV,
            y_N,
            lse_N,
            scale_N,
            grad_NV,
            V,
            logits_NV.stride(0),
            BLOCK_V=BLOCK_V,
            num_warps=8,
        )
    return grad_NV
