"""SwiGLU's elementwise part alone: ``h = silu(a) * b`` from the two expert GEMMs' outputs, and
its backward, one pass over the rows each.

Shape legend: M rows, F expert hidden (any shape works: the kernels see flat elements).

Beside the library's grouped GEMMs (``torch._grouped_mm``), plain torch spends two kernels on
the forward (``silu``, then the product: 5 passes over ``[M, F]``) and three on the backward
(two products and ``silu_backward``: 9 passes). These take 3 and 5 passes, in fp32 math
(``h`` rounded once, not after ``silu`` and again after the product). The backward is
``swiglu._swiglu_bwd_kernel``, the one the fused GEMM path uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moesaic.kernels._jit import cast_out
from moesaic.kernels._launch import check_device, check_float, kernel_op
from moesaic.kernels.swiglu import launch_swiglu_bwd, swiglu_bwd_op

# Elements per program: 8 bf16 (16 bytes) per thread of 4 warps. Not tuned on a GPU.
BLOCK = 1024


def swiglu_act_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Plain torch: ``silu(a) * b``."""
    return F.silu(a) * b


@triton.jit
def _swiglu_act_fwd(a_ptr, b_ptr, h_ptr, numel, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    a = tl.load(a_ptr + i, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(h_ptr + i, cast_out(a * tl.sigmoid(a) * b, h_ptr.dtype.element_ty), mask=ok)


def _launch_fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = torch.empty_like(a)
    if a.numel():
        _swiglu_act_fwd[(triton.cdiv(a.numel(), BLOCK),)](a, b, h, a.numel(), BLOCK=BLOCK)
    return h


class _SwiGLUAct(torch.autograd.Function):
    """The eager path; under torch.compile the custom ops below (kernels/__init__.py)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _launch_fwd(a, b)

    @staticmethod
    def backward(ctx, dh):
        a, b = ctx.saved_tensors
        return launch_swiglu_bwd(dh, a, b, BLOCK)


# Under torch.compile: the same launchers as custom ops (kernels/__init__.py).
def _swiglu_act_op_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_act_op_backward(ctx, dh):
    a, b = ctx.saved_tensors
    return swiglu_bwd_op(dh, a, b, BLOCK)


_swiglu_act_op = kernel_op(
    "swiglu_act",
    "(Tensor a, Tensor b) -> Tensor",
    _launch_fwd,
    lambda a, b: torch.empty_like(a),
    _swiglu_act_op_backward,
    _swiglu_act_op_setup,
)


def swiglu_act(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` (same shape and dtype; fp32 math), differentiable in both.

    Args:
        a: the gate GEMM's output (``x @ w1``).
        b: the up GEMM's output (``x @ w3``), a's shape and dtype.
    """
    check_float("a", a)
    check_device("a", a)
    if b.shape != a.shape or b.dtype != a.dtype or b.device != a.device:
        raise ValueError(
            f"b ({tuple(b.shape)}, {b.dtype}, {b.device}) must have a's shape, dtype and "
            f"device ({tuple(a.shape)}, {a.dtype}, {a.device})"
        )
    fn = _swiglu_act_op if torch.compiler.is_compiling() else _SwiGLUAct.apply
    return fn(a.contiguous(), b.contiguous())
