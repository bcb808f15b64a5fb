"""One model file for ``moesaic plan --model`` and ``moesaic simulate --model``: both take the
simulator's model format (``ModelSpec``) and a training config (``moesaic train --config``),
told apart by their keys; the same model in both formats gives the same plan and the same
simulated step; a file that is neither names the file and the keys each format has."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moesaic.cli import main
from moesaic.sim.model import ModelSpec
from moesaic.train.config import TrainConfig
from moesaic.train.model_files import load_model, load_model_spec, train_config_of

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "train_tiny.toml"  # H 64, F 128, E 4, K 2, 2 blocks, batch 8 x 64
FLOWMOE_2RANK = ROOT / "examples" / "clusters" / "flowmoe_2rank.toml"
SMALL = ROOT / "examples" / "clusters" / "2dc_2node_small.toml"  # 2 x 2 ranks
HYBRID_2DC = ROOT / "examples" / "clusters" / "hybridep_2dc.toml"
HYBRID_SMALL = ROOT / "examples" / "models" / "hybridep_small.toml"

# examples/train_tiny.toml in the model format.
TINY_AS_MODEL = """\
[model]
name = "train_tiny"
layers = 2
batch = 8
seq_len = 64
hidden = 64
ffn_hidden = 128
experts = 4
top_k = 2
heads = 2
"""

# examples/models/hybridep_small.toml as a training config.
HYBRID_SMALL_AS_TRAIN = """\
batch_size = 4
[model]
seq_len = 256
d_model = 256
n_layers = 2
n_heads = 4
[model.moe]
num_experts = 8
top_k = 2
ffn_hidden_size = 128
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _run(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _sim_rows(capsys, model: Path, strategy: str = "all") -> list[dict]:
    argv = ["--cluster", str(FLOWMOE_2RANK), "--model", str(model), "--strategy", strategy]
    out = _run(capsys, "simulate", *argv, "--json")
    rows = json.loads(out)
    rows = rows if isinstance(rows, list) else [rows]
    for row in rows:
        row.pop("wall_s")  # the simulator's own run time
    return rows


def _plan(capsys, cluster: Path, model: Path, *flags: str) -> dict:
    argv = ["--cluster", str(cluster), "--model", str(model), "--flops-per-s", "2e10"]
    out = _run(capsys, "plan", "--domains-only", *argv, "--json", *flags)
    plan = json.loads(out)
    plan["model"].pop("file")
    return plan


def test_a_training_config_converts_to_the_model_it_trains(tmp_path):
    spec = load_model_spec(TINY)
    assert spec == ModelSpec.from_toml(_write(tmp_path, "train_tiny.toml", TINY_AS_MODEL))
    assert isinstance(load_model(TINY), TrainConfig)
    assert isinstance(load_model(HYBRID_SMALL), ModelSpec)
    cfg = train_config_of(ModelSpec.from_toml(HYBRID_SMALL))
    assert (cfg.batch_size, cfg.model.d_model, cfg.model.moe.num_experts) == (4, 256, 8)


def test_simulate_takes_a_training_config_and_gives_the_same_step(tmp_path, capsys):
    as_model = _write(tmp_path, "train_tiny.toml", TINY_AS_MODEL)
    from_train = _sim_rows(capsys, TINY)
    assert len(from_train) >= 2
    assert from_train == _sim_rows(capsys, as_model)


def test_plan_takes_a_model_file_and_gives_the_same_plan(tmp_path, capsys):
    as_train = _write(tmp_path, "hybridep_small.toml", HYBRID_SMALL_AS_TRAIN)
    from_model = _plan(capsys, HYBRID_2DC, HYBRID_SMALL)
    assert from_model == _plan(capsys, HYBRID_2DC, as_train)
    assert from_model["model"]["tokens_per_rank"] == 4 * 256  # batch x seq_len, one chunk
    # and the other way round: the tiny training config and its model file
    as_model = _write(tmp_path, "tiny_model.toml", TINY_AS_MODEL)
    assert _plan(capsys, SMALL, TINY) == _plan(capsys, SMALL, as_model)


def test_plan_of_a_bf16_model_file_defaults_to_its_act_bytes(tmp_path, capsys):
    bf16 = _write(tmp_path, "bf16.toml", TINY_AS_MODEL + "act_bytes = 2\nparam_bytes = 2\n")
    assert _plan(capsys, SMALL, bf16)["model"]["dtype_bytes"] == 2
    assert _plan(capsys, SMALL, bf16, "--dtype-bytes", "4") == _plan(capsys, SMALL, TINY)


NEITHER = FLOWMOE_2RANK.read_text()  # a cluster file given as the model
MIXED = "steps = 3\n[model]\nlayers = 2\nd_model = 64\n"


@pytest.mark.parametrize("command", ["plan", "simulate"])
@pytest.mark.parametrize(
    "text, words",
    [
        (NEITHER, ["has the keys of neither", "levels, name, world_size"]),
        (MIXED, ["mixes", "model.layers"]),
    ],
    ids=["neither", "mixed"],
)
def test_a_file_of_neither_format_names_the_file_and_both_formats(
    command, text, words, tmp_path, capsys
):
    bad = _write(tmp_path, "bad.toml", text)
    cluster = FLOWMOE_2RANK if command == "simulate" else SMALL
    argv = [command, "--cluster", str(cluster), "--model", str(bad), "--flops-per-s", "1e10"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"moesaic {command}: error: ") and "\n" not in err, err
    assert str(bad) in err and "neither a model file nor a training config" in err, err
    # the keys each format expects
    for word in ["layers, batch, seq_len, hidden", "batch_size", "d_model", "num_experts", *words]:
        assert word in err, err


def test_what_one_format_cannot_say_is_refused_naming_the_file(tmp_path, capsys):
    layer_only = ROOT / "examples" / "models" / "taskflow_layer.toml"
    argv = ["plan", "--domains-only", "--cluster", str(SMALL), "--model", str(layer_only)]
    assert main([*argv, "--flops-per-s", "1e10"]) == 2
    err = capsys.readouterr().err
    assert str(layer_only) in err and "model.layer_only" in err, err
    text = TINY.read_text().replace("n_layers = 2", "n_layers = 2\ndense_layers = 1")
    dense = _write(tmp_path, "dense.toml", text)
    argv = ["simulate", "--cluster", str(FLOWMOE_2RANK), "--model", str(dense)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(dense) in err and "model.dense_layers (1)" in err, err


_PROBE = """
import json, sys
from moesaic.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def test_simulating_a_training_config_does_not_import_torch():
    argv = ["simulate", "--cluster", str(FLOWMOE_2RANK), "--model", str(TINY), "--json"]
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"code": 0, "torch": False}
