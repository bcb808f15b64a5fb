"""``moesaic train --hf-config``: a transformers MoE architecture trained with moesaic's EP, data,
checkpoints and metrics, and the trained model read back by plain transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _train_helpers import fails, read_metrics

pytest.importorskip("transformers")

from moesaic.cli import main
from moesaic.testing import assert_close_to_ref

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"
# DeepSeek-V3: the most parts (MLA attention, a dense first block, shared experts, sigmoid
# group-limited routing with the score bias the loop updates after every step).
FAMILY = "deepseek_v3"


def hf_args(data: Path, run_dir: Path, config: Path, *extra: str) -> list[str]:
    """8 steps on 2 ranks (EP 2) of a tiny transformers config; seq 32, 4 sequences per rank."""
    args = ["train", "--hf-config", str(config), "--data", str(data), "--run-dir", str(run_dir)]
    args += ["--seq-len", "32", "--batch-size", "4", "--steps", "8", "--eval-every", "4"]
    args += ["--eval-batches", "2", "--ckpt-every", "4", "--warmup-steps", "2", "--threads", "1"]
    args += ["--no-progress", "--timeout-s", "60"]
    return [*args, *extra]


@pytest.fixture(scope="module")
def hf_run(data_file, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("hf_run")
    assert main(hf_args(data_file, run_dir, EXAMPLES / f"{FAMILY}.json")) == 0
    return run_dir


def test_loss_falls_and_checkpoints_are_written(hf_run):
    records = read_metrics(hf_run)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert train[-1]["loss"] < train[0]["loss"] - 0.2
    assert [r["step"] for r in val] == [4, 8] and val[-1]["val_loss"] < val[0]["val_loss"]
    # 2 MoE blocks (the first of 3 is dense) x 8 experts; top-2 of 2 x 4 x 32 tokens each.
    assert all(len(r["expert_load"]) == 2 for r in train)
    assert all(sum(load) == 2 * 4 * 32 * 2 for r in train for load in r["expert_load"])
    ckpts = sorted(p.name for p in (hf_run / "checkpoints").glob("step_*"))
    assert ckpts == ["step_00000004", "step_00000008"]
    meta = json.loads((hf_run / "checkpoints" / "step_00000008" / "meta.json").read_text())
    assert meta["hf_config"]["model_type"] == FAMILY and meta["ep_size"] == 2


def test_trained_model_loads_in_plain_transformers(hf_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from moesaic.train.checkpoint import load_model_for_inference
    from moesaic.train.ckpt_choice import latest_checkpoint

    model, _ = load_model_for_inference(latest_checkpoint(str(hf_run)))
    model.save_pretrained(tmp_path / "plain")
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(x)
        plain = {
            dtype: AutoModelForCausalLM.from_pretrained(
                tmp_path / "plain", dtype=dtype, experts_implementation="eager"
            )(input_ids=x).logits
            for dtype in (torch.float32, torch.float64)
        }
    assert_close_to_ref(ours, plain[torch.float32], plain[torch.float64], "logits")


def test_pipelined_schedule_trains_the_same(hf_run, data_file, tmp_path):
    """flowmoe (R = 2 chunks, the decoder layers cut into stages) against vanilla: the same
    mathematics in another order (docs/training.md, "Schedules")."""
    run_dir = tmp_path / "flowmoe"
    config = EXAMPLES / f"{FAMILY}.json"
    assert main(hf_args(data_file, run_dir, config, "--schedule", "flowmoe")) == 0
    ours = [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]
    vanilla = [r["loss"] for r in read_metrics(hf_run) if r["kind"] == "train"]
    # Measured 2e-7 apart at most (fp32 sums in another order over 8 AdamW steps).
    assert ours == pytest.approx(vanilla, rel=1e-5)


@pytest.mark.parametrize("family", sorted(p.stem for p in EXAMPLES.glob("*.json")))
def test_stages_compose_to_the_forward(family):
    """embed, each block's attention stage + experts (or the dense layer), head: the logits of
    the transformers forward (Granite-MoE's multipliers are outside the stages: refused)."""
    import moesaic
    from moesaic.interop.hf_families import apply_hf_shape, read_hf_config
    from moesaic.models.config import MoEGPTConfig
    from moesaic.models.hf_causal_lm import HFCausalLM

    path = EXAMPLES / f"{family}.json"
    cfg = MoEGPTConfig.from_dict(apply_hf_shape({"seq_len": 16}, path))
    torch.manual_seed(0)
    model = HFCausalLM(read_hf_config(path), cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        h = model.embed(x)
        for block in model.blocks:
            if block.moe is None:
                h = block(h)
            else:
                h, normed = block.attention_stage(h)
                h = h + block.moe.run_experts(block.moe.route(normed))
        staged, whole = model.head(h), model(x)
    moesaic.aux_loss(model)
    if family == "granitemoe":
        assert (staged - whole).abs().max() > 0.1
    else:  # shared experts join the attention stage: another summation order
        torch.testing.assert_close(staged, whole, rtol=1e-5, atol=1e-5)


def test_refusals_name_what_is_wrong(data_file, tmp_path, capsys):
    granite = EXAMPLES / "granitemoe.json"
    err = fails(hf_args(data_file, tmp_path / "a", granite, "--schedule", "flowmoe"), capsys)
    assert "granitemoe (--hf-config" in err and "residual_multiplier" in err
    assert "--schedule vanilla" in err
    config = EXAMPLES / "mixtral.json"
    err = fails(hf_args(data_file, tmp_path / "b", config, "--n-heads", "2"), capsys)
    assert "model.n_heads (2) differs from the transformers config" in err
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**json.loads(config.read_text()), "vocab_size": 64}))
    err = fails(hf_args(data_file, tmp_path / "c", small), capsys)
    assert "vocab_size 64" in err and "bytes" in err
    oss = tmp_path / "oss.json"
    oss.write_text(json.dumps({"model_type": "gpt_oss", "hidden_size": 32}))
    err = fails(hf_args(data_file, tmp_path / "d", oss), capsys)
    assert "'gpt_oss' is not supported" in err and "biases" in err


def test_bf16_follows_the_fp32_run(data_file, tmp_path):
    """``--dtype bf16`` on a transformers model: its forward under autocast (the weights and the
    optimizer's update stay fp32), the loss within bf16 rounding of the fp32 run's."""
    losses = {}
    for dtype in ("fp32", "bf16"):
        run = tmp_path / dtype
        args = hf_args(data_file, run, EXAMPLES / "qwen3_moe.json", "--dtype", dtype)
        assert main([*args, "--steps", "4", "--eval-every", "0", "--ckpt-every", "0"]) == 0
        losses[dtype] = [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]
    assert losses["bf16"] != losses["fp32"]  # it did run in bf16
    # bf16 rounding (8 mantissa bits) of ~5.5 nats over 4 steps; 0.05 as the MoEGPT run's test.
    assert losses["bf16"] == pytest.approx(losses["fp32"], abs=0.05)
