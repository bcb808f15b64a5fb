"""The layer-level case the kernel tests share: a small MoE layer at odd sizes (E = 5, a prime;
T = 13, H = 24, F = 40), its weights, an input and an output gradient, and one forward and
backward of a layer built from those weights."""

from __future__ import annotations

import torch

import moesaic
from moesaic.reference import ReferenceMoE
from moesaic.testing import assert_close_to_ref, route_all_to_first_experts


def odd_layer_case(extra: dict, skew: bool):
    """``(cfg, state_dict, x, g)``; ``extra`` are further ``MoEConfig`` fields, ``skew`` routes
    every token to experts 0 and 1 (the others stay empty)."""
    cfg = moesaic.MoEConfig(
        hidden_size=24, ffn_hidden_size=40, num_experts=5, top_k=2, init_std=0.5, **extra
    )
    torch.manual_seed(0)
    layer = moesaic.MoELayer(cfg)
    if skew:
        route_all_to_first_experts(layer)
    sd = layer.state_dict()
    x = torch.randn(13, 24)
    if skew:
        x[:, 0] = 5.0
    g = torch.randn(13, 24)
    return cfg, sd, x, g


def run_layer(cfg: moesaic.MoEConfig, sd: dict, x: torch.Tensor, g: torch.Tensor):
    """Output, input gradient and every parameter's gradient of a layer of ``cfg`` loaded with
    ``sd``, for the loss ``sum(y * g) + aux``."""
    layer = moesaic.MoELayer(cfg)
    layer.load_state_dict(sd)
    x = x.clone().requires_grad_()
    y = layer(x)
    ((y * g).sum() + moesaic.aux_loss(layer)).backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def reference_run(cfg: moesaic.MoEConfig, sd: dict, x: torch.Tensor, g: torch.Tensor):
    """:func:`run_layer`'s triple from ``ReferenceMoE`` in float64 (the yardstick the fast paths'
    errors are measured against)."""
    full = moesaic.MoELayer(cfg)
    full.load_state_dict(sd)
    ref64 = ReferenceMoE.from_full_state_dict(cfg, full.full_state_dict()).double()
    x = x.double().requires_grad_()
    y, aux = ref64(x)
    ((y * g.double()).sum() + aux).backward()
    return y.detach(), x.grad, {n: p.grad for n, p in ref64.named_parameters()}


def assert_runs_close(fast, other, ref) -> None:
    """Two :func:`run_layer` triples agree, each within what its dtype allows of ``ref``."""
    assert_close_to_ref(fast[0], other[0], ref[0], "y")
    assert_close_to_ref(fast[1], other[1], ref[1], "x.grad")
    for name, grad in fast[2].items():
        assert_close_to_ref(grad, other[2][name], ref[2][name], f"{name}.grad")
