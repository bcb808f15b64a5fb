"""Training health and rank agreement (issue 9, items 2, 7, 8): a non-finite step is never
applied and stops (or skips) on every rank alike, metrics stay strict JSON, checkpoints stay
finite; ranks refuse a configuration that differs; --timeout-s reaches the MoE layers."""

from __future__ import annotations

import functools
import json
import time

import pytest
import torch
import torch.nn.functional as F
from _train_helpers import tiny_args

from moesaic.cli import main
from moesaic.comm.world import run_world
from moesaic.models import MoEGPT, MoEGPTConfig
from moesaic.schedule import make_step
from moesaic.schedule.base import StepParts
from moesaic.train.config import TrainConfig

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}
TINY_MOE = {"num_experts": 4, "ffn_hidden_size": 32}


def _strict_records(run_dir) -> list[dict]:
    """metrics.jsonl read by a strict JSON parser (bare NaN / Infinity are refused)."""

    def refuse(token):
        raise AssertionError(f"metrics.jsonl holds {token}, which strict JSON refuses")

    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def _checkpoint_weights_finite(run_dir) -> dict[str, bool]:
    from moesaic.train.checkpoint import load_model_for_inference

    out = {}
    for path in sorted((run_dir / "checkpoints").glob("step_*")):
        model, _ = load_model_for_inference(path)
        out[path.name] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return out


def test_divergence_stops_the_run_and_keeps_the_good_checkpoint(data_file, tmp_path, capsys):
    """``--lr 1e6 --grad-clip 0`` used to exit 0 with NaN weights in its checkpoints (and prune
    the good ones) and bare NaN in metrics.jsonl."""
    run_dir = tmp_path / "diverge"
    extra = ["--lr", "1e6", "--grad-clip", "0", "--steps", "4", "--ckpt-every", "1"]
    extra += ["--keep-checkpoints", "1"]
    # GPT-2's norm and positions: with them step 2's loss itself is not finite (this test reads
    # that message); with RMSNorm and rotary positions only its gradients are.
    extra += ["--norm", "layernorm", "--positions", "learned"]
    assert main(tiny_args(data_file, run_dir, *extra)) != 0
    err = capsys.readouterr().err
    assert "training diverged at step 2: loss on rank(s) [0, 1]" in err, err
    assert "gradients (global norm nan)" in err and "--on-nonfinite skip" in err
    records = _strict_records(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert train[1]["loss"] is None and train[1]["nonfinite"][0] == "loss on rank(s) [0, 1]"
    # Step 1's checkpoint (finite) survives; nothing of step 2 was written.
    assert _checkpoint_weights_finite(run_dir) == {"step_00000001": True}


def test_skip_stops_after_the_limit(data_file, tmp_path, capsys):
    run_dir = tmp_path / "skip"
    extra = ["--lr", "1e6", "--grad-clip", "0", "--steps", "4", "--on-nonfinite", "skip"]
    extra += ["--nonfinite-skip-limit", "3"]
    assert main(tiny_args(data_file, run_dir, *extra)) != 0
    err = capsys.readouterr().err
    assert "training diverged at step 4" in err and "3 steps in a row were skipped" in err, err
    train = [r for r in _strict_records(run_dir) if r["kind"] == "train"]
    assert [bool(r.get("nonfinite")) for r in train] == [False, True, True, True]
    assert not (run_dir / "checkpoints").exists() or _checkpoint_weights_finite(run_dir) == {}


def _nan_on_one_rank_world(rank, world_size):
    """Rank 1's loss is NaN at the first step only: every rank skips it, then trains."""
    from moesaic.train.parallel import GradientSync, build_layout

    layout = build_layout(world_size, 60.0)
    torch.manual_seed(0)
    cfg = MoEGPTConfig.from_dict({**TINY, "moe": TINY_MOE})
    model = MoEGPT(cfg, ep_group=layout.ep_group)
    calls = []

    def loss_fn(logits_BTV, y_BT):
        ce = F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())
        calls.append(1)
        return ce * float("nan") if rank == 1 and len(calls) == 1 else ce

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    parts = StepParts(
        model=model, loss_fn=loss_fn, grad_sync=GradientSync(layout), optimizer=optimizer
    )
    step = make_step("vanilla", parts)
    x_BT = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(rank))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    first = step.run(x_BT[:, :-1], x_BT[:, 1:])
    unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    no_state = not optimizer.state and all(p.grad is None for p in model.parameters())
    second = step.run(x_BT[:, :-1], x_BT[:, 1:])
    changed = not any(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return first.nonfinite, first.applied, unchanged, no_state, second.applied, changed


def test_nonfinite_on_one_rank_is_skipped_on_all():
    for nonfinite, applied, unchanged, no_state, applied2, changed in _world_results("nan"):
        # Rank 0's own loss was fine; the agreed flags still name rank 1 on both ranks.
        assert nonfinite[0] == "loss on rank(s) [1]" and nonfinite[-1].startswith("gradients")
        assert not applied and unchanged and no_state
        assert applied2 and changed


def _disagreeing_world(rank, world_size):
    """Each case gives rank 1 one differing value; every rank must refuse, naming the field."""
    from moesaic.comm.agree import RankMismatchError
    from moesaic.train.loop import check_config_agrees
    from moesaic.train.parallel import build_layout

    layout = build_layout(world_size, 60.0)
    cases = {
        "lr": {"lr": 2e-3},
        "model.moe.num_experts": {"model": {**TINY, "moe": {**TINY_MOE, "num_experts": 8}}},
        "model.moe.ffn_hidden_size": {
            "model": {**TINY, "moe": {**TINY_MOE, "ffn_hidden_size": 64}}
        },
        "data_windows": {},
    }
    messages = {}
    for field, change in cases.items():
        d = {"model": {**TINY, "moe": TINY_MOE}, "lr": 1e-3}
        if rank == 1:
            d.update(change)
        windows = (100 + rank, 5) if field == "data_windows" else (100, 5)
        try:
            check_config_agrees(TrainConfig.from_dict(d), layout, windows)
        except RankMismatchError as exc:
            messages[field] = str(exc)
    check_config_agrees(TrainConfig.from_dict({"model": {**TINY, "moe": TINY_MOE}}), layout, (1, 1))
    return messages


def _both_worlds(rank, world_size):
    nan = _nan_on_one_rank_world(rank, world_size)
    return {"nan": nan, "disagree": _disagreeing_world(rank, world_size)}


@functools.cache
def _results() -> list[dict]:
    """The non-finite and the disagreement checks, one after the other in one spawned world of
    2 (a spawn costs seconds): both leave the world usable."""
    return run_world(_both_worlds, 2)


def _world_results(name: str) -> list:
    return [r[name] for r in _results()]


def test_ranks_that_disagree_refuse_to_start():
    for messages in _world_results("disagree"):
        assert sorted(messages) == sorted(
            ["lr", "model.moe.num_experts", "model.moe.ffn_hidden_size", "data_windows"]
        )
        for field, message in messages.items():
            assert f"training config: field {field!r} differs between ranks" in message
            assert "ranks [0] vs ranks [1]" in message


def _stopped_peer_world(rank, world_size, timeout_s, done):
    """Rank 1 stops (sleeps) before the first MoE forward; rank 0's layer must give up after
    --timeout-s, naming it (it waited 300 s and named 300 before)."""
    import os

    from moesaic.comm.collectives import CollectiveError
    from moesaic.train.parallel import build_layout

    cfg = TrainConfig.from_dict({"model": {**TINY, "moe": TINY_MOE}, "timeout_s": timeout_s})
    layout = build_layout(world_size, cfg.timeout_s)
    model = MoEGPT(cfg.model, ep_group=layout.ep_group)
    timeouts = {layer.ep.timeout_s for _, layer in model.moe_layers()}
    if rank == 1:
        # stopped for timeout_s + 2 s, or until rank 0 is done
        deadline = time.monotonic() + timeout_s + 2.0
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.02)
        return timeouts, None, 0.0
    t0 = time.perf_counter()
    try:
        model(torch.zeros(1, 8, dtype=torch.long))
    except CollectiveError as exc:
        result = timeouts, str(exc), time.perf_counter() - t0
    else:
        result = timeouts, None, time.perf_counter() - t0
    open(done, "w").close()
    return result


def test_timeout_reaches_the_moe_layers_of_a_world(tmp_path):
    done = str(tmp_path / "done")
    (timeouts0, message, waited), (timeouts1, _, _) = run_world(_stopped_peer_world, 2, 1.5, done)
    assert timeouts0 == timeouts1 == {1.5}
    assert message is not None and "collective_timeout_s=1.5" in message, message
    assert waited < 4.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(on_nonfinite="ignore"), r"on_nonfinite \('ignore'\) must be one of 'stop', 'skip'"),
        (dict(nonfinite_skip_limit=0), r"nonfinite_skip_limit \(0\) must be >= 1"),
        (dict(timeout_s=0), r"timeout_s \(0\) must be a finite number >= 0.001"),
    ],
)
def test_health_options_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)
