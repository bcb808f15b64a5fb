"""FSDP2 x EP (``train/fsdp.py``): a sharded run against the unsharded one on 4 gloo ranks.

``--dp-shard 2 --ep 2`` (dense parameters sharded over all 4 ranks, each EP rank's experts over
the 2 ranks beside it) against EP 2 x DP 2 without sharding, from the same initial weights on
the same batches: the loss, the global gradient norm, every gradient (gathered with
``full_tensor``, taken after clipping, right before AdamW reads it), the router statistics and
the auxiliary-loss-free score biases, for 3 optimizer steps. Both runs live in the same 4
processes, one after the other (one spawn).

Tolerance: rtol 1e-5 (the issue's). The forward is the same arithmetic on the same gathered
weights; only the gradient reduction differs in order: a SUM reduce-scatter over 4 ranks
against a SUM all-reduce over 4 (dense) or 2 (experts) ranks, each an fp32 sum of at most 4
terms. Such a sum is within 3 * 2^-24 * sum(|g_r|) of the exact one; where the terms cancel
that bound exceeds rtol * |g| on its own, so each gradient also gets atol = 1e-6 x its largest
magnitude (the step's largest rounding, ~4 * 6e-8 of the largest term, with margin). Measured
errors are printed by ``python tests/train/test_fsdp.py``.

The learning rate is 1e-3, not the runs' 1e-2: AdamW's first update is lr * sign(g) for every
element, so a gradient element within rounding of zero (1e-7 of the largest here) moves its
weight by +lr in one run and -lr in the other; at lr 1e-2 that alone grew the step-3 gradient
difference to 6.4e-6 of the largest gradient (the step-1 difference: 1.5e-7), which is AdamW
amplifying summation order, not sharding. At 1e-3 the same amplification stays below atol.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from moesaic.comm.collectives import EPGroup
from moesaic.comm.world import run_world
from moesaic.models import MoEGPT, MoEGPTConfig
from moesaic.schedule import make_step
from moesaic.schedule.base import StepParts

STEPS = 3
TIMEOUT_S = 60.0
TINY = {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}
MOE = {"num_experts": 4, "ffn_hidden_size": 32, "score_bias_update_rate": 0.01}


def _config(strategy: str) -> MoEGPTConfig:
    return MoEGPTConfig.from_dict({**TINY, "moe": {**MOE, "dispatcher": strategy}})


def _loss(logits_BTV, y_BT):
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(rank: int, strategy: str, dp_shard: int | None, schedule: str = "vanilla") -> dict:
    """3 steps of EP 2 on 4 ranks; ``dp_shard`` None: unsharded (EP 2 x DP 2)."""
    from moesaic.train.fsdp import MeshShape, ShardedGradientSync, build_mesh, shard_model
    from moesaic.train.loop import _step_stats, _update_score_biases
    from moesaic.train.parallel import GradientSync, build_layout

    layout = build_layout(2, TIMEOUT_S)
    torch.manual_seed(0)
    model = MoEGPT(_config(strategy), layout.ep_group)
    if dp_shard is None:
        sync = GradientSync(layout)
    else:
        mesh = build_mesh(MeshShape(dp_shard=dp_shard, ep=2), "cpu", TIMEOUT_S)
        shard_model(model, mesh)
        sync = ShardedGradientSync(mesh, EPGroup(None, TIMEOUT_S))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), foreach=False)
    grads: list[dict[str, torch.Tensor]] = []

    def snapshot(*_):
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})

    optimizer.register_step_pre_hook(snapshot)
    parts = StepParts(
        model=model, loss_fn=_loss, grad_sync=sync, optimizer=optimizer, grad_clip=0.5
    )
    step = make_step(schedule, parts)
    out: dict = {"loss": [], "norm": [], "loads": [], "bias": []}
    for s in range(STEPS):
        gen = torch.Generator().manual_seed(100 * s + rank)
        x_BT = torch.randint(0, 256, (2, 16), generator=gen)
        y_BT = torch.randint(0, 256, (2, 16), generator=gen)
        result = step.run(x_BT, y_BT)
        assert result.applied
        loss, _, loads, routed = _step_stats(model, result.ce, result.aux, layout, "cpu")
        _update_score_biases(model, routed)
        out["loss"].append(loss)
        out["norm"].append(result.grad_norm)
        out["loads"].append(loads)
        out["bias"].append([m.router.score_bias.clone() for _, m in model.moe_layers()])
    out["grads"] = grads
    out["weights"] = {n: _full(p) for n, p in model.named_parameters()}
    return out


def _both(rank: int, world_size: int, strategy: str) -> tuple[dict, dict]:
    return _train(rank, strategy, None), _train(rank, strategy, 2)


def _max_errors(ref: dict, got: dict) -> tuple[float, float]:
    """The largest relative error of the losses and of any gradient element (vs its max)."""
    loss = max(abs(a - b) / abs(a) for a, b in zip(ref["loss"], got["loss"], strict=True))
    grad = 0.0
    for g_ref, g_got in zip(ref["grads"], got["grads"], strict=True):
        for name, t in g_ref.items():
            grad = max(grad, float((t - g_got[name]).abs().max() / t.abs().max().clamp_min(1e-30)))
    return loss, grad


@functools.cache
def _runs(strategy: str) -> list[tuple[dict, dict]]:
    return run_world(_both, 4, strategy, timeout_s=240.0)


@pytest.mark.parametrize("strategy", ["dropless", "padded"])
def test_dp_shard_2_ep_2_equals_ep_2_dp_2(strategy):
    for rank, (ref, got) in enumerate(_runs(strategy)):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), rank
        assert got["norm"] == pytest.approx(ref["norm"], rel=1e-5), rank
        assert got["loads"] == ref["loads"], rank  # router statistics: counts, exactly
        for b_ref, b_got in zip(ref["bias"], got["bias"], strict=True):
            for a, b in zip(b_ref, b_got, strict=True):
                torch.testing.assert_close(b, a, rtol=0, atol=0)  # sign updates: exact
        assert len(got["grads"]) == len(ref["grads"]) == STEPS
        for g_ref, g_got in zip(ref["grads"], got["grads"], strict=True):
            assert g_got.keys() == g_ref.keys()
            for name, t in g_ref.items():
                atol = 1e-6 * float(t.abs().max())
                torch.testing.assert_close(g_got[name], t, rtol=1e-5, atol=atol, msg=name)
        for name, w in ref["weights"].items():
            atol = 1e-6 * float(w.abs().max())
            torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=atol, msg=name)


if __name__ == "__main__":
    for strategy in ("dropless", "padded"):
        errs = [_max_errors(ref, got) for ref, got in _runs(strategy)]
        print(strategy, "max relative loss error", max(e[0] for e in errs))
        print(strategy, "max gradient error / max |g|", max(e[1] for e in errs))
