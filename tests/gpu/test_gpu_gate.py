"""The router's half-precision gate on a GPU: ``torch.mm(..., out_dtype=float32)`` (the path
the CPU cannot take) against the fp32 linear on the same values, forward and backward, and the
narrowed sort keys' stable order on the GPU's radix sort."""

from __future__ import annotations

import pytest
import torch
from _gpu_helpers import NEEDS_CUDA

from moesaic.router_gate import gate_logits
from moesaic.routing import _narrow_keys

pytestmark = NEEDS_CUDA


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_gate_logits_on_cuda_match_the_fp32_linear(w_dtype):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4096, 512, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    w = (0.05 * torch.randn(64, 512, generator=gen)).to("cuda", w_dtype).requires_grad_()
    g = torch.randn(4096, 64, generator=gen).cuda()
    y = gate_logits(x, w)
    (y * g).sum().backward()
    x32 = x.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    assert not torch.backends.cuda.matmul.allow_tf32  # the fp32 linear in full fp32
    y32 = torch.nn.functional.linear(x32, w32)
    (y32 * g).sum().backward()

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    assert y.dtype == torch.float32 and rel(y, y32) < 1e-5
    assert rel(x.grad, x32.grad.to(torch.bfloat16).float()) < 1e-3
    assert rel(w.grad, w32.grad) < (1e-5 if w_dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("largest", [7, 63, 300, 70000])
def test_narrow_sort_keys_keep_the_stable_order_on_cuda(largest):
    keys = torch.randint(0, largest + 1, (200_000,), device="cuda")
    want = torch.sort(keys, stable=True).indices
    assert torch.equal(torch.sort(_narrow_keys(keys, largest), stable=True).indices, want)
