"""MoELayer with ``kernels="triton"`` (every kernel from moesaic.kernels) and ``"fused"`` (its
router, permute, SwiGLU and combine around torch's grouped GEMMs) computes what ``kernels="torch"`` does
(EP 1, forward and every gradient), and the switch's errors; under Triton's interpreter
(tests/kernels/conftest.py)."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest
from _layer_case import assert_runs_close, odd_layer_case, reference_run, run_layer

import moesaic

CASES = [
    ({}, False),  # dropless SwiGLU: permute, fused SwiGLU GEMM, GEMM, combine
    ({}, True),  # every token to experts 0 and 1: three empty experts
    ({"capacity_factor": 0.5}, False),  # capacity drops: the dropped assignments get no row
    ({"activation": "gelu", "score_func": "sigmoid"}, False),  # the unfused GEMM pair
    ({"dispatcher": "padded"}, False),  # the padded dispatcher (at P = 1: grouped rows)
    ({"dispatcher": "hybrid"}, False),  # hybrid's domain FFN (at P = 1: no gathers)
]


@pytest.mark.parametrize("kernels", ["triton", "fused"])
@pytest.mark.parametrize(("extra", "skew"), CASES)
def test_layer_kernels_match_torch(kernels, extra, skew, monkeypatch):
    pytest.importorskip("triton")
    from moesaic.kernels import ffn

    calls: Counter[str] = Counter()
    for name in ("permute", "expert_ffn", "combine", "swiglu_act", "route"):
        monkeypatch.setattr(ffn, name, _spy(calls, name, getattr(ffn, name)))
    cfg, sd, x, g = odd_layer_case(extra, skew)
    y, gx, grads = run_layer(dataclasses.replace(cfg, kernels=kernels), sd, x, g)
    want = {"permute": 1, "combine": 1}  # it took the kernels
    if cfg.score_func == "softmax":  # the router after its gate GEMM in one kernel
        want["route"] = 1
    if kernels == "triton":
        want["expert_ffn"] = 1
    elif cfg.activation == "swiglu":
        want["swiglu_act"] = 1
    assert calls == want
    y_t, gx_t, grads_t = run_layer(dataclasses.replace(cfg, kernels="torch"), sd, x, g)
    assert calls == want, "the torch path called the kernels"
    assert_runs_close((y, gx, grads), (y_t, gx_t, grads_t), reference_run(cfg, sd, x, g))


def _spy(calls: Counter[str], name: str, fn):
    def counted(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return counted


def test_kernels_switch_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="kernels \\('cuda'\\) must be one of 'torch', 'triton'"):
        moesaic.MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=2, kernels="cuda")
    monkeypatch.setattr("moesaic.kernels.triton_available", lambda: False)
    with pytest.raises(ModuleNotFoundError, match=re.escape('pip install "triton>=3.0"')):
        moesaic.MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=2, kernels="triton")
    # the torch path never needs Triton
    moesaic.MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=2, kernels="torch")


def test_auto_is_fused_on_a_gpu_with_triton_and_torch_elsewhere(monkeypatch):
    import torch

    from moesaic.kernels import resolve

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert moesaic.MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=2).kernels == "auto"
    assert resolve("auto", cpu) == "torch"
    assert resolve("auto", cuda) == "fused"
    assert resolve("triton", cpu) == "triton" and resolve("torch", cuda) == "torch"
    monkeypatch.setattr("moesaic.kernels.triton_available", lambda: False)
    assert resolve("auto", cuda) == "torch"
    # "auto" never needs Triton; "fused" does
    moesaic.MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=2, kernels="auto")
    with pytest.raises(ModuleNotFoundError, match="triton"):
        moesaic.MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=2, kernels="fused")
