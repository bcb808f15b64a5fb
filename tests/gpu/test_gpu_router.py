"""The router kernel compiled for a GPU (``moesaic.kernels.router``: tests/kernels runs it only
under the interpreter) against plain torch, forward and backward, at the layer shapes of
benchmarks/gpu_layer.py; and a bf16 layer routing through it against the torch router."""

from __future__ import annotations

import pytest
import torch
from _gpu_helpers import NEEDS_CUDA

from moesaic import MoEConfig, MoELayer, aux_loss

pytestmark = NEEDS_CUDA


@pytest.mark.parametrize(("T", "E", "K"), [(8192, 8, 2), (8192, 64, 8), (1000, 160, 6)])
def test_route_on_cuda_matches_torch(T, E, K):
    pytest.importorskip("triton")
    from moesaic.kernels.router import route, route_reference

    gen = torch.Generator().manual_seed(T + E)
    logits = (2 * torch.randn(T, E, generator=gen)).cuda().requires_grad_()
    ref_in = logits.detach().double().requires_grad_()
    out = route(logits, K)
    ref = route_reference(ref_in, K)
    assert torch.equal(out[0], ref[0]), "ids"
    assert torch.equal(out[3], ref[3].float()), "counts"
    ups = [torch.randn(t.shape, generator=gen).cuda() for t in (out[1], out[2], out[4])]
    loss = sum((t * u).sum() for t, u in zip((out[1], out[2], out[4]), ups, strict=True))
    loss_ref = sum((t * u.double()).sum() for t, u in zip((ref[1], ref[2], ref[4]), ups))
    (grad,) = torch.autograd.grad(loss, logits)
    (grad_ref,) = torch.autograd.grad(loss_ref, ref_in)
    for name, fast, r in (
        ("weights", out[1], ref[1]),
        ("probs_mean", out[2], ref[2]),
        ("z", out[4], ref[4]),
        ("logits.grad", grad, grad_ref),
    ):
        err = ((fast.double() - r).norm() / r.norm()).item()
        assert err < 1e-5, f"{name}: relative error {err}"


def test_bf16_layer_routes_through_the_kernel_as_torch_does():
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 512, generator=gen).to("cuda", torch.bfloat16)
    g = torch.randn(4096, 512, generator=gen).to("cuda", torch.bfloat16)
    runs = []
    for kernels in ("fused", "torch"):
        torch.manual_seed(0)
        cfg = MoEConfig(
            hidden_size=512, ffn_hidden_size=1024, num_experts=8, top_k=2, kernels=kernels
        )
        layer = MoELayer(cfg).to("cuda", torch.bfloat16)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        aux = aux_loss(layer)
        torch.autograd.backward([y, aux], [g, torch.ones_like(aux)])
        runs.append((y, xi.grad, layer.router.weight.grad))
    for name, fast, ref in zip(("y", "x.grad", "router.weight.grad"), *runs, strict=True):
        err = ((fast.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 1e-2, f"{name}: relative error {err} between the fused and torch routers"
