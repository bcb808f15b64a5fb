"""The first expert GEMM with SwiGLU fused into its epilogue, and its backward.

Shape legend: M rows, H hidden, F expert hidden, e groups (local experts).

``h[rows of group i] = silu(x_i @ w1[i]) * (x_i @ w3[i])``: one program computes the same
``BM x BN`` tile of both products from one pass over x (each x tile loaded once for both) and
writes only ``h``, not the two ``[M, F]`` products and a third pass over them. For the
backward it also writes the two products (``a``, ``b``) when a gradient is needed. Backward:
``da = dh * b * silu'(a)``, ``db = dh * silu(a)`` (one elementwise kernel, fp32 math), then the
grouped GEMM's backward for each of w1 and w3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moesaic.kernels._jit import cast_out, mma
from moesaic.kernels._launch import kernel_op, upcast_dot
from moesaic.kernels.grouped_gemm import (
    BLOCK_K,
    BLOCK_M,
    BLOCK_N,
    _find_tile,
    check_gemm_args,
    gmm_forward,
    gmm_op,
    gmm_weight_grad,
    gmm_weight_grad_op,
    grouped_gemm_reference,
)

BLOCK_ELEMS = 256  # elements per program of the elementwise backward; not tuned on a GPU


def grouped_swiglu_reference(
    x_MH: torch.Tensor, w1_eHF: torch.Tensor, w3_eHF: torch.Tensor, offs_e: torch.Tensor
) -> torch.Tensor:
    """Plain torch: ``silu(x @ w1) * (x @ w3)`` per group, as ``experts.expert_ffn``."""
    a_MF = grouped_gemm_reference(x_MH, w1_eHF, offs_e)
    return torch.nn.functional.silu(a_MF) * grouped_gemm_reference(x_MH, w3_eHF, offs_e)


@triton.jit
def _swiglu_gemm_kernel(
    x_ptr,
    w1_ptr,
    w3_ptr,
    h_ptr,
    a_ptr,
    b_ptr,
    offs_ptr,
    E,
    N,
    K,
    sxm,
    sxk,
    swe,
    swk,
    swn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
    SAVE: tl.constexpr,
):
    group, row0, row_end = _find_tile(offs_ptr, E, tl.program_id(0), BM)
    group = tl.maximum(group, 0)
    rows = row0 + tl.arange(0, BM).to(tl.int64)  # 64-bit: M * K passes 2^31 at 1M x 4096
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < row_end
    col_ok = cols < N
    w_off = group.to(tl.int64) * swe
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * sxm + ks[None, :] * sxk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_idx = w_off + ks[:, None] * swk + cols[None, :] * swn
        w_mask = k_ok[:, None] & col_ok[None, :]
        w1 = tl.load(w1_ptr + w_idx, mask=w_mask, other=0.0)
        w3 = tl.load(w3_ptr + w_idx, mask=w_mask, other=0.0)
        acc1 = mma(x, w1, acc1, UPCAST)
        acc3 = mma(x, w3, acc3, UPCAST)
    out_ty = h_ptr.dtype.element_ty
    # Round the products to the activations' dtype first, as the unfused path does.
    a = cast_out(acc1, out_ty).to(tl.float32)
    b = cast_out(acc3, out_ty).to(tl.float32)
    h = a * tl.sigmoid(a) * b
    idx = rows[:, None] * N + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(h_ptr + idx, cast_out(h, out_ty), mask=mask)
    if SAVE:
        tl.store(a_ptr + idx, a.to(out_ty), mask=mask)
        tl.store(b_ptr + idx, b.to(out_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dh_ptr, a_ptr, b_ptr, da_ptr, db_ptr, numel, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    dh = tl.load(dh_ptr + i, mask=ok, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + i, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + i, mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    da = dh * b * sig * (1.0 + a * (1.0 - sig))
    tl.store(da_ptr + i, cast_out(da, da_ptr.dtype.element_ty), mask=ok)
    tl.store(db_ptr + i, cast_out(dh * silu, db_ptr.dtype.element_ty), mask=ok)


def _launch_fwd(
    x_MH: torch.Tensor, w1_eHF: torch.Tensor, w3_eHF: torch.Tensor, offs_e: torch.Tensor, save: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    M, H = x_MH.shape
    E, _, Fh = w1_eHF.shape
    h_MF = x_MH.new_empty(M, Fh)
    a_MF = x_MH.new_empty(M, Fh) if save else h_MF  # not written unless save
    b_MF = x_MH.new_empty(M, Fh) if save else h_MF
    if M and Fh and E:
        grid = (triton.cdiv(M, BLOCK_M) + E, triton.cdiv(Fh, BLOCK_N))
        _swiglu_gemm_kernel[grid](
            x_MH,
            w1_eHF,
            w3_eHF,
            h_MF,
            a_MF,
            b_MF,
            offs_e,
            E,
            Fh,
            H,
            *x_MH.stride(),
            *w1_eHF.stride(),
            BM=BLOCK_M,
            BN=BLOCK_N,
            BK=BLOCK_K,
            UPCAST=upcast_dot(),
            SAVE=save,
        )
    return h_MF, a_MF, b_MF


def launch_swiglu_bwd(
    dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(da, db)`` of ``h = silu(a) * b`` (one pass; ``block`` elements per program)."""
    dh = dh.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    if a.numel():
        _swiglu_bwd_kernel[(triton.cdiv(a.numel(), block),)](
            dh, a, b, da, db, a.numel(), BLOCK=block
        )
    return da, db


def _grouped_swiglu_bwd(saved, dh_MF, needs, launch):
    """The backward of both paths: ``launch`` the elementwise backward, the grouped GEMM and
    its weight gradient, as launchers (eager) or as their custom ops (compiled)."""
    x_MH, w1_eHF, w3_eHF, offs_e, a_MF, b_MF = saved
    swiglu_bwd, gemm, dw_gemm = launch
    da_MF, db_MF = swiglu_bwd(dh_MF, a_MF, b_MF, BLOCK_ELEMS)
    dx = dw1 = dw3 = None
    if needs[0]:
        dx = gemm(da_MF, w1_eHF.transpose(1, 2), offs_e)
        dx = dx + gemm(db_MF, w3_eHF.transpose(1, 2), offs_e)
    e = w1_eHF.shape[0]
    if needs[1]:
        dw1 = dw_gemm(x_MH, da_MF, offs_e, e)
    if needs[2]:
        dw3 = dw_gemm(x_MH, db_MF, offs_e, e)
    return dx, dw1, dw3, None


class _GroupedSwiGLU(torch.autograd.Function):
    """The eager path; under torch.compile the custom ops below (kernels/__init__.py)."""

    @staticmethod
    def forward(ctx, x_MH, w1_eHF, w3_eHF, offs_e):
        save = any(ctx.needs_input_grad[:3])
        h_MF, a_MF, b_MF = _launch_fwd(x_MH, w1_eHF, w3_eHF, offs_e, save)
        if save:
            ctx.save_for_backward(x_MH, w1_eHF, w3_eHF, offs_e, a_MF, b_MF)
        return h_MF

    @staticmethod
    def backward(ctx, dh_MF):
        launch = (launch_swiglu_bwd, gmm_forward, gmm_weight_grad)
        return _grouped_swiglu_bwd(ctx.saved_tensors, dh_MF, ctx.needs_input_grad, launch)


# Under torch.compile: the same launchers as custom ops (kernels/__init__.py). The forward
# always keeps both GEMMs' outputs (a custom op's outputs may not alias each other).
swiglu_bwd_op = kernel_op(
    "swiglu_bwd",
    "(Tensor dh, Tensor a, Tensor b, int block) -> (Tensor, Tensor)",
    launch_swiglu_bwd,
    lambda dh, a, b, block: (torch.empty_like(a), torch.empty_like(b)),
)


def _grouped_swiglu_fake(x_MH, w1_eHF, w3_eHF, offs_e):
    shape = (x_MH.shape[0], w1_eHF.shape[2])
    return x_MH.new_empty(shape), x_MH.new_empty(shape), x_MH.new_empty(shape)


def _grouped_swiglu_op_setup(ctx, inputs, output):
    _h_MF, a_MF, b_MF = output
    ctx.save_for_backward(*inputs, a_MF, b_MF)


def _grouped_swiglu_op_backward(ctx, dh_MF, _da, _db):
    launch = (swiglu_bwd_op, gmm_op, gmm_weight_grad_op)
    return _grouped_swiglu_bwd(ctx.saved_tensors, dh_MF, ctx.needs_input_grad, launch)


_grouped_swiglu_op = kernel_op(
    "grouped_swiglu",
    "(Tensor x_MH, Tensor w1_eHF, Tensor w3_eHF, Tensor offs_e) -> (Tensor, Tensor, Tensor)",
    lambda x_MH, w1_eHF, w3_eHF, offs_e: _launch_fwd(x_MH, w1_eHF, w3_eHF, offs_e, True),
    _grouped_swiglu_fake,
    _grouped_swiglu_op_backward,
    _grouped_swiglu_op_setup,
)


def grouped_swiglu(
    x_MH: torch.Tensor, w1_eHF: torch.Tensor, w3_eHF: torch.Tensor, offs_e: torch.Tensor
) -> torch.Tensor:
    """``silu(x @ w1[i]) * (x @ w3[i])`` over the rows of each group i; returns [M, F].

    Args:
        x_MH: expert-contiguous rows.
        w1_eHF, w3_eHF: gate and up projections, x's dtype and the same shape.
        offs_e: int32 end row of each group on the device; the last must be M.
    """
    check_gemm_args(x_MH, w1_eHF, offs_e)
    if w3_eHF.shape != w1_eHF.shape or w3_eHF.dtype != w1_eHF.dtype:
        raise ValueError(f"w3_eHF {tuple(w3_eHF.shape)} must match w1_eHF {tuple(w1_eHF.shape)}")
    args = (x_MH.contiguous(), w1_eHF.contiguous(), w3_eHF.contiguous(), offs_e.contiguous())
    if torch.compiler.is_compiling():
        return _grouped_swiglu_op(*args)[0]
    return _GroupedSwiGLU.apply(*args)
