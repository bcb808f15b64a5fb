"""``moesaic export --hf OUT``: transformers' greedy generation from the exported directory equals
``moesaic generate``'s (issue 51), for Qwen3-MoE and DeepSeek-V3 trained on token shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from moesaic.cli import main
from moesaic.data.prepare import PrepareConfig, prepare
from moesaic.train.export import export_hf
from moesaic.train.generate import generate_text

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"
PROMPT = "def parse(self"
NEW = 10  # prompt + NEW tokens stay within seq_len (moesaic crops the context beyond it)


@pytest.fixture(scope="module")
def tokens(data_file, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export")
    src = root / "src"
    src.mkdir()
    text = data_file.read_text()
    for i in range(8):
        (src / f"part{i}.py").write_text(text[i * 6000 : (i + 1) * 6000])
    cfg = PrepareConfig(inputs=[str(src)], out=str(root / "data"), vocab_size=300, workers=1)
    cfg.progress = False
    prepare(cfg)
    return root / "data"


def _train(family: str, data: Path, run_dir: Path) -> None:
    """4 steps in this process (the loop without torchrun: one rank, no spawn)."""
    from moesaic.train.config import TrainConfig
    from moesaic.train.loop import train

    cfg = {"hf_config": str(EXAMPLES / f"{family}.json"), "data": str(data), "nproc": 1}
    cfg |= {"run_dir": str(run_dir), "batch_size": 4, "steps": 4, "warmup_steps": 1}
    cfg |= {"eval_every": 0, "eval_batches": 1, "threads": 1, "progress": False}
    train(TrainConfig.from_dict({**cfg, "model": {"seq_len": 32}}))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_transformers_generates_what_moesaic_generates(family, tokens, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = tmp_path / "run"
    _train(family, tokens, run_dir)
    out = export_hf(str(run_dir), str(tmp_path / "hf"))
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 300 and config["model_type"] == family

    ours = generate_text(str(run_dir), PROMPT, max_new_tokens=NEW, temperature=0)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager")
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert tok.decode(theirs[0]) == ours
    assert theirs.shape[1] > ids.shape[1]  # it generated something


def test_refusals(tokens, tmp_path, capsys, data_file):
    run_dir = tmp_path / "gpt"
    args = ["train", "--data", str(data_file), "--run-dir", str(run_dir), "--nproc", "1"]
    args += ["--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--experts", "2"]
    args += ["--expert-hidden", "16", "--seq-len", "16", "--batch-size", "2", "--steps", "1"]
    args += ["--threads", "1", "--no-progress", "--eval-batches", "1"]
    assert main(args) == 0
    assert main(["export", "--checkpoint", str(run_dir), "--hf", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "is an MoEGPT" in err and "\n" not in err
    assert not (tmp_path / "o").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["export", "--checkpoint", str(run_dir), "--hf", str(tmp_path / "full")]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
