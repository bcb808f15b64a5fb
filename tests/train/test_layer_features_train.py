"""Today's layer features in a training run: the score bias of auxiliary-loss-free balancing
updated after every optimizer step from the step's global loads (all ranks, both flowmoe chunks),
checkpointed and loaded at another EP size; every second block MoE; shared experts."""

from __future__ import annotations

import dataclasses

import torch
from _train_helpers import read_metrics, tiny_args

from moesaic.cli import main
from moesaic.models.gpt import MoEGPT
from moesaic.train.checkpoint import (
    init_optimizer_state,
    load_checkpoint,
    load_model_for_inference,
    save_checkpoint,
)
from moesaic.train.ckpt_choice import latest_checkpoint
from moesaic.train.parallel import build_layout

GAMMA = 0.01
FEATURES = [
    *("--n-layers", "3", "--moe-layer-freq", "2", "--shared-experts", "1"),
    *("--score-bias-update-rate", str(GAMMA), "--balance-loss-scope", "global"),
    *("--seq-aux-loss-coef", "0.01", "--expert-groups", "2", "--topk-groups", "1"),
    *("--routed-scaling-factor", "2", "--schedule", "flowmoe", "--pipeline-degree", "2"),
    # odd: the bias oscillates at init (near-uniform scores), an odd sum of signs is never 0
    *("--steps", "7"),
]


def test_score_bias_follows_the_global_loads_and_survives_a_reshard(data_file, tmp_path):
    run = tmp_path / "run"
    assert main(tiny_args(data_file, run, *FEATURES)) == 0  # EP 2; biases agreed at each save
    # The checkpoint of EP 2 loaded whole into one process (EP 1): a reshard.
    model, _ = load_model_for_inference(latest_checkpoint(str(run)))
    names = [name for name, _ in model.moe_layers()]
    assert names == ["blocks.0.moe", "blocks.2.moe"]  # blocks 0 and 2 of 3: MoE; block 1 dense
    assert model.blocks[1].mlp is not None
    steps = [r["expert_load"] for r in read_metrics(run) if r["kind"] == "train"]
    assert len(steps) == 7
    for i, (_, layer) in enumerate(model.moe_layers()):
        assert layer.shared_experts is not None
        # dropless: the logged loads (both ranks, both chunks) are the loads the bias saw
        want = torch.zeros(4, dtype=torch.float64)
        for loads in steps:
            load = torch.tensor(loads[i], dtype=torch.float64)
            assert load.sum() == 2 * 4 * 32 * 2  # ranks x batch x seq_len x top_k
            want += GAMMA * torch.sign(load.mean() - load)
        assert want.abs().min() > 0  # every expert's bias moved
        torch.testing.assert_close(layer.router.score_bias, want.float(), rtol=0, atol=1e-6)


def test_a_checkpoint_without_the_bias_keeps_the_models_bias(reference, tmp_path):
    """A run that turns the balancing on resumes from a checkpoint saved without it."""
    run = tmp_path / "run"
    model, meta = load_model_for_inference(latest_checkpoint(str(reference)))
    optimizer = torch.optim.AdamW(model.parameters())
    init_optimizer_state(optimizer)
    meta = {k: v for k, v in meta.items() if k not in ("format", "step", "consumed")}
    path = save_checkpoint(
        str(run),
        model=model,
        optimizer=optimizer,
        step=1,
        consumed=1,
        meta=meta,
        layout=build_layout(1, 60.0),
        keep=1,
    )
    moe = dataclasses.replace(model.config.moe, score_bias_update_rate=GAMMA)
    biased = MoEGPT(dataclasses.replace(model.config, moe=moe))
    for _, layer in biased.moe_layers():
        layer.router.score_bias.fill_(1.0)
    load_checkpoint(path, model=biased, optimizer=None, rank=0)
    for _, layer in biased.moe_layers():
        assert torch.equal(layer.router.score_bias, torch.ones(4))  # kept: the checkpoint lacks it
    torch.testing.assert_close(
        dict(biased.named_parameters()), dict(model.named_parameters()), rtol=0, atol=0
    )
