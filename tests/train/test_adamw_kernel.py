"""The run's AdamW (issue 49 item 5): fused on a GPU, foreach elsewhere, and a fused step still
tells in-place watchers that the weights changed (hybrid's gathered copies are keyed by the
parameters' version counters, which the fused kernel does not bump)."""

from __future__ import annotations

import torch

from moesaic.train.loop import adamw_kernel, make_adamw


def test_the_kernel_follows_the_device():
    assert adamw_kernel(torch.device("cpu")) == {"foreach": True}
    assert adamw_kernel(torch.device("cuda", 3)) == {"fused": True}


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=gen)) for _ in range(3)]


def test_a_fused_step_bumps_every_version_and_updates_as_foreach_does():
    fused_params, foreach_params = _params(), _params()
    fused = make_adamw(fused_params, lr=0.1, device=torch.device("cuda"))  # fused runs on CPU
    foreach = make_adamw(foreach_params, lr=0.1, device=torch.device("cpu"))
    for step in range(3):
        for a, b in zip(fused_params, foreach_params):
            g = torch.full_like(a, 0.5 + step)
            a.grad, b.grad = g.clone(), g.clone()
        before = [p._version for p in fused_params]
        fused.step()
        foreach.step()
        assert all(p._version > v for p, v in zip(fused_params, before)), step
    for a, b in zip(fused_params, foreach_params):
        # the same update rule; fused and foreach kernels round differently (fp32, 3 steps)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
