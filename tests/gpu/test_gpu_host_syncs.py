"""No host sync in a layer step at EP 1: ``torch.cuda.set_sync_debug_mode("error")`` raises on
any operation that makes the host wait for the GPU (``.item()``, ``.tolist()``, ``nonzero``,
boolean-mask indexing, blocking copies) during a forward + backward of ``dropless`` and of
``padded`` with a capacity factor (the CPU budget test, tests/test_host_syncs.py, counts the
same operations without a GPU). A warm-up step first: one-time work (the grouped-GEMM
self-check, the dtype agreement) may read the device once.

In bf16, what GPUs train in (the first GPU run, issue 27, found fp32 steps syncing: on an H100/H200
``torch._grouped_mm`` runs bf16 natively and other dtypes through a fallback). A failure lists
where each sync was issued ("warn" mode, the Python line of each).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _gpu_helpers import NEEDS_CUDA

from moesaic import MoEConfig, MoELayer, aux_loss
from moesaic.testing import SYNC_WARNING

pytestmark = NEEDS_CUDA
CASES = [
    pytest.param({"dispatcher": "dropless"}, id="dropless"),
    pytest.param({"dispatcher": "padded", "capacity_factor": 1.25}, id="padded-cf1.25"),
]


@pytest.mark.parametrize("overrides", CASES)
def test_layer_step_does_not_sync_the_host(overrides):
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = MoEConfig(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2, **overrides)
    torch.manual_seed(0)
    layer = MoELayer(cfg).to(device, torch.bfloat16)
    x = torch.randn(256, 64, device=device, dtype=torch.bfloat16)
    g = torch.randn(256, 64, device=device, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        xr = x.detach().requires_grad_()
        y = layer(xr)
        ((y * g).sum() + aux_loss(layer)).backward()
        return y.detach()

    step()
    layer.zero_grad(set_to_none=True)
    layer.take_stats()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            y = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)]
    assert not syncs, f"{len(syncs)} host syncs in one step, at: {syncs}"
    assert bool(torch.isfinite(y).all())
    assert all(p.grad is not None for p in layer.parameters())


def test_the_training_loops_batch_copy_does_not_sync_the_host():
    """The loop's batch goes to the GPU through pinned memory, asynchronously
    (``train.loop.to_device``): the H200's training step counted the pageable copies of the
    inputs and the targets as two syncs a step. Same values as a plain copy."""
    from moesaic.train.loop import to_device

    device = torch.device("cuda", torch.cuda.current_device())
    x_BT = torch.randint(0, 50_000, (8, 2048))
    to_device(x_BT, device)  # first pinned allocation outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = to_device(x_BT, device)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got.cpu(), x_BT)
