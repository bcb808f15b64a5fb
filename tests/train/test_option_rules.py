"""Issue 25 item 5: no ``moesaic train`` option is silently ignored. Every option of the CLI's
parser, against every strategy and schedule, is accepted or refused naming the option
(``moesaic.train.option_rules``); a TOML key that does not apply says so in one line. Only the
config is built: nothing trains."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from moesaic.cli import build_parser, main
from moesaic.schedule import schedule_names
from moesaic.strategies import strategy_names
from moesaic.strategies.hybrid_options import HybridOptions
from moesaic.train.config import TrainConfig
from moesaic.train.flags import config_from_args
from moesaic.train.option_rules import RULES, rule_of

ROOT = Path(__file__).resolve().parents[2]
HF_CONFIG = ROOT / "examples" / "hf" / "mixtral.json"  # read by TrainConfig: a real file
SMALL = ROOT / "examples" / "clusters" / "2dc_2node_small.toml"  # 2 x 2 ranks

# dest -> flags setting it to a value valid on its own (paths are only checked at launch).
# "{config}" is an empty TOML file. An option without a line here is given its default value
# (a switch: given), or, when its default is None, needs one (test_every_option_has_a_sample).
SAMPLES: dict[str, list[str]] = {
    "config": ["--config", "{config}"],
    "nproc": ["--nproc", "2"],
    "ep": ["--ep", "2"],
    "dp_shard": ["--dp-shard", "2"],
    "dp_replicate": ["--dp-replicate", "2"],
    "steps": ["--steps", "10"],
    "batch_size": ["--batch-size", "4"],
    "lr": ["--lr", "0.001"],
    "min_lr_ratio": ["--min-lr-ratio", "0.2"],
    "warmup_steps": ["--warmup-steps", "2"],
    "weight_decay": ["--weight-decay", "0.01"],
    "grad_clip": ["--grad-clip", "0.5"],
    "schedule": [],  # the axis of the walk: always given
    "pipeline_degree": ["--pipeline-degree", "1"],
    "ar_chunk": ["--ar-chunk", "4MiB"],
    "trace": ["--trace", "t.json"],
    "trace_png": ["--trace-png", "t.png"],
    "on_nonfinite": ["--on-nonfinite", "skip"],
    "nonfinite_skip_limit": ["--nonfinite-skip-limit", "3"],
    "seed": ["--seed", "1"],
    "data": ["--data", "corpus.txt"],
    "data_max_bytes": ["--data-max-bytes", "1000"],
    "val_fraction": ["--val-fraction", "0.1"],
    "eval_every": ["--eval-every", "5"],
    "eval_batches": ["--eval-batches", "2"],
    "ckpt_every": ["--ckpt-every", "5"],
    "save_final": ["--no-save-final"],
    "keep_checkpoints": ["--keep-checkpoints", "3"],
    "run_dir": ["--run-dir", "runs/x"],
    "resume": ["--resume"],
    "async_checkpoint": ["--async-checkpoint"],
    "max_restarts": ["--max-restarts", "1"],
    "backend": ["--backend", "gloo"],
    "timeout_s": ["--timeout-s", "30"],
    "threads": ["--threads", "1"],
    "progress": ["--no-progress"],
    "fault_kill_rank": ["--fault-kill-rank", "0", "--fault-kill-step", "1"],
    "fault_kill_step": ["--fault-kill-step", "1", "--fault-kill-rank", "0"],
    "cluster": ["--cluster", "cluster.toml"],
    "hf_config": ["--hf-config", str(HF_CONFIG)],
    "dtype": ["--dtype", "bf16"],
    "activation_checkpointing": ["--activation-checkpointing"],
    "emulate": ["--emulate", str(ROOT / "examples" / "clusters" / "flowmoe_2rank.toml")],
    "plan": [],  # chooses the walk's axes itself: tests/train/test_train_plan.py
    "force_plan": [],  # needs a --plan file: tests/train/test_plan_fits.py
    "model.seq_len": ["--seq-len", "32"],
    "model.d_model": ["--d-model", "32"],
    "model.n_layers": ["--n-layers", "3"],
    "model.n_heads": ["--n-heads", "2"],
    "model.dense_layers": ["--dense-layers", "1"],
    "model.dense_hidden": ["--dense-hidden", "64"],
    "model.norm": ["--norm", "layernorm"],
    "model.positions": ["--positions", "learned"],
    "model.moe_layer_freq": ["--moe-layer-freq", "2"],
    "model.moe.num_shared_experts": ["--shared-experts", "1"],
    "model.moe.shared_expert_hidden_size": ["--shared-expert-hidden", "32"],
    "model.moe.seq_aux_loss_coef": ["--seq-aux-loss-coef", "0.001"],
    "model.moe.balance_loss_scope": ["--balance-loss-scope", "global"],
    "model.moe.score_bias_update_rate": ["--score-bias-update-rate", "0.001"],
    "model.moe.num_expert_groups": ["--expert-groups", "2"],
    "model.moe.topk_groups": ["--topk-groups", "1"],
    "model.moe.routed_scaling_factor": ["--routed-scaling-factor", "2.5"],
    "model.moe.num_experts": ["--experts", "4"],
    "model.moe.top_k": ["--top-k", "1"],
    "model.moe.ffn_hidden_size": ["--expert-hidden", "32"],
    "model.moe.aux_loss_coef": ["--aux-loss-coef", "0.02"],
    "model.moe.z_loss_coef": ["--z-loss-coef", "0.002"],
    "model.moe.dispatcher": [],  # the axis of the walk: always given
    "model.moe.options.domain_sizes": ["--domains", "2"],
    "model.moe.options.compression_ratio": ["--expert-compression-ratio", "2"],
    "model.moe.capacity_factor": ["--capacity-factor", "1.5"],
    "model.moe.init_std": ["--init-std", "0.01"],
    "model.moe.shared_expert_gate": ["--shared-expert-gate", "--shared-experts", "1"],
}


def _train_parser() -> argparse.ArgumentParser:
    """The parser ``moesaic train`` itself uses."""
    parser = build_parser("train")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _options() -> dict[str, argparse.Action]:
    """dest -> the action of every ``moesaic train`` option but --help."""
    return {a.dest: a for a in _train_parser()._actions if a.dest != "help"}


def _default(dest: str) -> object:
    """The default ``--help`` shows for ``dest`` (the field's)."""
    text = _options()[dest].help or ""
    return text.rsplit("(default: ", 1)[1].removesuffix(")") if "(default: " in text else None


def _sample(dest: str) -> list[str]:
    """Flags setting ``dest``: its line in SAMPLES, else a switch, else its default value."""
    if dest in SAMPLES:
        return SAMPLES[dest]
    action = _options()[dest]
    if action.nargs == 0:
        return [action.option_strings[0]]
    default = _default(dest)
    return [] if default in (None, "None") else [action.option_strings[0], str(default)]


def _walk() -> list[tuple[str, str, str]]:
    """(dest, strategy, schedule): an option with a rule against every pair, the others (which
    apply everywhere) against the default pair only."""
    pairs = [(st, sc) for st in strategy_names() for sc in schedule_names()]
    out = []
    for dest in sorted(_options()):
        limited = rule_of(dest) is not None
        out += [(dest, st, sc) for st, sc in (pairs if limited else pairs[:1])]
    return out


def _cfg(*argv: str, notes: list[str] | None = None) -> TrainConfig:
    args = _train_parser().parse_args(list(argv))
    return config_from_args(args, note=(notes if notes is not None else []).append)


def test_every_rule_is_an_option_and_every_option_has_a_sample():
    options = _options()
    assert len(options) > 40  # the walk below sees the real parser
    stale = sorted(set(RULES) - set(options) - {"auto_domains"})  # auto: --domains auto
    assert not stale, f"entries of option_rules.RULES that are no option: {stale}"
    unsampled = [d for d in options if not _sample(d) and d not in SAMPLES]
    assert not unsampled, f"options defaulting to None without a sample value: {unsampled}"


@pytest.mark.parametrize(("dest", "strategy", "schedule"), _walk())
def test_every_option_is_accepted_or_refused_by_name(dest, strategy, schedule, tmp_path):
    config = tmp_path / "empty.toml"
    config.write_text("")
    flags = [f.replace("{config}", str(config)) for f in _sample(dest)]
    argv = ["--strategy", strategy, "--schedule", schedule, *flags]
    rule = rule_of(dest)
    misfit = None if rule is None else rule.misfit(strategy, schedule)
    if misfit is None:
        cfg = _cfg(*argv)
        assert (cfg.model.moe.dispatcher, cfg.schedule) == (strategy, schedule)
        return
    with pytest.raises(ValueError) as info:
        _cfg(*argv)
    message = str(info.value)
    choice, chosen, _ = misfit
    assert message.startswith(f"{flags[0]} does not apply to {choice} {chosen}: only to "), message
    assert "\n" not in message


# The cases of the issue, each with the line a user now sees.
AR_CHUNK = (
    "--ar-chunk does not apply to --schedule vanilla: only to --schedule moe-only or flowmoe (Sp, "
    "the chunk size of their gradient all-reduce pool; a schedule without the pool all-reduces "
    "every gradient at once after the backward); drop --ar-chunk or choose --schedule moe-only "
    "or flowmoe"
)
DOMAINS = (
    "--domains does not apply to --strategy {s}: only to --strategy hybrid (the sizes of hybrid's "
    "expert domains; no other strategy has domains); drop --domains or choose --strategy hybrid"
)
CR = (
    "--expert-compression-ratio does not apply to --strategy {s}: only to --strategy hybrid (the "
    "compression of the experts hybrid gathers; no other strategy gathers experts); drop "
    "--expert-compression-ratio or choose --strategy hybrid"
)
CLUSTER = (
    "--cluster does not apply to --strategy {s}: only to --strategy hybrid (the topology whose "
    "levels hold hybrid's expert domains; no other strategy reads it); drop --cluster or choose "
    "--strategy hybrid"
)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # --ar-chunk with vanilla (the default schedule): it has no pool
        (["--ar-chunk", "4MiB"], AR_CHUNK),
        (["--schedule", "vanilla", "--ar-chunk", "auto"], AR_CHUNK),
        # --domains 1,2 was not even valid for EP 2: now refused for what it is
        (["--domains", "1,2"], DOMAINS.format(s="dropless")),
        (["--strategy", "padded", "--domains", "auto"], DOMAINS.format(s="padded")),
        (["--strategy", "taskflow", "--expert-compression-ratio", "4"], CR.format(s="taskflow")),
        # --cluster ... --domains auto with padded: both named in one line
        (
            ["--strategy", "padded", "--cluster", str(SMALL), "--domains", "auto"],
            CLUSTER.format(s="padded") + "; " + DOMAINS.format(s="padded"),
        ),
        # unchanged: a pipelined R with vanilla is a value error
        (
            ["--schedule", "vanilla", "--pipeline-degree", "2"],
            "pipeline_degree (2) needs a pipelined schedule (moe-only, flowmoe); --schedule "
            "vanilla runs the whole batch at once",
        ),
    ],
    ids=["ar-chunk", "ar-chunk-auto", "domains", "domains-auto", "cr", "cluster-auto", "R"],
)
def test_issue_cases_are_refused(argv, message, tmp_path, capsys):
    with pytest.raises(ValueError) as info:
        _cfg(*argv)
    assert str(info.value) == message
    # through the CLI: exit 2, that one line, before the run directory exists
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *argv]) == 2
    assert capsys.readouterr().err == f"moesaic train: error: {message}\n"
    assert not run.exists()


def test_the_applying_combinations_are_accepted():
    assert _cfg("--schedule", "flowmoe", "--ar-chunk", "4MiB").ar_chunk_bytes == 4 * 2**20
    assert _cfg("--schedule", "moe-only", "--ar-chunk", "4MiB").ar_chunk_bytes == 4 * 2**20
    cfg = _cfg("--strategy", "hybrid", "--domains", "1,2", "--expert-compression-ratio", "4")
    assert cfg.model.moe.options == HybridOptions(domain_sizes=(1, 2), compression_ratio=4.0)
    cfg = _cfg("--strategy", "hybrid", "--cluster", str(SMALL), "--domains", "auto")
    assert cfg.auto_domains and cfg.cluster == str(SMALL)


def test_defaults_are_never_judged():
    """Only what the user set is checked: vanilla + dropless with every default is fine."""
    notes: list[str] = []
    cfg = _cfg(notes=notes)
    assert (cfg.schedule, cfg.model.moe.dispatcher, notes) == ("vanilla", "dropless", [])


def test_toml_keys_that_do_not_apply_are_noted_not_refused(tmp_path, capsys):
    """A TOML file is often shared by runs that pick the strategy and schedule on the command
    line: its keys for other choices are accepted, each with one line saying it has no effect."""
    toml = tmp_path / "shared.toml"
    toml.write_text(
        f'ar_chunk = "4MiB"\ncluster = "{SMALL}"\n'
        '[model.moe]\ndomain_sizes = "auto"\nexpert_compression_ratio = 4.0\n'
    )
    notes: list[str] = []
    cfg = _cfg("--config", str(toml), "--strategy", "padded", notes=notes)
    # hybrid's options are dropped after their notes: padded has none, so no domains either
    assert cfg.model.moe.dispatcher == "padded" and not cfg.auto_domains
    assert notes == [
        f"ar_chunk in {toml} has no effect with --schedule vanilla: it applies only to "
        "--schedule moe-only or flowmoe (Sp, the chunk size of their gradient all-reduce pool; "
        "a schedule without the pool all-reduces every gradient at once after the backward)",
        f"cluster in {toml} has no effect with --strategy padded: it applies only to --strategy "
        "hybrid (the topology whose levels hold hybrid's expert domains; no other strategy reads "
        "it)",
        f"model.moe.options.domain_sizes in {toml} has no effect with --strategy padded: it "
        "applies only to --strategy hybrid (the sizes of hybrid's expert domains; no other "
        "strategy has domains)",
        f"model.moe.options.compression_ratio in {toml} has no effect with --strategy padded: it "
        "applies only to --strategy hybrid (the compression of the experts hybrid gathers; no "
        "other strategy gathers experts)",
    ]
    # the same file with the choices it was written for: no note
    notes.clear()
    _cfg("--config", str(toml), "--strategy", "hybrid", "--schedule", "flowmoe", notes=notes)
    assert notes == []
    # the default note is one stderr line per key
    config_from_args(_train_parser().parse_args(["--config", str(toml), "--strategy", "padded"]))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("moesaic train: note: ") for line in err)


def test_a_flag_over_a_toml_key_is_judged_as_a_flag(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('ar_chunk = "4MiB"\n')
    with pytest.raises(ValueError, match=r"^--ar-chunk does not apply to --schedule vanilla"):
        _cfg("--config", str(toml), "--ar-chunk", "8MiB")
