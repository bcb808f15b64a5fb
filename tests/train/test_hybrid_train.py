"""``moesaic train --strategy hybrid --domains auto|S0,S1,... --cluster FILE.toml``: parsing,
validation, ``auto`` resolved to rank 0's plan on every rank, and one cheap end-to-end run whose
checkpoint loads under another strategy and in ``generate``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from _train_helpers import fails, tiny_args

from moesaic.cli import main
from moesaic.train.config import TrainConfig
from moesaic.train.flags import add_train_arguments, config_from_args

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "examples" / "clusters" / "2dc_2node_small.toml"  # 2 x 2 ranks


def _cfg(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def _two_ranks(tmp_path: Path, gbps: float = 0.1) -> Path:
    """A cluster of one level of 2 ranks (the EP group of the tiny 2-rank runs)."""
    path = tmp_path / "two.toml"
    path.write_text(
        f'name = "two"\n[[levels]]\nname = "dc"\nsize = 2\nbandwidth_gbps = {gbps}\n'
        "latency_ms = 1.0\n"
    )
    return path


def test_strategy_is_the_dispatcher_option(tmp_path):
    assert _cfg("--strategy", "hybrid").model.moe.dispatcher == "hybrid"
    assert _cfg("--dispatcher", "padded").model.moe.dispatcher == "padded"
    toml = tmp_path / "run.toml"
    toml.write_text('[model.moe]\ndispatcher = "padded"\n')
    assert _cfg("--config", str(toml), "--strategy", "hybrid").model.moe.dispatcher == "hybrid"


def test_domains_sizes_auto_and_compression(tmp_path):
    cfg = _cfg("--strategy", "hybrid", "--domains", "1,2", "--expert-compression-ratio", "4")
    assert cfg.model.moe.options.domain_sizes == (1, 2) and not cfg.auto_domains
    assert cfg.model.moe.options.compression_ratio == 4.0
    cfg = _cfg("--strategy", "hybrid", "--domains", "auto", "--cluster", str(SMALL))
    assert cfg.auto_domains and cfg.model.moe.options.domain_sizes is None
    assert cfg.cluster == str(SMALL)
    # the same in TOML, and a flag over it
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'cluster = "{SMALL}"\n[model.moe]\ndispatcher = "hybrid"\ndomain_sizes = "auto"\n'
    )
    assert _cfg("--config", str(toml)).auto_domains
    over = _cfg("--config", str(toml), "--strategy", "hybrid", "--domains", "2,1")
    assert over.model.moe.options.domain_sizes == (2, 1) and not over.auto_domains
    toml.write_text(
        '[model.moe]\ndispatcher = "hybrid"\n[model.moe.options]\ndomain_sizes = [2, 2]\n'
    )
    assert _cfg("--config", str(toml)).model.moe.options.domain_sizes == (2, 2)
    # the workers get cfg.to_dict(): "auto" and the cluster survive it
    cfg = _cfg("--domains", "auto", "--cluster", str(SMALL), "--strategy", "hybrid")
    back = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back.auto_domains and back.cluster == cfg.cluster and back.model == cfg.model


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--strategy", "hybrid", "--domains", "auto"], ["'auto'", "cluster"]),
        (
            ["--strategy", "hybrid", "--domains", "1,x"],
            ["model.moe.options.domain_sizes ('1,x')", "'auto' or positive ints"],
        ),
        (["--strategy", "hybrid", "--domains", "0"], ["model.moe.options.domain_sizes[0] (0)"]),
        # the cluster must describe the EP group (2 ranks here, 4 in the file)
        (["--strategy", "hybrid", "--cluster", str(SMALL)], ["describes 4 ranks", "ep = 2"]),
        # without a cluster, one level of the EP size (2)
        (
            ["--strategy", "hybrid", "--domains", "3"],
            ["model.moe.options.domain_sizes[0] (3)", "divide"],
        ),
        (
            ["--strategy", "hybrid", "--domains", "1,1"],
            ["model.moe.options.domain_sizes", "one entry"],
        ),
        (
            ["--strategy", "hybrid", "--expert-compression-ratio", "0.5"],
            ["compression_ratio (0.5)"],
        ),
        (
            ["--strategy", "taskflow", "--schedule", "moe-only"],
            ["strategy 'taskflow'", "schedule 'moe-only'", "runs under vanilla", "tile tasks"],
        ),
    ],
    ids=[
        "auto-without-cluster",
        "not-ints",
        "zero",
        "cluster-size",
        "divide",
        "levels",
        "cr",
        "taskflow-pipelined-schedule",
    ],
)
def test_train_errors_are_one_line(flags, words, data_file, tmp_path, capsys):
    err = fails(tiny_args(data_file, tmp_path / "run", *flags), capsys)
    for word in words:
        assert word in err, err


def test_domain_sizes_against_the_cluster_levels(tmp_path):
    """With --cluster, one size per cluster level, each dividing it."""
    cfg = _cfg("--strategy", "hybrid", "--domains", "2,1", "--cluster", str(SMALL))
    assert cfg.check_world(4) == 4
    cfg = _cfg("--strategy", "hybrid", "--domains", "1,2", "--cluster", str(SMALL), "--ep", "4")
    assert cfg.check_world(8) == 4  # DP 2 x EP 4: the cluster is one EP group
    with pytest.raises(ValueError, match=r"domain_sizes \(\[2\]\) must have one entry per level"):
        _cfg("--strategy", "hybrid", "--domains", "2", "--cluster", str(SMALL)).check_world(4)
    with pytest.raises(FileNotFoundError, match=r"cluster: cluster file .* does not exist"):
        _cfg("--strategy", "hybrid", "--cluster", str(tmp_path / "nope.toml")).check_world(4)


class _Gather:
    """The world group of a 2-rank layout, as seen by one rank: rank 0 measured ``rate0``."""

    def __init__(self, rate0: float) -> None:
        self.rate0 = rate0

    def all_gather_dim0(self, t_11: torch.Tensor, what: str) -> torch.Tensor:
        return torch.tensor([[self.rate0], [float(t_11[0, 0])]], dtype=torch.float64)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("rate0, sizes", [(1e6, (2,)), (1e12, (1,))])
def test_auto_domains_are_rank_0s_plan_on_every_rank(rank, rate0, sizes, tmp_path, monkeypatch):
    """The training-step model (plan_step): at 1 MFLOP/s the pre-expert compute hides the
    prefetched gather and only the gradient reduce is left, cheaper than the tokens' four
    all-to-alls ([2]); at 1 TFLOP/s gather plus reduce of these experts (F = 48) cost more ([1]).
    Only rank 0 measures; every rank plans with rank 0's rate (gathered), so a rank that would
    have measured 1000x more gets the same sizes."""
    import moesaic.sim.hybrid_costmodel as costmodel
    from moesaic.train.domains import load_cluster
    from moesaic.train.loop import resolve_auto_domains

    def measure(*args, **kwargs) -> float:
        if rank != 0:
            raise AssertionError("only rank 0 measures")
        return rate0

    monkeypatch.setattr(costmodel, "measure_gemm_flops", measure)
    cluster = str(_two_ranks(tmp_path))
    cfg = _cfg(
        *("--strategy", "hybrid", "--domains", "auto", "--cluster", cluster),
        *("--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--seq-len", "32"),
        *("--experts", "4", "--expert-hidden", "48", "--top-k", "1", "--batch-size", "4"),
    )
    layout = argparse.Namespace(rank=rank, world=_Gather(rate0))
    out = resolve_auto_domains(cfg, load_cluster(cluster), layout, torch.device("cpu"))
    assert out.model.moe.options.domain_sizes == sizes and not out.auto_domains
    # other strategies ignore domain_sizes = "auto" from a shared TOML (the flag is refused,
    # the key only noted): nothing measured, nothing set
    shared = tmp_path / "shared.toml"
    shared.write_text(f'cluster = "{cluster}"\n[model.moe]\ndomain_sizes = "auto"\n')
    dropless = _cfg("--config", str(shared))
    assert resolve_auto_domains(dropless, None, layout, torch.device("cpu")) is dropless


def test_hybrid_auto_run_and_its_checkpoint_loads_elsewhere(data_file, tmp_path, capfd):
    """A 4-step hybrid run with --domains auto: the plan is logged and saved in the checkpoint,
    which loads into a model of another strategy and into ``generate`` (one process)."""
    pytest.importorskip("moesaic.strategies.hybrid")
    from moesaic.models.gpt import MoEGPT, MoEGPTConfig
    from moesaic.train.checkpoint import load_checkpoint
    from moesaic.train.ckpt_choice import latest_checkpoint, read_checkpoint_meta
    from moesaic.train.generate import generate_text

    run_dir = tmp_path / "hybrid"
    flags = ["--strategy", "hybrid", "--domains", "auto", "--cluster", str(_two_ranks(tmp_path))]
    assert main(tiny_args(data_file, run_dir, *flags, "--steps", "4")) == 0
    err = capfd.readouterr().err
    assert "moesaic train: --domains auto on two at" in err and "vs classic EP" in err, err
    path = latest_checkpoint(str(run_dir))
    moe = json.loads((path / "meta.json").read_text())["model"]["moe"]
    # Tiny experts (32 x 32) on a 100 Mbit/s link: gathering them beats moving the tokens at
    # any rate from 1 MFLOP/s to 1 PFLOP/s, so [2] whatever rank 0 measured; one process
    # (generate, below) cannot build a domain of 2 (checkpoint.load_model_for_inference).
    assert moe["dispatcher"] == "hybrid" and moe["options"]["domain_sizes"] == [2]
    # tensor shapes do not depend on the strategy: a padded single-process model loads it
    saved = MoEGPTConfig.from_dict(read_checkpoint_meta(path)["model"])
    other = MoEGPTConfig.from_dict(
        {**saved.to_dict(), "moe": {**moe, "dispatcher": "padded", "options": None}}
    )
    read_checkpoint_meta(path, other)
    assert load_checkpoint(path, model=MoEGPT(other), optimizer=None, rank=0)[0] == 4
    assert generate_text(str(run_dir), "def ", max_new_tokens=4).startswith("def ")
