"""The chunked training loss (``train.lm_loss``) against ``F.cross_entropy`` on the upcast logits:
loss and logits' gradient, fp32 and bf16 logits, several chunks (the chunk shrunk to a few rows),
ignored targets; no host sync.

Tolerance: fp32 values within 1e-6 relative (both sum the same fp32 terms in another order:
log-sum-exp per row against the log-softmax); bf16 gradients equal after both round the same
fp32 values, within one bf16 ulp where those fp32 values differ in their last bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moesaic import loss_chunk as module
from moesaic.testing import HostSyncCounter
from moesaic.train.lm_loss import IGNORE_INDEX, lm_loss


def _case(dtype: torch.dtype, ignore: bool):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50, generator=gen)).to(dtype)
    y = torch.randint(0, 50, (3, 7), generator=gen)
    if ignore:
        y[0, :3] = IGNORE_INDEX
        y[2, 6] = IGNORE_INDEX
    return logits, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ignore", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 4, 1000])
def test_equals_cross_entropy_on_the_upcast_logits(monkeypatch, dtype, ignore, chunk_rows):
    monkeypatch.setattr(module, "LOSS_CHUNK_ELEMENTS", chunk_rows * 50)
    logits, y = _case(dtype, ignore)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    got = lm_loss(a, y)
    want = F.cross_entropy(b.flatten(0, 1).float(), y.flatten())
    before = a.detach().clone()
    (2.5 * got).backward()
    (2.5 * want).backward()
    assert torch.equal(a.detach(), before)  # the logits are the caller's: left as they were
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert a.grad.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-9)
    else:
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=2**-7, atol=1e-9)
    if ignore:  # ignored rows get no gradient
        assert not a.grad[0, :3].any() and not a.grad[2, 6].any()


def test_reads_nothing_on_the_host(monkeypatch):
    monkeypatch.setattr(module, "LOSS_CHUNK_ELEMENTS", 4 * 50)
    logits, y = _case(torch.float32, True)
    logits.requires_grad_()
    with HostSyncCounter() as syncs:
        lm_loss(logits, y).backward()
    syncs.check(at_most=0, what="lm_loss forward + backward")
