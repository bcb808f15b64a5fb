"""Grouped GEMM over expert-contiguous rows with device-side offsets, and both backward GEMMs.

Shape legend: M rows, K reduction width, N output columns, e groups (local experts).

``y[rows of group i] = x[rows of group i] @ w[i]``, the rows of group i being
``offs_e[i-1] <= r < offs_e[i]`` (``offs_e`` the int32 end rows, as ``torch._grouped_mm``
takes). The offsets stay on the device: the grid is sized from the host's M alone,
``cdiv(M, BM) + e`` row tiles (each group can start one partial tile), and each program finds
its group by walking the e offsets; tiles past the last group do nothing. ``offs_e[-1]`` must
be M (rows past it are left unwritten; checking would read the offsets on the host).

fp32, bf16 and fp16 with fp32 accumulation; fp32 tiles multiply in IEEE fp32 (no TF32), so
the results match torch's fp32 matmul to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moesaic.kernels._jit import cast_out, mma
from moesaic.kernels._launch import check_device, check_float, kernel_op, upcast_dot

# 16 is tl.dot's smallest tile; kept small so the interpreter's tests stay fast. Not tuned on a
# GPU (nothing here has run on one yet): there 64-128 rows and columns are the usual start.
BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


def grouped_gemm_reference(
    x_MK: torch.Tensor, w_eKN: torch.Tensor, offs_e: torch.Tensor
) -> torch.Tensor:
    """Plain torch: one matmul per group (reads the offsets on the host)."""
    ends = offs_e.tolist()
    counts = [end - start for start, end in zip([0, *ends[:-1]], ends)]
    chunks = x_MK[: ends[-1] if ends else 0].split(counts)
    out = [chunk @ w for chunk, w in zip(chunks, w_eKN.unbind(0))]
    return torch.cat(out) if out else x_MK.new_zeros(0, w_eKN.shape[-1])


@triton.jit
def _find_tile(offs_ptr, E, pid, BM: tl.constexpr):
    """Group, first row and end row of row tile ``pid`` (group -1 and an empty range when the
    tile is past the last group). Tiles are numbered group by group."""
    group = -1
    row0 = 0
    row_end = 0
    tiles_before = 0
    for g in range(E):
        lo = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
        hi = tl.load(offs_ptr + g)
        n = tl.cdiv(hi - lo, BM)
        mine = (pid >= tiles_before) & (pid < tiles_before + n)
        group = tl.where(mine, g, group)
        row0 = tl.where(mine, lo + (pid - tiles_before) * BM, row0)
        row_end = tl.where(mine, hi, row_end)
        tiles_before += n
    return group, row0, row_end


@triton.jit
def _gmm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    offs_ptr,
    E,
    N,
    K,
    sxm,
    sxk,
    swe,
    swk,
    swn,
    sym,
    syn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    group, row0, row_end = _find_tile(offs_ptr, E, tl.program_id(0), BM)
    group = tl.maximum(group, 0)  # no group: every row is masked off below
    rows = row0 + tl.arange(0, BM).to(tl.int64)  # 64-bit: M * K passes 2^31 at 1M x 4096
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < row_end
    col_ok = cols < N
    w_base = w_ptr + group.to(tl.int64) * swe
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        a = tl.load(
            x_ptr + rows[:, None] * sxm + ks[None, :] * sxk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            w_base + ks[:, None] * swk + cols[None, :] * swn,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc = mma(a, b, acc, UPCAST)
    out = y_ptr + rows[:, None] * sym + cols[None, :] * syn
    tl.store(out, cast_out(acc, y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gmm_dw_kernel(
    x_ptr,
    dy_ptr,
    dw_ptr,
    offs_ptr,
    N,
    K,
    sxm,
    sxk,
    sym,
    syn,
    swe,
    swk,
    swn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    g = tl.program_id(0)
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    k_ok = ks < K
    col_ok = cols < N
    lo = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    hi = tl.load(offs_ptr + g)
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    for m0 in range(lo, hi, BM):  # an empty group leaves its gradient zero
        rows = m0 + tl.arange(0, BM).to(tl.int64)
        row_ok = rows < hi
        a = tl.load(
            x_ptr + rows[None, :] * sxm + ks[:, None] * sxk,
            mask=k_ok[:, None] & row_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            dy_ptr + rows[:, None] * sym + cols[None, :] * syn,
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc = mma(a, b, acc, UPCAST)
    out = dw_ptr + g.to(tl.int64) * swe + ks[:, None] * swk + cols[None, :] * swn
    tl.store(out, cast_out(acc, dw_ptr.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


def gmm_forward(x_MK: torch.Tensor, w_eKN: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
    """Launch ``y = x @ w[group]`` ([M, N]); ``w_eKN`` may be a transposed view (strides)."""
    M, K = x_MK.shape
    E, _, N = w_eKN.shape
    y_MN = x_MK.new_empty(M, N)
    if M and N and E:
        grid = (triton.cdiv(M, BLOCK_M) + E, triton.cdiv(N, BLOCK_N))
        _gmm_kernel[grid](
            x_MK,
            w_eKN,
            y_MN,
            offs_e,
            E,
            N,
            K,
            *x_MK.stride(),
            *w_eKN.stride(),
            *y_MN.stride(),
            BM=BLOCK_M,
            BN=BLOCK_N,
            BK=BLOCK_K,
            UPCAST=upcast_dot(),
        )
    return y_MN


def gmm_weight_grad(
    x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_e: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """Launch ``dw[i] = x_i^T @ dy_i`` ([e, K, N], zeros for an empty group)."""
    K, N = x_MK.shape[1], dy_MN.shape[1]
    dw_eKN = x_MK.new_empty(num_groups, K, N)
    if num_groups and K and N:
        grid = (num_groups, triton.cdiv(K, BLOCK_K), triton.cdiv(N, BLOCK_N))
        _gmm_dw_kernel[grid](
            x_MK,
            dy_MN,
            dw_eKN,
            offs_e,
            N,
            K,
            *x_MK.stride(),
            *dy_MN.stride(),
            *dw_eKN.stride(),
            BM=BLOCK_M,
            BN=BLOCK_N,
            BK=BLOCK_K,
            UPCAST=upcast_dot(),
        )
    return dw_eKN


def _gmm_bwd(saved, dy_MN, needs, launch):
    """The backward of both paths: ``launch`` the grouped GEMM and its weight gradient, as
    launchers (eager) or as their custom ops (compiled)."""
    x_MK, w_eKN, offs_e = saved
    gemm, dw_gemm = launch
    dy_MN = dy_MN.contiguous()
    dx = dw = None
    if needs[0]:
        dx = gemm(dy_MN, w_eKN.transpose(1, 2), offs_e)
    if needs[1]:
        dw = dw_gemm(x_MK, dy_MN, offs_e, w_eKN.shape[0])
    return dx, dw, None


class _GroupedGemm(torch.autograd.Function):
    """The eager path; under torch.compile the custom ops below (kernels/__init__.py)."""

    @staticmethod
    def forward(ctx, x_MK, w_eKN, offs_e):
        ctx.save_for_backward(x_MK, w_eKN, offs_e)
        return gmm_forward(x_MK, w_eKN, offs_e)

    @staticmethod
    def backward(ctx, dy_MN):
        launch = (gmm_forward, gmm_weight_grad)
        return _gmm_bwd(ctx.saved_tensors, dy_MN, ctx.needs_input_grad, launch)


# Under torch.compile: the same launchers as custom ops (kernels/__init__.py).
def _gmm_op_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gmm_op_backward(ctx, dy_MN):
    launch = (gmm_op, gmm_weight_grad_op)
    return _gmm_bwd(ctx.saved_tensors, dy_MN, ctx.needs_input_grad, launch)


gmm_weight_grad_op = kernel_op(
    "grouped_gemm_dw",
    "(Tensor x_MK, Tensor dy_MN, Tensor offs_e, SymInt num_groups) -> Tensor",
    gmm_weight_grad,
    lambda x_MK, dy_MN, offs_e, num_groups: x_MK.new_empty(
        num_groups, x_MK.shape[1], dy_MN.shape[1]
    ),
)
gmm_op = kernel_op(
    "grouped_gemm",
    "(Tensor x_MK, Tensor w_eKN, Tensor offs_e) -> Tensor",
    gmm_forward,
    lambda x_MK, w_eKN, offs_e: x_MK.new_empty(x_MK.shape[0], w_eKN.shape[2]),
    _gmm_op_backward,
    _gmm_op_setup,
)


def check_gemm_args(x_MK: torch.Tensor, w_eKN: torch.Tensor, offs_e: torch.Tensor) -> None:
    """Shapes and dtypes of a grouped GEMM (nothing read from the device)."""
    check_float("x_MK", x_MK)
    check_device("x_MK", x_MK)
    if w_eKN.dim() != 3 or x_MK.dim() != 2 or w_eKN.shape[1] != x_MK.shape[1]:
        raise ValueError(
            f"x_MK {tuple(x_MK.shape)} and w_eKN {tuple(w_eKN.shape)} must be [M, K] and [e, K, N]"
        )
    if w_eKN.dtype != x_MK.dtype:
        raise ValueError(f"w_eKN ({w_eKN.dtype}) must have x_MK's dtype ({x_MK.dtype})")
    if offs_e.dtype != torch.int32 or offs_e.shape != (w_eKN.shape[0],):
        raise ValueError(
            f"offs_e must be int32 [{w_eKN.shape[0]}] (end rows), got "
            f"{offs_e.dtype} {tuple(offs_e.shape)}"
        )


def grouped_gemm(x_MK: torch.Tensor, w_eKN: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
    """Rows of group i times ``w_eKN[i]``; returns [M, N] in x's dtype.

    Args:
        x_MK: expert-contiguous rows.
        w_eKN: one weight per group, x's dtype.
        offs_e: int32 end row of each group on the device (``experts.group_offsets``); the
            last must be M.
    """
    check_gemm_args(x_MK, w_eKN, offs_e)
    fn = gmm_op if torch.compiler.is_compiling() else _GroupedGemm.apply
    return fn(x_MK.contiguous(), w_eKN, offs_e.contiguous())
