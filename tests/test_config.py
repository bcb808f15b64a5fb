"""Invalid configs and inputs raise ValueError naming the field and the rule."""

from __future__ import annotations

import pytest
import torch

import moesaic

BASE = {"hidden_size": 8, "ffn_hidden_size": 16, "num_experts": 4, "top_k": 2}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"top_k": 5}, r"top_k \(5\) must be <= num_experts \(4\)"),
        ({"hidden_size": 0}, r"hidden_size \(0\) must be > 0"),
        ({"ffn_hidden_size": -3}, r"ffn_hidden_size \(-3\) must be > 0"),
        ({"num_experts": 0}, r"num_experts \(0\) must be > 0"),
        ({"top_k": 0}, r"top_k \(0\) must be > 0"),
        ({"hidden_size": 8.0}, r"hidden_size must be an int"),
        ({"capacity_factor": 0.0}, r"capacity_factor \(0.0\) must be > 0"),
        ({"capacity_factor": -1.0}, r"capacity_factor \(-1.0\) must be a finite number >= 0"),
        ({"score_func": "tanh"}, r"score_func \('tanh'\) must be one of 'softmax', 'sigmoid'"),
        ({"activation": "relu"}, r"activation \('relu'\) must be one of"),
        ({"dispatcher": "magic"}, r"dispatcher \('magic'\) must be one of"),
        ({"collective_timeout_s": 0}, r"collective_timeout_s \(0\) must be > 0"),
        ({"aux_loss_coef": float("nan")}, r"aux_loss_coef \(nan\) must be a finite number"),
    ],
)
def test_invalid_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        moesaic.MoEConfig(**{**BASE, **overrides})


def test_config_is_kw_only():
    with pytest.raises(TypeError):
        moesaic.MoEConfig(8, 16, 4)  # type: ignore[misc]


def test_experts_not_divisible_by_ep_size():
    cfg = moesaic.MoEConfig(**{**BASE, "num_experts": 6})
    with pytest.raises(
        ValueError, match=r"num_experts \(6\) must be divisible by the expert-parallel size \(4\)"
    ):
        cfg.check_ep_size(4)


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (torch.randn(3, 7), r"input's last dimension \(7\) must equal hidden_size \(8\)"),
        (torch.ones(3, 8, dtype=torch.long), r"input must be a floating-point tensor"),
        (torch.tensor(1.0), r"input's last dimension \(scalar\) must equal hidden_size"),
    ],
)
def test_invalid_input(x, message):
    layer = moesaic.MoELayer(moesaic.MoEConfig(**BASE))
    with pytest.raises(ValueError, match=message):
        layer(x)


def test_load_full_state_dict_rejects_wrong_keys_and_shapes():
    layer = moesaic.MoELayer(moesaic.MoEConfig(**BASE))
    sd = layer.full_state_dict()
    with pytest.raises(ValueError, match=r"missing \['experts.w2'\]"):
        layer.load_full_state_dict({k: v for k, v in sd.items() if k != "experts.w2"})
    bad = dict(sd, **{"experts.w1": sd["experts.w1"][:2]})
    with pytest.raises(
        ValueError, match=r"experts.w1 has shape \(2, 8, 16\), must be \(4, 8, 16\)"
    ):
        layer.load_full_state_dict(bad)


def test_semantics_switches_are_validated():
    with pytest.raises(
        ValueError, match="balance_loss_choices \\('top1'\\) must be one of 'all', 'first'"
    ):
        moesaic.MoEConfig(
            hidden_size=4, ffn_hidden_size=4, num_experts=2, balance_loss_choices="top1"
        )
    with pytest.raises(ValueError, match="renormalize_after_drop must be a bool"):
        moesaic.MoEConfig(hidden_size=4, ffn_hidden_size=4, num_experts=2, renormalize_after_drop=1)
