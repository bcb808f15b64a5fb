"""The loss's Triton rows (``kernels.cross_entropy``, through ``lm_loss(kernels="triton")``)
against the chunked torch path (``kernels="torch"``) and ``F.cross_entropy`` in float64, under the interpreter: loss
and logits' gradient, fp32 and bf16 logits, rows longer than one ``BLOCK_V`` step (the online
log-sum-exp's rescaling), a -inf logit, ignored targets, an empty batch refused as the torch
path refuses it.

Tolerance (``close``, the kernels' rule): at most 2x the torch path's own error against
float64 on the same rounded logits, plus 4 fp32 ulps at the tensor's scale; the bf16 gradient
is rounded once from fp32 in both.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moesaic.kernels import cross_entropy as ce
from moesaic.train.lm_loss import IGNORE_INDEX, lm_loss


def _case(dtype, V, ignore, rows=9):
    gen = torch.Generator().manual_seed(V)
    logits = (4 * torch.randn(rows, V, generator=gen)).to(dtype)
    logits[1, 3] = float("-inf")  # a masked word: exp 0, no NaN
    y = torch.randint(0, V, (rows,), generator=gen)
    y[1] = 0
    if ignore:
        y[0] = y[5] = IGNORE_INDEX
    return logits, y


def _loss_and_grad(logits, y, kernels):
    x = logits.clone().requires_grad_()
    loss = lm_loss(x.view(1, *x.shape), y.view(1, -1), kernels=kernels)
    (3.0 * loss).backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [50, 2 * 64 + 7])
@pytest.mark.parametrize("ignore", [False, True])
def test_rows_kernel_equals_the_torch_path(monkeypatch, close, dtype, V, ignore):
    monkeypatch.setattr(ce, "BLOCK_V", 64)  # V 135: three steps, the last one partial
    logits, y = _case(dtype, V, ignore)
    loss_k, grad_k = _loss_and_grad(logits, y, "triton")
    loss_t, grad_t = _loss_and_grad(logits, y, "torch")
    x64 = logits.double().requires_grad_()  # the truth: torch's loss in float64
    loss_64 = F.cross_entropy(x64, y, ignore_index=IGNORE_INDEX)
    (3.0 * loss_64).backward()
    grad_64 = x64.grad
    close(loss_k, loss_t, loss_64.detach(), "loss")
    close(grad_k, grad_t, grad_64, "grad")
    ignored = y == IGNORE_INDEX
    assert torch.all(grad_k[ignored] == 0)
    assert torch.isfinite(grad_k).all() and grad_k[1, 3] == 0


def test_rows_need_row_contiguous_logits_and_matching_targets():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match="row-contiguous"):
        ce.ce_rows(logits.t(), torch.zeros(10, dtype=torch.long), IGNORE_INDEX)
    with pytest.raises(ValueError, match=r"targets must be \[N\] = \[4\]"):
        ce.ce_rows(logits, torch.zeros(3, dtype=torch.long), IGNORE_INDEX)
