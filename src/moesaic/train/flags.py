"""The command line of ``moesaic train``: its flags, and how they and a TOML file become a
:class:`~moesaic.train.config.TrainConfig`.

Every option is a ``TrainConfig`` field (run keys) or a ``MoEGPTConfig`` field under ``model.``
(``model.moe.`` for the MoE blocks'); a flag is the field's name with dashes unless the tables
below say otherwise (``--experts``). Flags left unset stay absent, so that a TOML file's values
survive: :func:`config_from_args` applies defaults, then the ``--config`` file, then the flags,
and refuses the options that do not apply to the run's strategy and schedule
(:mod:`moesaic.train.option_rules`). Torch-free: ``moesaic train --help`` never imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from moesaic.checks import read_toml
from moesaic.interop.hf_families import FAMILIES as HF_FAMILIES
from moesaic.models.config import MoEGPTConfig, nest_legacy_keys
from moesaic.schedule import schedule_names
from moesaic.strategies.registry import strategy_names
from moesaic.strategy_table import options_class
from moesaic.train.config import TRACE_STEPS, TrainConfig
from moesaic.train.domains import load_cluster
from moesaic.train.option_rules import check_applicable, drop_other_options
from moesaic.train.plan import AUTO, apply_plan_option, blame_plan
from moesaic.train.schedule_options import parse_pipeline_degree

__all__ = ["add_train_arguments", "config_from_args", "load_toml"]


# (flag, field, type) of every option; a model field is a path under [model] ("moe.top_k").
_MODEL_FLAGS = (
    ("--seq-len", "seq_len", int),
    ("--d-model", "d_model", int),
    ("--n-layers", "n_layers", int),
    ("--n-heads", "n_heads", int),
    ("--experts", "moe.num_experts", int),
    ("--top-k", "moe.top_k", int),
    ("--expert-hidden", "moe.ffn_hidden_size", int),
    ("--dense-layers", "dense_layers", int),
    ("--dense-hidden", "dense_hidden", int),
    ("--norm", "norm", str),
    ("--positions", "positions", str),
    ("--moe-layer-freq", "moe_layer_freq", int),
    ("--shared-experts", "moe.num_shared_experts", int),
    ("--shared-expert-hidden", "moe.shared_expert_hidden_size", int),
    ("--aux-loss-coef", "moe.aux_loss_coef", float),
    ("--z-loss-coef", "moe.z_loss_coef", float),
    ("--seq-aux-loss-coef", "moe.seq_aux_loss_coef", float),
    ("--balance-loss-scope", "moe.balance_loss_scope", str),
    ("--score-bias-update-rate", "moe.score_bias_update_rate", float),
    ("--expert-groups", "moe.num_expert_groups", int),
    ("--topk-groups", "moe.topk_groups", int),
    ("--routed-scaling-factor", "moe.routed_scaling_factor", float),
    ("--dispatcher", "moe.dispatcher", str),
    ("--domains", "moe.options.domain_sizes", str),
    ("--expert-compression-ratio", "moe.options.compression_ratio", float),
)
# Other spellings of a flag (same option): --strategy is --dispatcher.
_ALIASES = {"--dispatcher": ("--strategy",)}
_RUN_FLAGS = (
    ("--nproc", "nproc", int),
    ("--ep", "ep", int),
    ("--dp-shard", "dp_shard", int),
    ("--dp-replicate", "dp_replicate", int),
    ("--steps", "steps", int),
    ("--batch-size", "batch_size", int),
    ("--lr", "lr", float),
    ("--min-lr-ratio", "min_lr_ratio", float),
    ("--warmup-steps", "warmup_steps", int),
    ("--weight-decay", "weight_decay", float),
    ("--grad-clip", "grad_clip", float),
    ("--schedule", "schedule", str),
    ("--pipeline-degree", "pipeline_degree", parse_pipeline_degree),
    ("--ar-chunk", "ar_chunk", str),
    ("--trace", "trace", str),
    ("--trace-png", "trace_png", str),
    ("--on-nonfinite", "on_nonfinite", str),
    ("--nonfinite-skip-limit", "nonfinite_skip_limit", int),
    ("--seed", "seed", int),
    ("--data", "data", str),
    ("--data-max-bytes", "data_max_bytes", int),
    ("--val-fraction", "val_fraction", float),
    ("--eval-every", "eval_every", int),
    ("--eval-batches", "eval_batches", int),
    ("--ckpt-every", "ckpt_every", int),
    ("--keep-checkpoints", "keep_checkpoints", int),
    ("--run-dir", "run_dir", str),
    ("--max-restarts", "max_restarts", int),
    ("--backend", "backend", str),
    ("--timeout-s", "timeout_s", float),
    ("--threads", "threads", int),
    ("--fault-kill-rank", "fault_kill_rank", int),
    ("--fault-kill-step", "fault_kill_step", int),
    ("--cluster", "cluster", str),
    ("--hf-config", "hf_config", str),
    ("--dtype", "dtype", str),
    ("--emulate", "emulate", str),
    ("--plan", "plan", str),
)
_HELP = {
    "seq_len": "context length T",
    "d_model": "model width D",
    "n_layers": "transformer blocks",
    "n_heads": "attention heads",
    "norm": "pre-norm: rmsnorm or layernorm",
    "positions": "positions: rope (rotary) or learned (absolute embeddings)",
    "moe.num_experts": "routed experts E per MoE block",
    "moe.top_k": "experts per token K",
    "moe.ffn_hidden_size": "hidden width of each expert (SwiGLU)",
    "dense_layers": "the first N blocks use a dense MLP instead of experts",
    "dense_hidden": "dense MLP width (default 4 * d_model)",
    "moe_layer_freq": "every N-th block (after --dense-layers) is an MoE block, the others dense",
    "moe.num_shared_experts": "shared SwiGLU experts every token passes through (replicated)",
    "moe.shared_expert_hidden_size": "hidden width of each shared expert (default --expert-hidden)",
    "moe.aux_loss_coef": "load-balancing loss weight",
    "moe.z_loss_coef": "router z-loss weight",
    "moe.seq_aux_loss_coef": "weight of DeepSeek-V3's sequence-wise balance loss",
    "moe.balance_loss_scope": "load fractions of the balance loss: local (this rank's tokens) "
    "or global (every rank's tokens of the step)",
    "moe.score_bias_update_rate": "gamma of auxiliary-loss-free balancing (a per-expert bias on "
    "the choice scores, updated after each step; 0 = off)",
    "moe.num_expert_groups": "group-limited routing: experts split into this many groups",
    "moe.topk_groups": "group-limited routing: groups a token may choose experts from",
    "moe.routed_scaling_factor": "multiplies the routed experts' combine weights",
    "moe.dispatcher": "MoE execution strategy (moesaic.strategies; --strategy is the same): "
    + ", ".join(strategy_names()),
    "moe.options.domain_sizes": "hybrid's expert-domain sizes S0,S1,... (one per --cluster level, "
    "outermost first), or 'auto': chosen by the cost model of `moesaic plan` on --cluster",
    "moe.options.compression_ratio": "hybrid: SR compression ratio CR of gathered experts "
    "(1 = exact)",
    "nproc": "worker processes on this node",
    "ep": "expert-parallel group size (default: all ranks); DP = world / EP",
    "dp_shard": "FSDP2 sharding: the ranks beside EP each expert is sharded over; dense "
    "parameters are sharded over dp_shard x ep ranks (world = dp_replicate x dp_shard x ep)",
    "dp_replicate": "HSDP: replicas of the sharded model (gradients all-reduced across them)",
    "steps": "optimizer steps (length of the LR schedule)",
    "batch_size": "sequences per rank per step",
    "lr": "peak learning rate (AdamW, warm-up then cosine)",
    "min_lr_ratio": "final LR as a fraction of --lr",
    "warmup_steps": "linear warm-up steps",
    "weight_decay": "AdamW weight decay of matrices",
    "grad_clip": "global gradient-norm clip (0 = off)",
    "schedule": f"training-step schedule: {', '.join(schedule_names())}",
    "pipeline_degree": "R: chunks of each rank's batch in a pipelined schedule (divides "
    "--batch-size); 'auto': 2 for a pipelined schedule when it divides --batch-size, else 1",
    "ar_chunk": "Sp: gradient all-reduce chunk of moe-only and flowmoe, 'auto' (flowmoe: tuned "
    "online) or bytes ('4MiB')",
    "trace": f"write a Chrome trace (Perfetto) of the last {TRACE_STEPS} steps of every rank",
    "trace_png": "draw the same timeline as a PNG (matplotlib)",
    "on_nonfinite": "a non-finite loss or gradient: stop the run, or skip that step",
    "nonfinite_skip_limit": "with --on-nonfinite skip: this many in a row stop the run",
    "seed": "init and data-order seed",
    "data": "text file or directory (default: this Python's standard library source)",
    "data_max_bytes": "read at most this many corpus bytes",
    "val_fraction": "corpus tail held out for validation",
    "eval_every": "validation every N steps (0 = only at the end)",
    "eval_batches": "validation batches per rank",
    "ckpt_every": "checkpoint every N steps (0 = only at the end)",
    "keep_checkpoints": "checkpoints kept",
    "run_dir": "checkpoints and metrics.jsonl go here",
    "max_restarts": "elastic restarts of a failed worker group (each resumes from the latest "
    "checkpoint)",
    "backend": "auto, gloo or nccl",
    "timeout_s": "deadline of every collective, seconds",
    "threads": "torch threads per worker (default: cores / nproc)",
    "fault_kill_rank": "fault injection: this rank SIGKILLs itself (first attempt only)",
    "fault_kill_step": "fault injection: at the start of this step",
    "cluster": "cluster description (TOML) of one EP group: the MoE layers' topology",
    "emulate": "train on this cluster's emulated network (root): one worker per rank in its "
    "network namespace, every collective over the shaped links (--nproc: its world size; "
    "--cluster: this file, for hybrid)",
    "plan": "train with the first combination of `moesaic plan --json`'s FILE.json (strategy, "
    "schedule, R, Sp, domains, ...), or 'auto': plan on rank 0 at the start from --cluster and "
    "a quick measurement of this machine",
    "dtype": "fp32, or bf16: the blocks under autocast, fp32 master weights and router (needs "
    "native bf16 matmuls: a GPU, or a CPU with AVX512-BF16 or AMX)",
    "hf_config": "train this transformers MoE architecture from random init, expert-parallel "
    f"(its config.json, model_type one of {', '.join(sorted(HF_FAMILIES))}; tiny ones in "
    "examples/hf/): it gives the model's shape; the data stay bytes",
}


_METAVARS = {
    "pipeline_degree": "auto|R",
    "ar_chunk": "auto|BYTES",
    "trace": "FILE.json",
    "trace_png": "FILE.png",
    "schedule": "|".join(schedule_names()),
    "cluster": "FILE.toml",
    "emulate": "CLUSTER.toml",
    "plan": "FILE.json|auto",
    "hf_config": "FILE.json",
    "dtype": "fp32|bf16",
    "norm": "rmsnorm|layernorm",
    "positions": "rope|learned",
    "moe.options.domain_sizes": "auto|S0,S1,...",
    "moe.options.compression_ratio": "CR",
    "moe.dispatcher": "|".join(strategy_names()),
}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every training option; unset flags stay absent so that TOML values survive."""
    defaults = TrainConfig()
    parser.add_argument("--config", metavar="FILE", help="TOML file of options (flags override it)")
    run = parser.add_argument_group("run")
    for flag, name, typ in _RUN_FLAGS:
        # The declared default ("auto"), not what __post_init__ resolved it to.
        declared = TrainConfig.__dataclass_fields__[name].default
        default = declared if declared is not dataclasses.MISSING else getattr(defaults, name)
        run.add_argument(
            flag,
            dest=name,
            type=typ,
            default=argparse.SUPPRESS,
            metavar=_METAVARS.get(name),
            help=f"{_HELP[name]} (default: {default})",
        )
    for flag, name, action, text in _SWITCHES:
        run.add_argument(flag, dest=name, action=action, default=argparse.SUPPRESS, help=text)
    model = parser.add_argument_group("model")
    for flag, name, typ in _MODEL_FLAGS:
        default = _model_default(defaults.model, name)
        model.add_argument(
            flag,
            *_ALIASES.get(flag, ()),
            dest=f"model.{name}",
            metavar=_METAVARS.get(name, name.rsplit(".", 1)[-1].upper()),
            type=typ,
            default=argparse.SUPPRESS,
            help=f"{_HELP[name]} (default: {default})",
        )


def _model_default(model: MoEGPTConfig, name: str) -> object:
    """The default of model field ``name``; of a strategy option (``moe.options.<option>``): its
    default in the options of the first strategy that has it."""
    option = name.removeprefix("moe.options.")
    if option == name:
        return attrgetter(name)(model)
    cls = next(options_class(s) for s in strategy_names() if option in options_class(s).names())
    return getattr(cls(), option)


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file (run keys at top level, model keys under ``[model]``)."""
    return read_toml(path, "config file")


# Switches: (flag, dest, action, help); a "store_false" one turns a default-on field off.
_SWITCHES = (
    ("--resume", "resume", "store_true", "continue from the latest checkpoint in --run-dir"),
    (
        "--force-plan",
        "force_plan",
        "store_true",
        "apply --plan FILE.json even if it was made for another world size, cluster or model",
    ),
    (
        "--async-checkpoint",
        "async_checkpoint",
        "store_true",
        "write checkpoints in the background while training goes on (a host copy of the state)",
    ),
    ("--no-progress", "progress", "store_false", "no progress bar (log lines only)"),
    (
        "--no-save-final",
        "save_final",
        "store_false",
        "no validation or checkpoint at the last step (a throwaway run: metrics only)",
    ),
    (
        "--activation-checkpointing",
        "activation_checkpointing",
        "store_true",
        "recompute each block in the backward instead of keeping its activations (vanilla "
        "schedule)",
    ),
    (
        "--measure-peak",
        "measure_peak",
        "store_true",
        "on a CPU, measure each rank's peak memory of the second step (that step is slower)",
    ),
)

# dest -> the flag that sets it (its first spelling), for messages.
_FLAG_OF = {name: flag for flag, name, _ in _RUN_FLAGS}
_FLAG_OF |= {f"model.{name}": _ALIASES.get(flag, (flag,))[0] for flag, name, _ in _MODEL_FLAGS}
_FLAG_OF |= {"config": "--config"} | {name: flag for flag, name, _, _ in _SWITCHES}


def _toml_keys(d: dict[str, Any]) -> list[str]:
    """The options a TOML file sets, as dests (``ar_chunk``, ``model.moe.options.domain_sizes``)."""
    keys = [k for k in d if k != "model"]
    model = d.get("model", {})
    keys += [f"model.{k}" for k in model if k != "moe"]
    moe = model.get("moe", {})
    keys += [f"model.moe.{k}" for k in moe if k != "options"]
    return keys + [f"model.moe.options.{k}" for k in moe.get("options", {})]


def _stderr_note(line: str) -> None:
    print(f"moesaic train: note: {line}", file=sys.stderr)


def config_from_args(
    args: argparse.Namespace, *, note: Callable[[str], None] = _stderr_note
) -> TrainConfig:
    """Defaults, then the ``--config`` TOML file, then the flags given.

    The options set (not the defaults) must apply to the run's strategy and schedule
    (``moesaic.train.option_rules``): a flag that does not is refused (ValueError), a TOML key
    that does not gets one ``note`` line saying it has no effect.
    """
    config: str | None = getattr(args, "config", None)
    d: dict[str, Any] = load_toml(config) if config else {}
    model = d.get("model", {})
    if not isinstance(model, dict):
        raise ValueError("model must be a table of MoEGPTConfig fields")
    # before the flags, so that a flag wins over a 0.1 key; every strategy's flat option keys
    # kept in options, where those of other strategies than the run's are noted, then dropped
    model = nest_legacy_keys(model, keep_other_options=True)
    if not isinstance(model.get("moe", {}), dict):
        raise ValueError(f"model.moe must be a table of MoEConfig fields, got {model['moe']!r}")
    model["moe"] = dict(model.get("moe", {}))
    options = model["moe"].get("options", {})
    if not isinstance(options, dict):
        raise ValueError(f"model.moe.options must be a table of option names, got {options!r}")
    model["moe"]["options"] = dict(options)
    d = {**d, "model": model}
    given: dict[str, str] = dict.fromkeys(_toml_keys(d), str(config))
    for key, value in vars(args).items():
        if key.startswith("model.moe.options."):
            model["moe"]["options"][key.removeprefix("model.moe.options.")] = value
        elif key.startswith("model.moe."):
            model["moe"][key.removeprefix("model.moe.")] = value
        elif key.startswith("model."):
            model[key.removeprefix("model.")] = value
        elif key in TrainConfig.__dataclass_fields__:
            d[key] = value
    given |= {key: _FLAG_OF[key] for key in vars(args) if key in _FLAG_OF}
    # --plan FILE.json sets the strategy, schedule and options it names; auto leaves them open
    planned = apply_plan_option(d, given, note)
    given = {key: source for key, source in given.items() if key not in planned}
    # Whether an option applies comes before whether its value is right (no point fixing a
    # value that will be refused); unknown names are left to TrainConfig's own messages.
    strategy = model["moe"].get("dispatcher", MoEGPTConfig().moe.dispatcher)
    schedule = d.get("schedule", TrainConfig.__dataclass_fields__["schedule"].default)
    if strategy in strategy_names() and schedule in schedule_names():
        check_applicable(given, strategy=strategy, schedule=schedule, note=note)
        # what was noted as another strategy's option has no effect: not the run's options
        model["moe"]["options"] = drop_other_options(model["moe"]["options"], strategy)
    emulate = d.get("emulate")
    if isinstance(emulate, str) and emulate and "nproc" not in d:
        # One worker per rank of the emulated cluster; a --nproc that disagrees is refused.
        d["nproc"] = load_cluster(emulate, option="emulate").world_size
    try:
        return TrainConfig.from_dict(d)
    except ValueError as exc:
        plan = d.get("plan")
        if isinstance(plan, str) and plan != AUTO:  # an option it set may be the cause
            raise blame_plan(exc, plan) from None
        raise
