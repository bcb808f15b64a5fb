"""A step with zero tokens keeps the autograd graph connected for every strategy: backward
runs and every parameter gets a zero gradient (dropless's contract), never "element 0 of
tensors does not require grad" (issue 57, item 6: taskflow returned an unlinked output)."""

from __future__ import annotations

import pytest
import torch

import moesaic
from moesaic.strategies.registry import strategy_names

BASE = {"hidden_size": 16, "ffn_hidden_size": 12, "num_experts": 4, "top_k": 2}


@pytest.mark.parametrize("name", strategy_names())
def test_zero_tokens_backward_gives_zero_gradients(name: str) -> None:
    torch.manual_seed(0)
    layer = moesaic.MoELayer(moesaic.MoEConfig(**BASE, dispatcher=name))
    x_TH = torch.zeros(0, BASE["hidden_size"], requires_grad=True)
    y_TH = layer(x_TH)
    assert y_TH.shape == (0, BASE["hidden_size"])
    y_TH.sum().backward()
    assert x_TH.grad is not None and x_TH.grad.shape == x_TH.shape
    for pname, p in layer.named_parameters():
        assert p.grad is not None, f"{name}: {pname} has no gradient"
        assert torch.equal(p.grad, torch.zeros_like(p)), f"{name}: {pname}"
