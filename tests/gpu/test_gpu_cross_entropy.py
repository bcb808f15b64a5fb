"""The loss's Triton rows compiled for a GPU (``kernels.cross_entropy``; tests/kernels runs them
under the interpreter) against the chunked torch path and float64, at a large vocabulary
(Qwen3's 151936, several ``BLOCK_V`` steps a row), bf16 and fp32 logits, ignored targets.

Tolerance: the kernels' rule (``assert_close_to_ref``: at most 2x the torch path's own error
against float64, plus 4 fp32 ulps at the tensor's scale)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _gpu_helpers import NEEDS_CUDA

from moesaic.testing import assert_close_to_ref
from moesaic.train.lm_loss import IGNORE_INDEX, lm_loss

pytestmark = NEEDS_CUDA


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_kernel_on_cuda_matches_torch(dtype):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(0)
    N, V = 64, 151936
    logits = (3 * torch.randn(N, V, generator=gen)).to("cuda", dtype)
    y = torch.randint(0, V, (N,), generator=gen).cuda()
    y[:5] = IGNORE_INDEX
    runs = []
    for kernels in ("triton", "torch"):
        x = logits.clone().requires_grad_()
        loss = lm_loss(x.view(1, N, V), y.view(1, N), kernels=kernels)
        loss.backward()
        runs.append((loss.detach(), x.grad))
    x64 = logits.double().requires_grad_()
    loss64 = F.cross_entropy(x64, y, ignore_index=IGNORE_INDEX)
    loss64.backward()
    (loss_k, grad_k), (loss_t, grad_t) = runs
    assert_close_to_ref(loss_k, loss_t, loss64.detach(), "loss")
    assert_close_to_ref(grad_k, grad_t, x64.grad, "grad")
    assert torch.all(grad_k[:5] == 0)
