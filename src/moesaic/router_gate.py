"""The router's gate: fp32 logits ``x_TH @ w_EH^T`` of half-precision tokens from
half-precision GEMMs (``gate_logits``), what ``routing.Router`` computes for bf16/fp16 tokens.

Shape legend: T tokens, H hidden, E experts, S split rows (E or 2E).

An fp32 linear would copy the tokens to fp32 and run an FFMA GEMM (4% of a bf16 Mixtral-like
layer step on an H200, issue 27). Here the GEMMs run on half-precision tensor cores and
accumulate in fp32 (``torch.mm(..., out_dtype=float32)`` on CUDA; fp32 operands elsewhere, the
same products): half-precision products are exact in fp32, so the logits are the fp32 linear's
up to summation order. A factor that is not half already enters as a two-term split.
"""

from __future__ import annotations

import functools

import torch

from moesaic.eager import constant_under_compile

__all__ = ["HALF_DTYPES", "gate_logits"]

HALF_DTYPES = (torch.bfloat16, torch.float16)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two half-precision matrices, accumulated and returned in fp32: one
    tensor-core GEMM on CUDA (``out_dtype``), the same products (exact in fp32) and fp32 sums
    elsewhere."""
    if a.is_cuda and _mm_out_dtype_ok(a.device, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


@constant_under_compile
def _mm_out_dtype_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build's ``torch.mm`` takes ``out_dtype=float32`` for ``dtype`` on
    ``device`` (probed once; older builds fall back to fp32 operands). A constant under
    ``torch.compile``: the probe runs for real when traced, not into the graph."""
    return _probe_mm_out_dtype(device, dtype)


@functools.cache
def _probe_mm_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        one = torch.ones(2, 2, device=device, dtype=dtype)
        return torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _split(t: torch.Tensor, dtype: torch.dtype, dim: int) -> torch.Tensor:
    """``t`` as two ``dtype`` parts concatenated along ``dim``: ``hi = t`` rounded and
    ``lo = t - hi`` rounded, so ``hi + lo`` carries about 16 bits of ``t``'s mantissa (one
    part when ``t`` is already ``dtype``: nothing is lost)."""
    if t.dtype == dtype:
        return t
    hi = t.to(dtype)
    return torch.cat([hi, (t - hi.to(t.dtype)).to(dtype)], dim=dim)


class _GateLogits(torch.autograd.Function):
    """The router's fp32 logits ``x_TH @ w_EH^T`` from half-precision tokens on half-precision
    tensor cores, without an fp32 copy of the tokens (what an fp32 linear costs: the copy and
    an FFMA GEMM took 4% of a bf16 Mixtral-like layer step on an H200).

    Products of two half-precision numbers are exact in fp32 and every GEMM accumulates in
    fp32, so the logits are the fp32 linear's up to summation order. A factor that is not
    already half precision (the fp32 weight of a model with fp32 master weights; the fp32
    gradient of the logits) enters as a two-term split ``hi + lo`` (:func:`_split`), which
    keeps about 16 mantissa bits: relative errors near 1e-5 instead of bf16's 4e-3. The
    input gradient comes back in the tokens' dtype, the weight gradient in the weight's.
    """

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TH, w_EH)
        E = w_EH.shape[0]
        w_SH = _split(w_EH, x_TH.dtype, 0)  # S = E or 2E rows
        logits_TS = _mm_f32(x_TH, w_SH.t())
        return logits_TS if w_SH.shape[0] == E else logits_TS[:, :E] + logits_TS[:, E:]

    @staticmethod
    def backward(ctx, g_TE: torch.Tensor):
        x_TH, w_EH = ctx.saved_tensors
        E, half = w_EH.shape[0], x_TH.dtype
        g_TS = _split(g_TE.float(), half, 1)  # S = 2E: [g_hi, g_lo]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # One GEMM over the split's terms: g_hi w_hi + g_lo w_hi (+ g_hi w_lo).
            w_hi = w_EH.to(half)
            if w_EH.dtype == half:
                dx = torch.mm(g_TS, torch.cat([w_hi, w_hi]))
            else:
                w_lo = (w_EH - w_hi.to(w_EH.dtype)).to(half)
                dx = torch.mm(torch.cat([g_TS, g_TS[:, :E]], 1), torch.cat([w_hi, w_hi, w_lo]))
        if ctx.needs_input_grad[1]:
            dw_SH = _mm_f32(g_TS.t(), x_TH)
            dw = (dw_SH[:E] + dw_SH[E:]).to(w_EH.dtype)
        return dx, dw


def gate_logits(x_TH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:
    """fp32 router logits [T, E] of half-precision tokens ``x_TH`` and a gate weight ``w_EH``
    (any float dtype), forward and backward on half-precision GEMMs (:class:`_GateLogits`)."""
    if x_TH.dtype not in HALF_DTYPES:
        raise ValueError(f"gate_logits: x_TH must be bf16 or fp16, got {x_TH.dtype}")
    return _GateLogits.apply(x_TH, w_EH)
