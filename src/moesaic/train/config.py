"""TrainConfig: every knob of a training run, from defaults, a TOML file and flags (in that order).

A TOML file holds the run's keys at top level, the model's under ``[model]`` and its MoE blocks'
under ``[model.moe]``, with the names of the dataclass fields (``batch_size``, ``d_model``,
``num_experts``); flags use the same names with dashes (a few are shorter: ``--experts``).
Torch-free: ``moesaic train --help`` and the launcher's validation never import torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from moesaic.checks import check_bool, check_int, check_number, check_one_of, read_toml
from moesaic.models.config import MoEGPTConfig, nest_legacy_keys
from moesaic.schedule import schedule_names
from moesaic.strategies.registry import check_supported, strategy_names
from moesaic.train import domains
from moesaic.train.option_rules import check_applicable
from moesaic.train.schedule_options import (
    auto_pipeline_degree,
    parse_ar_chunk,
    parse_pipeline_degree,
)

BACKENDS = ("auto", "gloo", "nccl")


NONFINITE_POLICIES = ("stop", "skip")

# --trace / --trace-png keep the spans of the run's last this many steps (one step is a few
# hundred spans per rank at R = 4, so a trace stays small; earlier steps include warm-up).
TRACE_STEPS = 3


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """One training run.

    Attributes:
        model: the model shape (its MoE blocks' ``collective_timeout_s`` is set to
            ``timeout_s``).
        nproc: worker processes on this node (torchrun's ``--nproc-per-node``).
        ep: expert-parallel group size; None = all ranks in one EP group. The world size must
            be a multiple; the quotient is the data-parallel degree.
        steps: optimizer steps of the whole run (the LR schedule's length).
        batch_size: sequences per rank per step (the global batch is world size times this).
        lr: peak learning rate (AdamW), reached after ``warmup_steps``; cosine decay to
            ``lr * min_lr_ratio`` at ``steps``.
        min_lr_ratio: final LR as a fraction of ``lr``.
        warmup_steps: linear warm-up steps.
        weight_decay: AdamW decoupled weight decay of matrices (not of norms).
        grad_clip: clip the global gradient norm to this (0 = off).
        schedule: the training-step schedule (``moesaic.schedule``): "vanilla" (whole batch,
            all-reduce after the backward), "moe-only" (all-to-alls pipelined with the experts
            in R chunks), "flowmoe" (attention too, and gradient all-reduce chunks in the
            gaps).
        pipeline_degree: R, the chunks a pipelined schedule cuts each rank's batch into; must
            divide ``batch_size``; ``vanilla`` needs 1. "auto" (the default): 1 for
            ``vanilla``, else ``AUTO_PIPELINE_DEGREE`` when it divides ``batch_size``, else 1.
        ar_chunk: Sp, the gradient all-reduce chunk of the communication pool: "auto"
            (``flowmoe``: tuned online by Bayesian optimisation; ``moe-only``: one chunk) or a
            number of bytes (an int, or a string such as "4MiB" = 4 * 2**20 or "4MB" =
            4 * 10**6). ``vanilla`` has no pool: ``moesaic train`` refuses the flag there
            (``moesaic.train.option_rules``).
        trace: write a Chrome trace (Perfetto, chrome://tracing) of the last ``TRACE_STEPS``
            steps of every rank here (rank 0 writes it at the end); None = no trace.
        trace_png: draw the same timeline as a PNG here (needs matplotlib); None = none.
        on_nonfinite: a step whose loss, aux loss or gradients are not finite on some rank is
            never applied; "stop" ends the run with an error naming the step, "skip" goes on.
        nonfinite_skip_limit: with "skip", this many non-finite steps in a row stop the run.
        seed: seeds the init (alike on every rank) and the data order.
        data: a text file or a directory of files; None = the running Python's standard library.
        data_max_bytes: read at most this many bytes of the corpus (keeps loading fast).
        val_fraction: the corpus tail kept for validation.
        eval_every: validation loss every this many steps (and at the end; 0 = only at the end).
        eval_batches: validation batches per rank per evaluation.
        ckpt_every: checkpoint every this many steps (and at the end; 0 = only at the end).
        keep_checkpoints: how many checkpoints to keep (older ones are deleted).
        run_dir: where checkpoints and ``metrics.jsonl`` go.
        resume: continue from ``run_dir``'s latest checkpoint.
        max_restarts: the elastic agent restarts a failed worker group this many times, each
            time resuming from the latest checkpoint.
        backend: "gloo", "nccl", or "auto" (NCCL when CUDA is available, else gloo).
        timeout_s: deadline of every collective: the process group's, the gradient and
            statistics all-reduces, the checkpoint barriers and the MoE layers' all-to-alls.
        threads: torch threads per worker; None = CPU cores / nproc (at least 1).
        progress: show the tqdm progress bar on rank 0.
        fault_kill_rank: fault injection: this rank SIGKILLs itself at ``fault_kill_step``
            (only on the first attempt, so the restarted group runs to the end).
        fault_kill_step: the step at whose start the kill happens.
        cluster: a cluster description (TOML, ``moesaic.cluster.spec``) of one expert-parallel
            group, handed to every MoE layer as its topology (the ``hybrid`` strategy's levels);
            its world size must equal the EP size. None: no topology.
        auto_domains: ``--domains auto`` (``model.moe.domain_sizes = "auto"``): at the start of
            the run the ``hybrid`` strategy's domain sizes are chosen by the cost model of
            ``moesaic plan`` on ``cluster`` (needed), at rank 0's measured GEMM throughput
            (``moesaic.train.domains``); other strategies have no domains (``moesaic train``
            refuses the flag: ``moesaic.train.option_rules``).
    """

    model: MoEGPTConfig = field(default_factory=MoEGPTConfig)
    nproc: int = 2
    ep: int | None = None
    steps: int = 360
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    schedule: str = "vanilla"
    pipeline_degree: int | str = "auto"
    ar_chunk: str | int = "auto"
    trace: str | None = None
    trace_png: str | None = None
    on_nonfinite: str = "stop"
    nonfinite_skip_limit: int = 10
    seed: int = 0
    data: str | None = None
    data_max_bytes: int = 4_000_000
    val_fraction: float = 0.05
    eval_every: int = 50
    eval_batches: int = 4
    ckpt_every: int = 100
    keep_checkpoints: int = 2
    run_dir: str = "runs/moe-gpt"
    resume: bool = False
    max_restarts: int = 0
    backend: str = "auto"
    timeout_s: float = 300.0
    threads: int | None = None
    progress: bool = True
    fault_kill_rank: int | None = None
    fault_kill_step: int | None = None
    cluster: str | None = None
    auto_domains: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, MoEGPTConfig):
            raise ValueError(f"model must be a MoEGPTConfig, got {type(self.model).__name__}")
        for name, minimum in (
            ("nproc", 1),
            ("steps", 1),
            ("batch_size", 1),
            ("warmup_steps", 0),
            ("seed", 0),
            ("data_max_bytes", 2),
            ("eval_every", 0),
            ("eval_batches", 1),
            ("ckpt_every", 0),
            ("keep_checkpoints", 1),
            ("max_restarts", 0),
            ("nonfinite_skip_limit", 1),
        ):
            check_int(name, getattr(self, name), minimum)
        for name in ("ep", "threads", "fault_kill_step"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if self.fault_kill_rank is not None:
            check_int("fault_kill_rank", self.fault_kill_rank, 0)
        if (self.fault_kill_rank is None) != (self.fault_kill_step is None):
            raise ValueError("fault_kill_rank and fault_kill_step must be given together")
        check_number("lr", self.lr, 0.0)
        check_number("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_number("weight_decay", self.weight_decay, 0.0)
        check_number("grad_clip", self.grad_clip, 0.0)
        check_number("val_fraction", self.val_fraction, 0.0, 0.5, lo_open=True)
        check_number("timeout_s", self.timeout_s, 1e-3)
        check_one_of("backend", self.backend, BACKENDS)
        check_one_of("schedule", self.schedule, schedule_names())
        self._check_pipeline()
        check_one_of("on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)
        check_bool("resume", self.resume)
        check_bool("progress", self.progress)
        if not isinstance(self.run_dir, str) or not self.run_dir:
            raise ValueError(f"run_dir must be a non-empty path, got {self.run_dir!r}")
        self._check_domains()
        for name in ("trace", "trace_png", "cluster"):
            path = getattr(self, name)
            if path is not None and (not isinstance(path, str) or not path):
                raise ValueError(f"{name} must be a non-empty path or None, got {path!r}")
        if self.trace_png is not None and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("trace_png needs matplotlib (pip install matplotlib)")
        # One deadline for every collective: the MoE layers' too (they would keep 300 s).
        moe = self.model.moe
        if moe.collective_timeout_s != self.timeout_s:
            moe = dataclasses.replace(moe, collective_timeout_s=float(self.timeout_s))
            self.model = dataclasses.replace(self.model, moe=moe)

    def _check_pipeline(self) -> None:
        if self.pipeline_degree == "auto":
            self.pipeline_degree = auto_pipeline_degree(self.schedule, self.batch_size)
        R = check_int("pipeline_degree", self.pipeline_degree, 1)
        if self.batch_size % R:
            raise ValueError(
                f"pipeline_degree ({R}) must divide batch_size ({self.batch_size}): "
                "--pipeline-degree R cuts each rank's batch of sequences into R equal chunks"
            )
        if R > 1 and self.schedule == "vanilla":
            pipelined = [n for n in schedule_names() if n != "vanilla"]
            raise ValueError(
                f"pipeline_degree ({R}) needs a pipelined schedule "
                f"({', '.join(pipelined) or 'none registered'}); --schedule vanilla runs the "
                "whole batch at once"
            )
        self.ar_chunk = parse_ar_chunk(self.ar_chunk)

    def _check_domains(self) -> None:
        check_bool("auto_domains", self.auto_domains)
        if self.auto_domains and self.model.moe.domain_sizes is not None:
            raise ValueError(
                f"model.moe.domain_sizes is both 'auto' and {list(self.model.moe.domain_sizes)}"
            )
        if self.auto_domains and self.cluster is None:
            raise ValueError(
                "domain_sizes 'auto' (--domains auto) needs cluster (--cluster FILE.toml): the "
                "cost model prices the cluster's links"
            )

    @property
    def ar_chunk_bytes(self) -> int | None:
        """Sp in bytes, or None for "auto" (tuned online)."""
        return None if self.ar_chunk == "auto" else int(self.ar_chunk)

    def check_world(self, world_size: int) -> int:
        """Validate the EP layout for ``world_size`` ranks; returns the EP size."""
        ep = world_size if self.ep is None else self.ep
        if world_size % ep:
            raise ValueError(f"ep ({ep}) must divide the world size ({world_size})")
        if self.model.moe.num_experts % ep:
            raise ValueError(
                f"num_experts ({self.model.moe.num_experts}) must be divisible by the "
                f"expert-parallel size ep ({ep})"
            )
        if self.fault_kill_rank is not None and self.fault_kill_rank >= world_size:
            raise ValueError(
                f"fault_kill_rank ({self.fault_kill_rank}) must be < the world size ({world_size})"
            )
        domains.check_cluster_and_domains(self.cluster, self.model.moe, ep)
        moe = self.model.moe
        check_supported(
            moe.dispatcher, schedule=self.schedule, capacity=moe.capacity_factor is not None
        )
        return ep

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["model"] = self.model.to_dict()
        return d

    def agreement_fields(self) -> dict[str, object]:
        """What every rank of a run must agree on (``moesaic.comm.agree``): the model (every
        field, MoE ones as ``model.moe.<name>``) and every option that changes the numbers or
        the collectives. Per-node options (``nproc``, ``threads``, ``progress``, fault
        injection, ``max_restarts``) and paths (``run_dir``, ``data``: a shared file system may
        be mounted at different places; the caller compares the data's size instead) are left
        out.
        """
        per_node = {"nproc", "threads", "progress", "max_restarts", "run_dir", "data", "model"}
        per_node |= {"fault_kill_rank", "fault_kill_step", "trace", "trace_png", "cluster"}
        out: dict[str, object] = {f"model.{k}": v for k, v in self.model.fields_flat().items()}
        # Where a trace goes is per node, whether there is one is not: gathering it is a
        # collective every rank must take part in.
        out["tracing"] = self.trace is not None or self.trace_png is not None
        for f in dataclasses.fields(self):
            if f.name not in per_node:
                out[f.name] = getattr(self, f.name)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Build from a (possibly partial) dict like ``to_dict()``'s; unknown keys are errors.

        ``model.moe.collective_timeout_s`` may only repeat ``timeout_s`` (which sets it).
        """
        d = dict(d)
        model = d.pop("model", {})
        if not isinstance(model, dict):
            raise ValueError("model must be a table of MoEGPTConfig fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown training option(s) {unknown}; known: {sorted(known)}")
        model, auto = domains.split_auto_domains(nest_legacy_keys(model))
        if auto:
            d["auto_domains"] = True
        moe = model.get("moe")
        timeout_s = d.get("timeout_s", cls.__dataclass_fields__["timeout_s"].default)
        if isinstance(moe, dict) and moe.get("collective_timeout_s", timeout_s) != timeout_s:
            raise ValueError(
                f"model.moe.collective_timeout_s ({moe['collective_timeout_s']}) differs from "
                f"timeout_s ({timeout_s}); in a training run timeout_s (--timeout-s) is the "
                "deadline of every collective, the MoE layers' included: set that instead"
            )
        return cls(model=MoEGPTConfig.from_dict(model), **d)


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
    ("--aux-loss-coef", "moe.aux_loss_coef", float),
    ("--z-loss-coef", "moe.z_loss_coef", float),
    ("--dispatcher", "moe.dispatcher", str),
    ("--domains", "moe.domain_sizes", str),
    ("--expert-compression-ratio", "moe.expert_compression_ratio", float),
)
# Other spellings of a flag (same option): --strategy is --dispatcher.
_ALIASES = {"--dispatcher": ("--strategy",)}
_RUN_FLAGS = (
    ("--nproc", "nproc", int),
    ("--ep", "ep", int),
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
)
_HELP = {
    "seq_len": "context length T",
    "d_model": "model width D",
    "n_layers": "transformer blocks",
    "n_heads": "attention heads",
    "moe.num_experts": "routed experts E per MoE block",
    "moe.top_k": "experts per token K",
    "moe.ffn_hidden_size": "hidden width of each expert (SwiGLU)",
    "dense_layers": "the first N blocks use a dense MLP instead of experts",
    "dense_hidden": "dense MLP width (default 4 * d_model)",
    "moe.aux_loss_coef": "load-balancing loss weight",
    "moe.z_loss_coef": "router z-loss weight",
    "moe.dispatcher": "MoE execution strategy (moesaic.strategies; --strategy is the same): "
    + ", ".join(strategy_names()),
    "moe.domain_sizes": "hybrid's expert-domain sizes S0,S1,... (one per --cluster level, "
    "outermost first), or 'auto': chosen by the cost model of `moesaic plan` on --cluster",
    "moe.expert_compression_ratio": "hybrid: SR compression ratio CR of gathered experts "
    "(1 = exact)",
    "nproc": "worker processes on this node",
    "ep": "expert-parallel group size (default: all ranks); DP = world / EP",
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
}


_METAVARS = {
    "pipeline_degree": "auto|R",
    "ar_chunk": "auto|BYTES",
    "trace": "FILE.json",
    "trace_png": "FILE.png",
    "schedule": "|".join(schedule_names()),
    "cluster": "FILE.toml",
    "moe.domain_sizes": "auto|S0,S1,...",
    "moe.expert_compression_ratio": "CR",
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
    run.add_argument(
        "--resume",
        dest="resume",
        action="store_true",
        default=argparse.SUPPRESS,
        help="continue from the latest checkpoint in --run-dir",
    )
    run.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        default=argparse.SUPPRESS,
        help="no progress bar (log lines only)",
    )
    model = parser.add_argument_group("model")
    for flag, name, typ in _MODEL_FLAGS:
        default = attrgetter(name)(defaults.model)
        model.add_argument(
            flag,
            *_ALIASES.get(flag, ()),
            dest=f"model.{name}",
            metavar=_METAVARS.get(name, name.rsplit(".", 1)[-1].upper()),
            type=typ,
            default=argparse.SUPPRESS,
            help=f"{_HELP[name]} (default: {default})",
        )


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file (run keys at top level, model keys under ``[model]``)."""
    return read_toml(path, "config file")


# dest -> the flag that sets it (its first spelling), for messages.
_FLAG_OF = {name: flag for flag, name, _ in _RUN_FLAGS}
_FLAG_OF |= {f"model.{name}": _ALIASES.get(flag, (flag,))[0] for flag, name, _ in _MODEL_FLAGS}
_FLAG_OF |= {"config": "--config", "resume": "--resume", "progress": "--no-progress"}


def _toml_keys(d: dict[str, Any]) -> list[str]:
    """The options a TOML file sets, as dests (``ar_chunk``, ``model.moe.domain_sizes``)."""
    keys = [k for k in d if k != "model"]
    model = d.get("model", {})
    keys += [f"model.{k}" for k in model if k != "moe"]
    return keys + [f"model.moe.{k}" for k in model.get("moe", {})]


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
    model = nest_legacy_keys(model)  # before the flags, so that a flag wins over a 0.1 key
    if not isinstance(model.get("moe", {}), dict):
        raise ValueError(f"model.moe must be a table of MoEConfig fields, got {model['moe']!r}")
    model["moe"] = dict(model.get("moe", {}))
    d = {**d, "model": model}
    given: dict[str, str] = dict.fromkeys(_toml_keys(d), str(config))
    for key, value in vars(args).items():
        if key.startswith("model.moe."):
            model["moe"][key.removeprefix("model.moe.")] = value
        elif key.startswith("model."):
            model[key.removeprefix("model.")] = value
        elif key in TrainConfig.__dataclass_fields__:
            d[key] = value
    given |= {key: _FLAG_OF[key] for key in vars(args) if key in _FLAG_OF}
    # Whether an option applies comes before whether its value is right (no point fixing a
    # value that will be refused); unknown names are left to TrainConfig's own messages.
    strategy = model["moe"].get("dispatcher", MoEGPTConfig().moe.dispatcher)
    schedule = d.get("schedule", TrainConfig.__dataclass_fields__["schedule"].default)
    if strategy in strategy_names() and schedule in schedule_names():
        check_applicable(given, strategy=strategy, schedule=schedule, note=note)
    return TrainConfig.from_dict(d)
