"""The training-step schedule: its registry, the block stages it pipelines, the vanilla step
against the loop body it replaced (bitwise) and one aux-loss read per backward."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from moesaic.comm.world import run_world
from moesaic.layer import aux_loss
from moesaic.models import MoEGPT, MoEGPTConfig
from moesaic.schedule import make_step, schedule_names
from moesaic.schedule.base import StepParts
from moesaic.train.config import TrainConfig

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}


def tiny(**moe) -> MoEGPTConfig:
    return MoEGPTConfig.from_dict({**TINY, "moe": {"num_experts": 4, "ffn_hidden_size": 32, **moe}})


def _lm_loss(logits_BTV, y_BT):
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), foreach=False)


def test_block_stages_compose_to_forward():
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.from_dict({**TINY, "dense_layers": 1}))  # a dense and an MoE block
    idx_BT = torch.randint(0, 256, (2, 16))
    ref_BTV = model(idx_BT)
    aux_loss(model)
    x_BTD = model.embed(idx_BT)
    for block in model.blocks:
        x_BTD, h_BTD = block.attention_stage(x_BTD)
        torch.testing.assert_close(h_BTD, block.ln2(x_BTD), rtol=0, atol=0)
        x_BTD = block.expert_stage(x_BTD, h_BTD)
    assert torch.equal(model.head(x_BTD), ref_BTV)


def test_registry_is_the_one_list():
    assert schedule_names()[0] == "vanilla" == TrainConfig().schedule
    with pytest.raises(ValueError, match=r"schedule \('flow'\) must be one of 'vanilla'"):
        TrainConfig(schedule="flow")
    model = MoEGPT(tiny())
    parts = StepParts(model=model, loss_fn=_lm_loss, grad_sync=None, optimizer=_optimizer(model))
    with pytest.raises(ValueError, match=r"schedule \('nope'\) must be one of"):
        make_step("nope", parts)


def _old_loop_step(model, layout, optimizer, x_BT, y_BT, grad_clip):
    """The training loop's step body before it became a schedule (moesaic 0.1), verbatim."""
    from moesaic.layer import is_expert_param
    from moesaic.train.parallel import GradientSync

    ce = _lm_loss(model(x_BT), y_BT)
    aux = aux_loss(model).to(ce.device)
    (ce + aux).backward()
    GradientSync(layout).sync(list(model.parameters()))
    params = [p for p in model.parameters() if p.grad is not None]
    rep_sq = torch.zeros((), dtype=torch.float64)
    exp_sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        sq = p.grad.detach().double().square().sum()
        if is_expert_param(p):
            exp_sq += sq
        else:
            rep_sq += sq
    layout.ep.all_reduce(exp_sq, what="norm")
    norm = math.sqrt(float(rep_sq + exp_sq))
    if grad_clip > 0 and norm > grad_clip:
        for p in params:
            p.grad.mul_(grad_clip / (norm + 1e-6))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(ce), norm


def _schedule_vs_old_world(rank, world_size, name, ep):
    from moesaic.train.parallel import GradientSync, build_layout

    layout = build_layout(ep, 60.0)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 256, (2, 17), generator=gen) for _ in range(3)]
    runs = []
    for use_schedule in (False, True):
        torch.manual_seed(0)
        model = MoEGPT(tiny(), ep_group=layout.ep_group)
        optimizer = _optimizer(model)
        parts = StepParts(
            model=model,
            loss_fn=_lm_loss,
            grad_sync=GradientSync(layout),
            optimizer=optimizer,
            grad_clip=0.5,  # small enough that every step clips
        )
        step = make_step(name, parts)
        trace = []
        for x_BT in batches:
            if use_schedule:
                result = step.run(x_BT[:, :-1], x_BT[:, 1:])
                assert result.applied
                trace.append((float(result.ce), result.grad_norm))
            else:
                trace.append(
                    _old_loop_step(model, layout, optimizer, x_BT[:, :-1], x_BT[:, 1:], 0.5)
                )
        runs.append((trace, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return runs


def _every_schedule_world(rank, world_size, ep):
    return {name: _schedule_vs_old_world(rank, world_size, name, ep) for name in schedule_names()}


@functools.cache
def _all_vs_old_loop() -> list[dict]:
    """Every schedule against the old loop, one after the other in one spawned world (a spawn
    costs seconds on 2 cores)."""
    return run_world(_every_schedule_world, 2, 2)


def _vs_old_loop(name: str) -> list:
    return [r[name] for r in _all_vs_old_loop()]


@pytest.mark.parametrize("name", schedule_names())
def test_every_schedule_trains_like_the_old_loop(name):
    """DP 1 x EP 2, clipping on: weights after 3 steps within fp32 reordering noise."""
    for (old_trace, old_w), (_, w) in _vs_old_loop(name):
        assert all(n > 0.5 for _, n in old_trace)  # clipping was exercised
        for k in w:
            torch.testing.assert_close(w[k], old_w[k], rtol=1e-4, atol=1e-6, msg=k)


def test_vanilla_is_the_old_loop_bitwise():
    """The vanilla step is the pre-schedule loop body: losses and weights bitwise; the norm
    to float64 rounding (it is summed in float64 without a float64 copy now,
    ``moesaic.gradnorm``, where the old loop squared one)."""
    for (old_trace, old_w), (trace, w) in _vs_old_loop("vanilla"):
        assert [ce for ce, _ in trace] == [ce for ce, _ in old_trace]
        assert [n for _, n in trace] == pytest.approx([n for _, n in old_trace], rel=1e-12)
        assert all(torch.equal(w[k], old_w[k]) for k in w)


def test_aux_loss_read_once_per_backward(monkeypatch):
    """The step reads ``moesaic.aux_loss`` once per backward (the layers' sum is read-and-reset),
    and that read is what it trains on."""
    import moesaic.schedule.vanilla as vanilla
    from moesaic.train.parallel import GradientSync, build_layout

    reads = []

    def counting(model):
        reads.append(aux := aux_loss(model))
        return aux

    monkeypatch.setattr(vanilla, "aux_loss", counting)
    torch.manual_seed(0)
    model = MoEGPT(tiny(aux_loss_coef=0.1))
    layout = build_layout(1, 60.0)
    parts = StepParts(
        model=model, loss_fn=_lm_loss, grad_sync=GradientSync(layout), optimizer=_optimizer(model)
    )
    step = make_step("vanilla", parts)
    x_BT = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    for i in range(2):
        result = step.run(x_BT[:, :-1], x_BT[:, 1:])
        assert len(reads) == i + 1 and float(result.aux) == float(reads[-1].detach()) > 0
    assert float(aux_loss(model)) == 0.0  # nothing left pending after the step
