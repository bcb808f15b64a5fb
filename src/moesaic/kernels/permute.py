"""Permute: tokens to rows by a slot map, and its backward.

Shape legend: T tokens, K top-k, H hidden, R rows of the destination buffer.

``slot_TK[t, k]`` is the row that assignment (t, k) fills, -1 when it has none (dropped by the
capacity). Any layout works: ``RoutingPlan.slot_TK(R)`` gives the expert-contiguous rows of the
dropless path, and the symmetric window's cells (``taskflow.layout``: per peer and expert a
cell of C' rows, padding left at zero) are another slot map. Rows no assignment fills are zero,
so expert GEMMs without biases keep them zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moesaic.kernels._jit import cast_out
from moesaic.kernels._launch import block_h, check_device, check_float, check_slots, kernel_op


def permute_reference(x_TH: torch.Tensor, slot_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Plain torch: ``out[slot_TK[t, k]] = x_TH[t]`` for every kept (t, k); other rows zero."""
    T, K = slot_TK.shape
    out_RH = x_TH.new_zeros(num_rows, x_TH.shape[1])
    flat = slot_TK.reshape(-1)
    kept = flat >= 0
    src = torch.arange(T * K, device=x_TH.device) // K
    return out_RH.index_copy(0, flat[kept], x_TH.index_select(0, src[kept]))


@triton.jit
def _has_row(cols, slot):
    """``slot >= 0`` as a vector like ``cols``: the interpreter (Triton 3.9) turns ``vector &
    scalar_bool`` into an int32 mask that its loads reject."""
    return cols * 0 + slot >= 0


@triton.jit
def _permute_fwd(x_ptr, slot_ptr, out_ptr, H, K, BLOCK: tl.constexpr):
    tk = tl.program_id(0)  # one assignment (t, k) per program row
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + tk).to(tl.int64)
    t = (tk // K).to(tl.int64)  # 64-bit: T * H passes 2^31 at 1M tokens of 4096
    mask = (cols < H) & _has_row(cols, slot)
    row = tl.load(x_ptr + t * H + cols, mask=mask)
    tl.store(out_ptr + slot * H + cols, row, mask=mask)


@triton.jit
def _permute_bwd(dout_ptr, slot_ptr, dx_ptr, H, K, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(K):  # the K rows in choice order: a fixed sum order, no atomics
        slot = tl.load(slot_ptr + t * K + k).to(tl.int64)
        g = tl.load(dout_ptr + slot * H + cols, mask=inside & _has_row(cols, slot), other=0.0)
        acc += g.to(tl.float32)
    tl.store(dx_ptr + t * H + cols, cast_out(acc, dx_ptr.dtype.element_ty), mask=inside)


def _launch_fwd(
    x_TH: torch.Tensor, slot_TK: torch.Tensor, num_rows: int, zero_fill: bool = True
) -> torch.Tensor:
    T, H = x_TH.shape
    K = slot_TK.shape[1]
    out_RH = x_TH.new_zeros(num_rows, H) if zero_fill else x_TH.new_empty(num_rows, H)
    if T * K and H:
        block = block_h(H)
        _permute_fwd[(T * K, triton.cdiv(H, block))](x_TH, slot_TK, out_RH, H, K, BLOCK=block)
    return out_RH


def _launch_bwd(dout_RH: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    T, K = slot_TK.shape
    H = dout_RH.shape[1]
    dx_TH = dout_RH.new_empty(T, H)
    if T and H:
        block = block_h(H)
        _permute_bwd[(T, triton.cdiv(H, block))](dout_RH, slot_TK, dx_TH, H, K, BLOCK=block)
    return dx_TH


class _Permute(torch.autograd.Function):
    """The eager path; under torch.compile the custom ops below (kernels/__init__.py)."""

    @staticmethod
    def forward(ctx, x_TH, slot_TK, num_rows, zero_fill):
        ctx.save_for_backward(slot_TK)
        return _launch_fwd(x_TH, slot_TK, num_rows, zero_fill)

    @staticmethod
    def backward(ctx, dout_RH):
        (slot_TK,) = ctx.saved_tensors
        return _launch_bwd(dout_RH.contiguous(), slot_TK), None, None, None


# Under torch.compile: the same launchers as custom ops (kernels/__init__.py).
_permute_bwd_op = kernel_op(
    "permute_bwd",
    "(Tensor dout_RH, Tensor slot_TK) -> Tensor",
    _launch_bwd,
    lambda dout_RH, slot_TK: dout_RH.new_empty(slot_TK.shape[0], dout_RH.shape[1]),
)


def _permute_op_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _permute_op_backward(ctx, dout_RH):
    (slot_TK,) = ctx.saved_tensors
    return _permute_bwd_op(dout_RH.contiguous(), slot_TK), None, None, None


_permute_op = kernel_op(
    "permute",
    "(Tensor x_TH, Tensor slot_TK, SymInt num_rows, bool zero_fill) -> Tensor",
    _launch_fwd,
    lambda x_TH, slot_TK, num_rows, zero_fill: x_TH.new_empty(num_rows, x_TH.shape[1]),
    _permute_op_backward,
    _permute_op_setup,
)


def permute(
    x_TH: torch.Tensor, slot_TK: torch.Tensor, num_rows: int, *, zero_fill: bool = True
) -> torch.Tensor:
    """Rows ``[R, H]`` with ``out[slot_TK[t, k]] = x_TH[t]``; rows no assignment fills are zero.

    Args:
        x_TH: the tokens (fp32, bf16 or fp16).
        slot_TK: destination row of each assignment, -1 for none; distinct rows, all < R (not
            checked on the device: a check would read them on the host).
        num_rows: R.
        zero_fill: False when the caller knows every row is some assignment's (R = T*K, no
            -1): the buffer is then not zeroed first (one pass over [R, H] less).
    """
    check_float("x_TH", x_TH)
    check_device("x_TH", x_TH)
    check_slots(slot_TK, x_TH.shape[0])
    if num_rows < 0:
        raise ValueError(f"num_rows ({num_rows}) must be >= 0")
    fn = _permute_op if torch.compiler.is_compiling() else _Permute.apply
    return fn(x_TH.contiguous(), slot_TK.contiguous(), num_rows, zero_fill)
