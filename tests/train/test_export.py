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
from moesaic.train.generate import generate_ids

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


def _train(options: dict, run_dir: Path, model: dict | None = None) -> None:
    """A few steps in this process (the loop without torchrun: one rank, no spawn)."""
    from moesaic.train.config import TrainConfig
    from moesaic.train.loop import train

    cfg = {"nproc": 1, "run_dir": str(run_dir), "batch_size": 4, "steps": 4, "warmup_steps": 1}
    cfg |= {"eval_every": 0, "eval_batches": 1, "threads": 1, "progress": False}
    train(TrainConfig.from_dict({**cfg, **options, "model": model or {"seq_len": 32}}))


def _greedy_parity(run_dir: Path, out: Path) -> None:
    """transformers' greedy tokens from ``out`` are moesaic generate's from ``run_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours, codec = generate_ids(str(run_dir), PROMPT, max_new_tokens=NEW, temperature=0)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager")
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids[0].tolist() == codec.encode(PROMPT)  # the same tokenizer
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert theirs[0].tolist() == ours
    assert len(ours) > ids.shape[1]  # it generated something
    assert tok.decode(theirs[0]) == codec.decode(ours)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_transformers_generates_what_moesaic_generates(family, tokens, tmp_path):
    run_dir = tmp_path / "run"
    _train({"hf_config": str(EXAMPLES / f"{family}.json"), "data": str(tokens)}, run_dir)
    out = export_hf(str(run_dir), str(tmp_path / "hf"))
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 300 and config["model_type"] == family
    _greedy_parity(run_dir, out)


def test_moegpt_exports_as_mixtral_on_bytes(data_file, tmp_path):
    run_dir = tmp_path / "gpt"
    model = {"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 32}
    model["moe"] = {"num_experts": 4, "ffn_hidden_size": 32}
    _train({"data": str(data_file)}, run_dir, model)
    out = export_hf(str(run_dir), str(tmp_path / "hf"))
    assert json.loads((out / "config.json").read_text())["model_type"] == "mixtral"
    _greedy_parity(run_dir, out)


def test_refusals(data_file, tmp_path, capsys):
    run_dir = tmp_path / "gpt"
    model = {"n_layers": 2, "d_model": 16, "n_heads": 2, "seq_len": 16, "dense_layers": 1}
    model["moe"] = {"num_experts": 2, "ffn_hidden_size": 16}
    _train({"data": str(data_file), "steps": 1}, run_dir, model)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run_dir), "--hf", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no Mixtral equivalent: dense_layers 1" in err and "\n" not in err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["export", "--checkpoint", str(run_dir), "--hf", str(tmp_path / "full")]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
