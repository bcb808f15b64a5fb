"""Combine: the weighted top-k sum of expert rows back to tokens (the unpermute), and its
backward.

Shape legend: T tokens, K top-k, H hidden, R rows.

``y_TH[t] = sum_k w_TK[t, k] * rows_RH[slot_TK[t, k]]`` over the assignments with a row
(``slot >= 0``; a dropped one contributes zero), summed in choice order with fp32 accumulation
(deterministic: a gather per token, no atomics). Backward: ``drows[slot[t, k]] = w[t, k] *
dy[t]`` (rows nobody reads get zero) and ``dw[t, k] = <dy[t], rows[slot[t, k]]>``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moesaic.kernels._jit import cast_out
from moesaic.kernels._launch import block_h, check_device, check_float, check_slots, kernel_op


def combine_reference(
    rows_RH: torch.Tensor, slot_TK: torch.Tensor, w_TK: torch.Tensor
) -> torch.Tensor:
    """Plain torch, as ``RoutingPlan.unpermute``: gather the K rows, weight (in the rows'
    dtype), sum over k."""
    T, K = slot_TK.shape
    H = rows_RH.shape[1]
    padded_RH = torch.cat([rows_RH, rows_RH.new_zeros(1, H)])  # row R: the dropped ones' zero
    R = rows_RH.shape[0]
    flat = torch.where(slot_TK >= 0, slot_TK, R).reshape(-1)
    y_TKH = padded_RH.index_select(0, flat).view(T, K, H)
    return (y_TKH * w_TK.to(rows_RH.dtype).unsqueeze(-1)).sum(dim=1)


@triton.jit
def _has_row(cols, slot):
    """``slot >= 0`` as a vector like ``cols``: the interpreter (Triton 3.9) turns ``vector &
    scalar_bool`` into an int32 mask that its loads reject."""
    return cols * 0 + slot >= 0


@triton.jit
def _combine_fwd(rows_ptr, slot_ptr, w_ptr, y_ptr, H, K, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(K):
        slot = tl.load(slot_ptr + t * K + k).to(tl.int64)
        w = tl.load(w_ptr + t * K + k).to(tl.float32)
        row = tl.load(rows_ptr + slot * H + cols, mask=inside & _has_row(cols, slot), other=0.0)
        acc += w * row.to(tl.float32)
    tl.store(y_ptr + t * H + cols, cast_out(acc, y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _combine_bwd(dy_ptr, rows_ptr, slot_ptr, w_ptr, drows_ptr, dw_ptr, H, K, BLOCK: tl.constexpr):
    tk = tl.program_id(0)  # one assignment per program: it owns its row, so no write conflicts
    t = (tk // K).to(tl.int64)  # 64-bit: T * H passes 2^31 at 1M tokens of 4096
    slot = tl.load(slot_ptr + tk).to(tl.int64)
    w = tl.load(w_ptr + tk).to(tl.float32)
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = (cols < H) & _has_row(cols, slot)
        dy = tl.load(dy_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
        row = tl.load(rows_ptr + slot * H + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(
            drows_ptr + slot * H + cols, cast_out(w * dy, drows_ptr.dtype.element_ty), mask=mask
        )
        dot += dy * row
    tl.store(dw_ptr + tk, cast_out(tl.sum(dot, axis=0), dw_ptr.dtype.element_ty))


def _launch_fwd(rows_RH: torch.Tensor, slot_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    T, K = slot_TK.shape
    H = rows_RH.shape[1]
    y_TH = rows_RH.new_empty(T, H)
    if T and H:
        block = block_h(H)
        _combine_fwd[(T, triton.cdiv(H, block))](rows_RH, slot_TK, w_TK, y_TH, H, K, BLOCK=block)
    return y_TH


def _launch_bwd(
    dy_TH: torch.Tensor,
    rows_RH: torch.Tensor,
    slot_TK: torch.Tensor,
    w_TK: torch.Tensor,
    zero_fill: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = slot_TK.shape
    H = rows_RH.shape[1]
    # rows no assignment reads get zero gradients; each assignment writes its own dw
    drows_RH = torch.zeros_like(rows_RH) if zero_fill else torch.empty_like(rows_RH)
    dw_TK = torch.empty_like(w_TK)
    if T * K:
        _combine_bwd[(T * K,)](
            dy_TH.contiguous(), rows_RH, slot_TK, w_TK, drows_RH, dw_TK, H, K, BLOCK=block_h(H)
        )
    return drows_RH, dw_TK


class _Combine(torch.autograd.Function):
    """The eager path; under torch.compile the custom ops below (kernels/__init__.py)."""

    @staticmethod
    def forward(ctx, rows_RH, slot_TK, w_TK, zero_fill):
        ctx.save_for_backward(rows_RH, slot_TK, w_TK)
        ctx.zero_fill = zero_fill
        return _launch_fwd(rows_RH, slot_TK, w_TK)

    @staticmethod
    def backward(ctx, dy_TH):
        rows_RH, slot_TK, w_TK = ctx.saved_tensors
        drows_RH, dw_TK = _launch_bwd(dy_TH, rows_RH, slot_TK, w_TK, ctx.zero_fill)
        return drows_RH, None, dw_TK, None


# Under torch.compile: the same launchers as custom ops (kernels/__init__.py).
_combine_bwd_op = kernel_op(
    "combine_bwd",
    "(Tensor dy_TH, Tensor rows_RH, Tensor slot_TK, Tensor w_TK, bool zero_fill) "
    "-> (Tensor, Tensor)",
    _launch_bwd,
    lambda dy_TH, rows_RH, slot_TK, w_TK, zero_fill: (
        torch.empty_like(rows_RH),
        torch.empty_like(w_TK),
    ),
)


def _combine_op_setup(ctx, inputs, output):
    rows_RH, slot_TK, w_TK, zero_fill = inputs
    ctx.save_for_backward(rows_RH, slot_TK, w_TK)
    ctx.zero_fill = zero_fill


def _combine_op_backward(ctx, dy_TH):
    rows_RH, slot_TK, w_TK = ctx.saved_tensors
    drows_RH, dw_TK = _combine_bwd_op(dy_TH.contiguous(), rows_RH, slot_TK, w_TK, ctx.zero_fill)
    return drows_RH, None, dw_TK, None


_combine_op = kernel_op(
    "combine",
    "(Tensor rows_RH, Tensor slot_TK, Tensor w_TK, bool zero_fill) -> Tensor",
    lambda rows_RH, slot_TK, w_TK, zero_fill: _launch_fwd(rows_RH, slot_TK, w_TK),
    lambda rows_RH, slot_TK, w_TK, zero_fill: rows_RH.new_empty(slot_TK.shape[0], rows_RH.shape[1]),
    _combine_op_backward,
    _combine_op_setup,
)


def combine(
    rows_RH: torch.Tensor, slot_TK: torch.Tensor, w_TK: torch.Tensor, *, zero_fill: bool = True
) -> torch.Tensor:
    """``y_TH[t] = sum_k w_TK[t, k] * rows_RH[slot_TK[t, k]]`` (slot -1: nothing), in the rows'
    dtype with fp32 accumulation.

    Args:
        rows_RH: expert output rows (fp32, bf16 or fp16).
        slot_TK: row of each assignment, -1 for none; distinct rows, all < R (not checked on
            the device).
        w_TK: combine weights (any float dtype; the gradient comes back in it).
        zero_fill: False when the caller knows every row is some assignment's (R = T*K, no
            -1): the rows' gradient is then not zeroed first.
    """
    check_float("rows_RH", rows_RH)
    check_device("rows_RH", rows_RH)
    check_slots(slot_TK)
    if w_TK.shape != slot_TK.shape:
        raise ValueError(
            f"w_TK {tuple(w_TK.shape)} must have slot_TK's shape {tuple(slot_TK.shape)}"
        )
    check_float("w_TK", w_TK)
    fn = _combine_op if torch.compiler.is_compiling() else _Combine.apply
    return fn(rows_RH.contiguous(), slot_TK.contiguous(), w_TK.contiguous(), zero_fill)
