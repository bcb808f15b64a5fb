"""swiglu_act (SwiGLU's elementwise part) against ``silu(a) * b``, forward and backward, under
Triton's interpreter (tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moesaic.kernels.swiglu_act import BLOCK, swiglu_act, swiglu_act_reference

# (rows, columns): one element, a partial program, several programs with a ragged tail, none
SHAPES = [(1, 1), (3, 37), (5, BLOCK // 2 + 3), (0, 8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_act_matches_reference(shape, dtype, close):
    gen = torch.Generator().manual_seed(sum(shape))
    a = (2 * torch.randn(*shape, generator=gen)).to(dtype).requires_grad_()
    b = torch.randn(*shape, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(*shape, generator=gen).to(dtype)
    h = swiglu_act(a, b)
    da, db = torch.autograd.grad(h, (a, b), g)
    a_ref, b_ref = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    h_ref = swiglu_act_reference(a_ref, b_ref)
    da_ref, db_ref = torch.autograd.grad(h_ref, (a_ref, b_ref), g)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    h64 = swiglu_act_reference(a64, b64)
    da64, db64 = torch.autograd.grad(h64, (a64, b64), g.double())
    close(h, h_ref, h64, "h")
    close(da, da_ref, da64, "a.grad")
    close(db, db_ref, db64, "b.grad")


def test_swiglu_act_refuses_mismatched_operands():
    a = torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"b .* must have a's shape"):
        swiglu_act(a, torch.randn(3, 2))
