"""``MoEConfig.kernels`` is resolved once per device type (``moesaic.kernels.KernelChoice``), when
the router and the experts are built, not on every forward; the choice is what the forward runs."""

from __future__ import annotations

import pytest
import torch

import moesaic
import moesaic.kernels
from moesaic.experts import expert_ffn
from moesaic.kernels import KernelChoice


def _counting(monkeypatch) -> list[tuple[str, str]]:
    """Every ``moesaic.kernels.resolve`` call from now on, as (option, device type)."""
    calls: list[tuple[str, str]] = []
    real = moesaic.kernels.resolve

    def counted(kernels: str, device: torch.device) -> str:
        calls.append((kernels, device.type))
        return real(kernels, device)

    monkeypatch.setattr(moesaic.kernels, "resolve", counted)
    return calls


def _cfg(kernels: str) -> moesaic.MoEConfig:
    return moesaic.MoEConfig(
        hidden_size=16, ffn_hidden_size=32, num_experts=4, top_k=2, kernels=kernels
    )


def test_a_layer_resolves_auto_when_built_and_never_per_forward(monkeypatch):
    calls = _counting(monkeypatch)
    torch.manual_seed(0)
    layer = moesaic.MoELayer(_cfg("auto"))
    assert calls == [("auto", "cpu"), ("auto", "cpu")]  # the router's and the experts'
    x = torch.randn(2, 8, 16, requires_grad=True)
    for _ in range(3):
        layer(x).sum().backward()
    assert len(calls) == 2, calls
    assert layer.router.kernel_choice.for_device(x.device) == "torch"  # auto on a CPU


def test_auto_trains_as_its_choice(monkeypatch):
    torch.manual_seed(0)
    auto = moesaic.MoELayer(_cfg("auto"))
    plain = moesaic.MoELayer(_cfg("torch"))
    plain.load_state_dict(auto.state_dict())
    x = torch.randn(2, 8, 16)
    xa, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yp = auto(xa), plain(xp)
    (ya * ya).sum().backward()
    (yp * yp).sum().backward()
    # the same kernels ("torch" on a CPU) on the same weights: bit for bit
    assert torch.equal(ya, yp) and torch.equal(xa.grad, xp.grad)
    for (name, pa), pp in zip(auto.named_parameters(), plain.parameters()):
        assert torch.equal(pa.grad, pp.grad), name


def test_the_choice_follows_a_move_to_another_device_type(monkeypatch):
    calls = _counting(monkeypatch)
    monkeypatch.setattr(moesaic.kernels, "triton_available", lambda: True)
    choice = KernelChoice("auto", torch.device("cpu"))
    assert choice.for_device(torch.device("cpu")) == "torch"
    cuda = torch.device("cuda", 0)  # resolving reads the device type only: no GPU needed
    assert [choice.for_device(cuda) for _ in range(3)] == ["fused"] * 3
    assert calls == [("auto", "cpu"), ("auto", "cuda")]


def test_expert_ffn_refuses_an_unresolved_choice():
    w1, w2 = torch.randn(2, 4, 8), torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match=r'^expert_ffn: kernels must be resolved .* got "auto"'):
        expert_ffn(torch.randn(3, 4), [1, 2], w1, None, w2, kernels="auto")
