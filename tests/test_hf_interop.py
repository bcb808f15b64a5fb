"""A MoELayer built from a transformers Mixtral sparse-MoE block computes the same thing."""

from __future__ import annotations

import pytest
import torch

from moesaic.interop.hf import config_from_mixtral, moe_layer_from_mixtral
from moesaic.testing import run_world

transformers = pytest.importorskip("transformers")
from transformers import MixtralConfig  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402


def _block(seed: int = 0) -> MixtralSparseMoeBlock:
    torch.manual_seed(seed)
    cfg = MixtralConfig(
        hidden_size=32, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2
    )
    block = MixtralSparseMoeBlock(cfg)
    for p in block.parameters():  # tiny random init (no hub download)
        torch.nn.init.normal_(p, std=0.2)
    return block.eval()


def _hf_forward(block, x):
    out = block(x)
    return out[0] if isinstance(out, tuple) else out  # 4.x returns (y, router_logits)


def test_config_from_mixtral():
    cfg = config_from_mixtral(_block(), dispatcher="padded")
    assert (cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts, cfg.top_k) == (32, 48, 8, 2)
    assert cfg.score_func == "softmax" and cfg.normalize_topk and cfg.dispatcher == "padded"


@pytest.mark.parametrize("dispatcher", ["dropless", "padded"])
def test_mixtral_block_parity_forward_and_backward(dispatcher):
    block = _block()
    layer = moe_layer_from_mixtral(block, dispatcher=dispatcher)
    x = torch.randn(3, 10, 32)
    x_hf, x_ms = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf, y_ms = _hf_forward(block, x_hf), layer(x_ms)
    # Same fp32 math; the HF block adds the K weighted outputs with index_add_ in expert order,
    # we sum them in choice order: a couple of ulps at |y| ~ 1.
    torch.testing.assert_close(y_ms, y_hf, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y_hf)
    (y_hf * g).sum().backward()
    (y_ms * g).sum().backward()
    torch.testing.assert_close(x_ms.grad, x_hf.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        layer.router.weight.grad, block.gate.weight.grad, rtol=1e-4, atol=1e-6
    )
    if hasattr(block.experts, "down_proj"):  # transformers >= 5 layout: [E, H, F]
        want = block.experts.down_proj.grad.transpose(1, 2)
        torch.testing.assert_close(layer.experts.w2.grad, want, rtol=1e-4, atol=1e-6)


def mixtral_ep_worker(rank: int, world: int):
    block = _block()
    layer = moe_layer_from_mixtral(block)  # EP over the world: this rank keeps 8 / world experts
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(2, 6, 32, generator=gen)
    return (layer(x) - _hf_forward(block, x)).abs().max().item()


def test_mixtral_block_parity_with_expert_parallelism():
    errors = run_world(mixtral_ep_worker, 2, timeout_s=120)
    assert max(errors) < 1e-5  # same bound as the single-process test, at |y| ~ 1


def test_mixtral_block_from_layer_round_trip():
    import moesaic
    from moesaic.interop.hf import mixtral_block_from_layer

    cfg = moesaic.MoEConfig(hidden_size=16, ffn_hidden_size=32, num_experts=4, init_std=0.3)
    layer = moesaic.MoELayer(cfg)
    block = mixtral_block_from_layer(layer).eval()
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(_hf_forward(block, x), layer(x), rtol=1e-5, atol=1e-6)
    back = moe_layer_from_mixtral(block)
    for key, value in layer.full_state_dict().items():
        assert torch.equal(back.full_state_dict()[key], value), key
    with pytest.raises(ValueError, match="capacity_factor None"):
        mixtral_block_from_layer(
            moesaic.MoELayer(moesaic.MoEConfig(**{**_fields(cfg), "capacity_factor": 1.0}))
        )


def _fields(cfg):
    return {f: getattr(cfg, f) for f in cfg.__slots__}
