"""TrainConfig: every knob of a training run, from defaults, a TOML file and flags (in that order).

A TOML file holds the run's keys at top level, the model's under ``[model]`` and its MoE blocks'
under ``[model.moe]``, with the names of the dataclass fields (``batch_size``, ``d_model``,
``num_experts``); flags use the same names with dashes (a few are shorter: ``--experts``), generated from the
fields and their docs below (a field's ``metadata``: ``moesaic.field_flags``). The flags and the
merge of defaults, file and flags are :mod:`moesaic.train.flags`. Torch-free: ``moesaic train
--help`` never imports torch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any

from moesaic.checks import check_bool, check_int, check_number, check_one_of
from moesaic.data.shards import token_vocab_size
from moesaic.field_flags import FLAG, METAVAR
from moesaic.interop.hf_families import apply_hf_shape, family_of, read_hf_config
from moesaic.models.config import MoEGPTConfig, nest_legacy_keys
from moesaic.schedule_table import DEFAULT_SCHEDULE, schedule_names, schedule_spec, schedules_where
from moesaic.strategies.registry import check_supported
from moesaic.strategy_options import StrategyOptions
from moesaic.train import domains
from moesaic.train.mesh import MeshShape, check_sharding
from moesaic.train.option_rules import RULES
from moesaic.train.schedule_options import (
    auto_pipeline_degree,
    parse_ar_chunk,
    parse_pipeline_degree,
)

BACKENDS = ("auto", "gloo", "nccl")


NONFINITE_POLICIES = ("stop", "skip")
# --dtype: what the blocks compute in (weights, optimizer state and the router stay fp32).
DTYPES = ("fp32", "bf16")

# --trace / --trace-png keep the spans of the run's last this many steps (one step is a few
# hundred spans per rank at R = 4, so a trace stays small; earlier steps include warm-up).
TRACE_STEPS = 3


def _schedules() -> str:
    return "|".join(schedule_names())


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """One training run.

    Attributes:
        model: the model shape (its MoE blocks' ``collective_timeout_s`` is set to
            ``timeout_s``).
        nproc: worker processes on this node (torchrun's ``--nproc-per-node``).
        ep: expert-parallel group size; None = all ranks in one EP group. The world size must
            be a multiple; the quotient is the data-parallel degree.
        dp_shard: FSDP2 sharding (``train/fsdp.py``): the ranks beside EP that each EP rank's
            experts are sharded over; the dense parameters are sharded over ``dp_shard * ep``
            ranks. None (and ``dp_replicate`` None): no sharding, every rank holds the dense
            model. With either set, the world is ``dp_replicate * dp_shard * ep`` ranks (the
            one left out is what the world leaves) and the strategy and schedule must run
            sharded (``train.mesh.check_sharding``).
        dp_replicate: HSDP: replicas of the sharded model; None = 1 when sharding.
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
        trace: write a Chrome trace (Perfetto, chrome://tracing) of the last 3 steps
            (``TRACE_STEPS``) of every rank here (rank 0 writes it at the end); None = no trace.
        trace_png: draw the same timeline as a PNG here (needs matplotlib); None = none.
        on_nonfinite: a step whose loss, aux loss or gradients are not finite on some rank is
            never applied; "stop" ends the run with an error naming the step, "skip" goes on.
        nonfinite_skip_limit: with "skip", this many non-finite steps in a row stop the run.
        seed: seeds the init (alike on every rank) and the data order.
        data: a text file or a directory of files (bytes), a directory written by ``moesaic
            prepare`` (token shards, ``moesaic.train.tokens``; the model's ``vocab_size`` is the
            tokenizer's unless set larger; ``data_max_bytes`` does not apply); None = the
            running Python's standard library.
        data_max_bytes: read at most this many bytes of the corpus (keeps loading fast).
        val_fraction: the corpus tail kept for validation.
        eval_every: validation loss every this many steps (and at the end; 0 = only at the end).
        eval_batches: validation batches per rank per evaluation.
        ckpt_every: checkpoint every this many steps (and at the end; 0 = only at the end).
        async_checkpoint: write each checkpoint in the background
            (``torch.distributed.checkpoint.async_save``): training goes on while a thread
            writes it from a copy in host memory; it is published (``latest``) when the next
            checkpoint starts and at the end. Costs a host copy of the state.
        save_final: the last step's validation and checkpoint (False: a throwaway run, e.g.
            ``calibrate``'s routing measurement or a benchmark point, writes only its metrics
            and whatever ``eval_every`` / ``ckpt_every`` ask for before the end).
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
        auto_domains: ``--domains auto`` (``model.moe.options.domain_sizes = "auto"``): at the
            start of the run the ``hybrid`` strategy's domain sizes are chosen by the cost model of
            ``moesaic plan`` on ``cluster`` (needed), at rank 0's measured GEMM throughput
            (``moesaic.train.domains``); other strategies have no domains (``moesaic train``
            refuses the flag: ``moesaic.train.option_rules``).
        hf_config: a transformers config file (``config.json``) of a supported MoE family
            (``moesaic.interop.hf_families``): the run trains that architecture from random
            initialisation, its MoE blocks made expert-parallel by
            ``moesaic.interop.hf.expert_parallel``; ``model``'s shape fields are filled in from
            it (``apply_hf_shape``). Byte data need its ``vocab_size`` >= 256; token shards
            replace it by the tokenizer's.
            Every schedule runs, except the pipelined ones for a family whose decoder layers
            do not split into their stages (``Family.no_pipeline``: Granite-MoE). None: an
            MoEGPT.
        dtype: "fp32", or "bf16": the blocks run under ``torch.autocast`` to bfloat16 with
            fp32 master weights (the optimizer updates fp32 weights; the embedding, head,
            loss and MoE routers compute in fp32; a transformers model, ``--hf-config``, runs
            its whole forward under it, the head's matmul too: ``HFCausalLM.set_autocast``).
            On a CPU without native bf16 matmuls (AVX512-BF16 or AMX) bf16 is slower than
            fp32.
        compile: ``torch.compile`` each block's dense parts (norms, attention, dense MLPs)
            and the final norm, in place (the model's ``compile_dense``); the MoE layers stay
            eager. The first steps compile (tens of seconds); later ones run the fused
            kernels.
        activation_checkpointing: keep only each block's input in the forward and recompute
            the block in the backward (``MoEGPT.activation_checkpointing``): less activation
            memory for one more forward (all-to-alls included) per block. The recomputation
            adds no aux loss or expert statistics a second time. Vanilla schedule only (the
            pipelined ones run the block stages themselves: ``option_rules``).
        emulate: a cluster description (TOML, ``moesaic.cluster.spec``): the launcher builds
            that cluster's emulated network (``moesaic.cluster``, root only) and runs one
            worker per rank inside the rank's namespace, so every collective crosses the
            shaped links (``moesaic.train.emulate``). ``nproc`` must be its world size (the
            flags set it so when ``--nproc`` is not given), ``backend`` gloo ("auto" becomes
            gloo; NCCL would bypass the links), and ``cluster`` defaults to the same file for
            a strategy that reads it (``hybrid``) when the EP group is the whole world.
        plan: where the strategy, schedule and their options come from (``moesaic.train.plan``):
            a JSON file of ``moesaic plan --json`` (its first entry, applied by
            ``config_from_args``; recorded here), or "auto": at the start of the run rank 0
            plans on ``cluster`` (needed) with a quick measurement of its machine and every
            rank trains with its pick (``moesaic.train.plan_auto``). None: the options given.
        force_plan: apply a ``plan`` file made for another world size, cluster or model shape
            (its ``made_for``) with a note, instead of refusing it.
        measure_peak: on a CPU, also measure each rank's peak bytes of the second step
            (``moesaic.train.memory.LiveBytes``: a dispatch mode that makes that step several
            times slower); on CUDA the peak is always measured (the allocator's statistics).
    """

    model: MoEGPTConfig = field(default_factory=MoEGPTConfig)
    nproc: int = 2
    ep: int | None = None
    dp_shard: int | None = None
    dp_replicate: int | None = None
    steps: int = 600
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    schedule: str = field(default=DEFAULT_SCHEDULE, metadata={METAVAR: _schedules})
    pipeline_degree: int | str = field(default="auto", metadata={METAVAR: "auto|R"})
    ar_chunk: str | int = field(default="auto", metadata={METAVAR: "auto|BYTES"})
    trace: str | None = field(default=None, metadata={METAVAR: "FILE.json"})
    trace_png: str | None = field(default=None, metadata={METAVAR: "FILE.png"})
    on_nonfinite: str = field(default="stop", metadata={METAVAR: "|".join(NONFINITE_POLICIES)})
    nonfinite_skip_limit: int = 10
    seed: int = 0
    data: str | None = None
    data_max_bytes: int = 4_000_000
    val_fraction: float = 0.05
    eval_every: int = 50
    eval_batches: int = 4
    ckpt_every: int = 100
    async_checkpoint: bool = False
    save_final: bool = True
    keep_checkpoints: int = 2
    run_dir: str = "runs/moe-gpt"
    resume: bool = False
    max_restarts: int = 0
    backend: str = field(default="auto", metadata={METAVAR: "|".join(BACKENDS)})
    timeout_s: float = 300.0
    threads: int | None = None
    progress: bool = True
    fault_kill_rank: int | None = None
    fault_kill_step: int | None = None
    cluster: str | None = field(default=None, metadata={METAVAR: "FILE.toml"})
    auto_domains: bool = field(default=False, metadata={FLAG: None})  # --domains auto
    hf_config: str | None = field(default=None, metadata={METAVAR: "FILE.json"})
    dtype: str = field(default="fp32", metadata={METAVAR: "|".join(DTYPES)})
    compile: bool = False
    activation_checkpointing: bool = False
    emulate: str | None = field(default=None, metadata={METAVAR: "CLUSTER.toml"})
    plan: str | None = field(default=None, metadata={METAVAR: "FILE.json|auto"})
    force_plan: bool = False
    measure_peak: bool = False

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
        for name in ("ep", "dp_shard", "dp_replicate", "threads", "fault_kill_step"):
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
        check_bool("async_checkpoint", self.async_checkpoint)
        check_bool("force_plan", self.force_plan)
        check_bool("progress", self.progress)
        if not isinstance(self.run_dir, str) or not self.run_dir:
            raise ValueError(f"run_dir must be a non-empty path, got {self.run_dir!r}")
        self._check_emulate()
        self._check_domains()
        self._check_plan()
        self._check_token_vocab()
        self._check_hf_config()
        self._check_memory_options()
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
        self.pipeline_degree = parse_pipeline_degree(self.pipeline_degree)
        if self.pipeline_degree == "auto":
            self.pipeline_degree = auto_pipeline_degree(self.schedule, self.batch_size)
        R = check_int("pipeline_degree", self.pipeline_degree, 1)
        if self.batch_size % R:
            raise ValueError(
                f"pipeline_degree ({R}) must divide batch_size ({self.batch_size}): "
                "--pipeline-degree R cuts each rank's batch of sequences into R equal chunks"
            )
        if R > 1 and not schedule_spec(self.schedule).pipelined:
            pipelined = schedules_where("pipelined")
            raise ValueError(
                f"pipeline_degree ({R}) needs a pipelined schedule "
                f"({', '.join(pipelined) or 'none registered'}); --schedule {self.schedule} "
                "runs the whole batch at once"
            )
        self.ar_chunk = parse_ar_chunk(self.ar_chunk)

    def _check_memory_options(self) -> None:
        # activation_checkpointing under a pipelined schedule has no effect (the schedule
        # calls the block stages, never MoEGPT.forward): option_rules refuses the flag there.
        check_one_of("dtype", self.dtype, DTYPES)
        check_bool("activation_checkpointing", self.activation_checkpointing)
        check_bool("compile", self.compile)
        check_bool("measure_peak", self.measure_peak)
        if self.activation_checkpointing and self.hf_config is not None:
            raise ValueError(
                "--activation-checkpointing applies only to moesaic's MoEGPT, not to a "
                f"transformers model (--hf-config {self.hf_config})"
            )

    def _check_hf_config(self) -> None:
        path = self.hf_config
        if path is None:
            return
        if not isinstance(path, str) or not path:
            raise ValueError(f"hf_config must be a non-empty path or None, got {path!r}")
        family = family_of(read_hf_config(path)["model_type"], f"transformers config {path}")
        if self.sharded:
            raise ValueError(
                f"--dp-shard/--dp-replicate do not apply to --hf-config ({path}) yet: FSDP2's "
                "units are an MoEGPT's blocks (train/fsdp.shard_model), and a transformers "
                "model's decoder layers are not wrapped; drop them or train an MoEGPT"
            )
        if schedule_spec(self.schedule).pipelined and family.no_pipeline is not None:
            raise ValueError(
                f"schedule {self.schedule!r} cuts the decoder layers into stages, and "
                f"{family.model_type} (--hf-config {path}) cannot be: {family.no_pipeline}; "
                "run it with --schedule vanilla"
            )
        if token_vocab_size(self.data) is None and self.model.vocab_size < 256:
            raise ValueError(
                f"the transformers config {path} has vocab_size {self.model.vocab_size}: "
                "moesaic train feeds bytes (token ids 0-255), which need vocab_size >= 256"
            )

    def _check_token_vocab(self) -> None:
        """Token shards (``data``: a ``moesaic prepare`` directory): the model's vocabulary is
        the tokenizer's when left at the bytes' 256 (a transformers config's is replaced by
        ``from_dict``); a smaller one than the tokenizer's is refused."""
        vocab = token_vocab_size(self.data)
        if vocab is None or self.model.vocab_size == vocab:
            return
        if self.hf_config is None and self.model.vocab_size == 256:
            self.model = dataclasses.replace(self.model, vocab_size=vocab)
        elif self.model.vocab_size < vocab:
            raise ValueError(
                f"the tokenizer of data {self.data} has {vocab} tokens, more than the model's "
                f"vocab_size ({self.model.vocab_size}); give vocab_size >= {vocab} or leave it out"
            )

    def _check_emulate(self) -> None:
        path = self.emulate
        if path is None:
            return
        if not isinstance(path, str) or not path:
            raise ValueError(f"emulate must be a non-empty path or None, got {path!r}")
        spec = domains.load_cluster(path, option="emulate")
        if self.nproc != spec.world_size:
            raise ValueError(
                f"nproc ({self.nproc}) must be the world size ({spec.world_size}) of the emulated "
                f"cluster {path}: one worker runs in each rank's namespace (leave --nproc out)"
            )
        if self.backend == "nccl":
            raise ValueError(
                f"backend 'nccl' cannot train on the emulated cluster {path}: its traffic would "
                "not cross the emulated links; use gloo (what 'auto' means there)"
            )
        self.backend = "gloo"
        readers = RULES["cluster"].strategies or ()
        whole_world = self.ep is None or self.ep == spec.world_size
        reads = self.model.moe.dispatcher in readers or self.plan == "auto"  # may pick hybrid
        if self.cluster is None and reads and whole_world:
            self.cluster = path  # the topology the MoE layers plan on is the one emulated

    def _check_domains(self) -> None:
        check_bool("auto_domains", self.auto_domains)
        sizes = getattr(self.model.moe.options, "domain_sizes", None)
        if self.auto_domains and sizes is not None:
            raise ValueError(f"model.moe.options.domain_sizes is both 'auto' and {list(sizes)}")
        if self.auto_domains and self.cluster is None:
            raise ValueError(
                "domain_sizes 'auto' (--domains auto) needs cluster (--cluster FILE.toml): the "
                "cost model prices the cluster's links"
            )

    def _check_plan(self) -> None:
        if self.force_plan and (self.plan is None or self.plan == "auto"):
            raise ValueError("force_plan (--force-plan) applies to a plan file (--plan FILE.json)")
        if self.plan is None:
            return
        if not isinstance(self.plan, str) or not self.plan:
            raise ValueError(f"plan must be 'auto', a JSON file or None, got {self.plan!r}")
        if self.plan != "auto":
            return
        if self.cluster is None:
            raise ValueError(
                "plan 'auto' (--plan auto) needs cluster (--cluster FILE.toml): the planner "
                "prices the cluster's links"
            )
        if self.auto_domains:
            raise ValueError(
                "plan 'auto' chooses hybrid's domain sizes itself: drop domain_sizes 'auto' "
                "(--domains auto)"
            )

    @property
    def ar_chunk_bytes(self) -> int | None:
        """Sp in bytes, or None for "auto" (tuned online)."""
        return None if self.ar_chunk == "auto" else int(self.ar_chunk)

    @property
    def sharded(self) -> bool:
        """FSDP2 sharding on (``dp_shard`` or ``dp_replicate`` given)."""
        return self.dp_shard is not None or self.dp_replicate is not None

    def mesh_shape(self, world_size: int) -> MeshShape:
        """The degrees of the training mesh for ``world_size`` ranks (sharded runs only)."""
        return MeshShape(
            dp_replicate=self.dp_replicate or 1,
            dp_shard=self.dp_shard or 1,
            ep=self._mesh_ep(world_size),
        )

    def _mesh_ep(self, world_size: int) -> int:
        """``ep``, or when not given what the world leaves: all ranks, or with sharding
        ``world_size / (dp_replicate * dp_shard)``."""
        if self.ep is not None:
            return self.ep
        if not self.sharded:
            return world_size
        dp = (self.dp_replicate or 1) * (self.dp_shard or 1)
        if world_size % dp:
            raise ValueError(
                f"dp_replicate ({self.dp_replicate or 1}) x dp_shard ({self.dp_shard or 1}) = "
                f"{dp} must divide the world size ({world_size})"
            )
        return world_size // dp

    def check_world(
        self, world_size: int, *, device: str = "cpu", ranks_per_host: int | None = None
    ) -> int:
        """Validate the EP layout for ``world_size`` ranks computing on ``device`` (a device
        type), ``ranks_per_host`` of them on each host (None: one host); returns the EP size.
        The strategy's options refuse what they cannot run there (``StrategyOptions.check_run``).
        """
        ep = self._mesh_ep(world_size)
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
        per_host = ranks_per_host or world_size
        # EP groups are consecutive ranks (train.parallel.build_layout); hosts hold
        # consecutive ranks too (torchrun's node ranks)
        ep_hosts = max(
            len({r // per_host for r in range(g, g + ep)}) for g in range(0, world_size, ep)
        )
        moe.options_as(StrategyOptions).check_run(
            ep=ep, device=device, ep_hosts=ep_hosts, kernels=moe.kernels, activation=moe.activation
        )
        if self.sharded:
            self.mesh_shape(world_size).check_world(world_size)
            check_sharding(moe.dispatcher, self.schedule)
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
        per_node |= {"hf_config"}  # a path; the loop compares the file's contents
        per_node |= {"emulate"}  # how the ranks were started, not what they compute
        per_node |= {"plan"}  # a path; what it set is compared (and "auto" below)
        out: dict[str, object] = {f"model.{k}": v for k, v in self.model.fields_flat().items()}
        # Where a trace goes is per node, whether there is one is not: gathering it is a
        # collective every rank must take part in.
        out["tracing"] = self.trace is not None or self.trace_png is not None
        out["plan_auto"] = self.plan == "auto"  # rank 0 plans, every rank takes part
        for f in dataclasses.fields(self):
            if f.name not in per_node:
                out[f.name] = getattr(self, f.name)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Build from a (possibly partial) dict like ``to_dict()``'s; unknown keys are errors.

        The model's legacy keys are nested here (``nest_legacy_keys``), once; then
        :meth:`from_nested`.
        """
        model = d.get("model", {})
        if not isinstance(model, dict):
            raise ValueError("model must be a table of MoEGPTConfig fields")
        return cls.from_nested({**d, "model": nest_legacy_keys(model)})

    @classmethod
    def from_nested(cls, d: dict[str, Any]) -> TrainConfig:
        """:meth:`from_dict` of a dict whose model table is already nested (``moesaic train``'s
        flags nest it themselves, keeping other strategies' keys to note them).

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
        model, auto = domains.split_auto_domains(model)
        if d.get("hf_config") is not None:
            # a tokenizer's vocabulary replaces the config's (token shards as data)
            model = apply_hf_shape(
                model, d["hf_config"], vocab_size=token_vocab_size(d.get("data"))
            )
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
        return cls(model=MoEGPTConfig.from_nested(model), **d)
