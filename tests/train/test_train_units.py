"""Fast single-process pieces: config, TOML, data sharding, LR schedule, model, gradient rules."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from moesaic.comm.world import run_world
from moesaic.models import MoEGPT, MoEGPTConfig
from moesaic.train.config import TrainConfig, add_train_arguments, config_from_args
from moesaic.train.data import PackedData, load_corpus
from moesaic.train.loop import lr_at

SMALL = dict(d_model=32, n_layers=2, n_heads=2, num_experts=4, expert_hidden=32, seq_len=16)


def test_toml_then_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("steps = 7\nlr = 0.01\n[model]\nd_model = 64\nn_heads = 2\n")
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--config", str(toml), "--steps", "9"]))
    assert (cfg.steps, cfg.lr, cfg.model.d_model, cfg.model.n_heads) == (9, 0.01, 64, 2)
    toml.write_text("stpes = 3\n")
    with pytest.raises(ValueError, match="unknown training option"):
        config_from_args(parser.parse_args(["--config", str(toml)]))


def test_example_config_loads():
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--config", "examples/train_tiny.toml"]))
    assert cfg.model.num_experts % cfg.check_world(cfg.nproc) == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(dense_layers=3), r"dense_layers \(3\) must be <= n_layers \(2\)"),
        (dict(top_k=5), r"top_k \(5\) must be <= num_experts \(4\)"),
        (dict(seq_len=0), r"seq_len \(0\) must be >= 1"),
    ],
)
def test_model_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoEGPTConfig(**{**SMALL, **kwargs})


def test_data_sharding_is_a_partition():
    # 145 distinct bytes = 18 windows of 8 (+1): two ranks x 3 sequences x 3 steps is one epoch.
    data = PackedData(bytes(range(145)), seq_len=8, name="train")
    seen = []
    for step in range(3):
        consumed = step * 2 * 3
        for rank in range(2):
            x_BT, y_BT = data.train_batch(consumed, rank, 3, seed=0)
            assert torch.equal(x_BT[:, 1:], y_BT[:, :-1])
            seen += [tuple(row.tolist()) for row in x_BT]
    assert sorted(w[0] for w in seen) == list(range(0, 144, 8))  # each window once per epoch


def test_stdlib_corpus_is_deterministic_and_capped():
    a, b = load_corpus(None, 50_000), load_corpus(None, 50_000)
    assert a == b and len(a) == 50_000


def test_lr_schedule():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(cfg, 5) == pytest.approx(0.5) and lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 100) == pytest.approx(0.1)


def test_model_is_causal_and_dense_layers():
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig(**SMALL, dense_layers=1))
    assert hasattr(model.blocks[0], "mlp") and hasattr(model.blocks[1], "moe")
    idx_BT = torch.randint(0, 256, (2, 16))
    logits_BTV = model(idx_BT)
    assert logits_BTV.shape == (2, 16, 256)
    changed = idx_BT.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    # Positions before 10 cannot see the change. MoE routing is per token, so this is exact.
    torch.testing.assert_close(model(changed)[:, :10], logits_BTV[:, :10], rtol=0, atol=0)


def _grads_world(rank, world_size, ep):
    """Gradients after the EP x DP rules vs one process on all ranks' tokens (no aux loss)."""
    from moesaic.train.parallel import build_layout, sync_gradients

    cfg = MoEGPTConfig(**SMALL, aux_loss_coef=0.0, z_loss_coef=0.0)
    x_WBT = torch.randint(0, 256, (world_size, 2, 17), generator=torch.Generator().manual_seed(1))
    layout = build_layout(ep, 60.0)
    torch.manual_seed(0)
    model = MoEGPT(cfg, ep_group=layout.ep_group)
    x_BT = x_WBT[rank]
    F.cross_entropy(model(x_BT[:, :-1]).flatten(0, 1), x_BT[:, 1:].flatten()).backward()
    sync_gradients(model, layout)
    return {n: p.grad for n, p in model.named_parameters()}, layout.ep.rank


def test_gradient_rules_match_one_process():
    cfg = MoEGPTConfig(**SMALL, aux_loss_coef=0.0, z_loss_coef=0.0)
    x_WBT = torch.randint(0, 256, (2, 2, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref = MoEGPT(cfg)
    x_BT = x_WBT.flatten(0, 1)
    F.cross_entropy(ref(x_BT[:, :-1]).flatten(0, 1), x_BT[:, 1:].flatten()).backward()
    for ep in (1, 2):  # DP 2 x EP 1, and DP 1 x EP 2
        for grads, ep_rank in run_world(_grads_world, 2, ep, timeout_s=120):
            for name, p in ref.named_parameters():
                want = p.grad
                if ".experts." in name:
                    e = 4 // ep
                    want = want[ep_rank * e : (ep_rank + 1) * e]
                torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=name)
