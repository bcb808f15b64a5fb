"""The per-worker training loop (one process per rank, started by torch's elastic agent).

``train(cfg)`` (run by :func:`moesaic.train.worker.worker_main`) reads its rank from the
environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT,
TORCHELASTIC_RESTART_COUNT), trains, validates, checkpoints and writes ``metrics.jsonl`` (rank 0). On a restart by the agent it resumes from the latest
checkpoint, so a killed worker loses only the steps after it.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moesaic.comm.agree import check_ranks_agree
from moesaic.comm.spans import gather_spans
from moesaic.comm.world import device_type_for, init_world, visible_cuda_device
from moesaic.layer import aux_loss
from moesaic.models.gpt import MoEGPT
from moesaic.schedule import make_step
from moesaic.schedule.base import GradientSync as GradSync
from moesaic.schedule.base import StatisticsFn, StepParts
from moesaic.schedule_table import schedule_spec
from moesaic.strategies import get_strategy
from moesaic.trace import (
    Recorder,
    StepFigures,
    draw_timeline,
    maybe_span,
    step_figures,
    write_chrome_trace,
)
from moesaic.train.checkpoint import Checkpointer, load_checkpoint
from moesaic.train.ckpt_choice import (
    already_has_checkpoints,
    check_resume_step,
    choose_resume_checkpoint,
    latest_checkpoint,
    resume_note,
)
from moesaic.train.config import TRACE_STEPS, TrainConfig
from moesaic.train.data import PackedData
from moesaic.train.data_source import TrainingData, check_resume_data, open_training_data
from moesaic.train.domains import check_cluster_and_domains, plan_training_domains
from moesaic.train.fsdp import ShardedGradientSync, build_mesh, reshard, shard_model
from moesaic.train.health import NonFiniteError, nonfinite_message
from moesaic.train.hf_model import build_model, run_hf_config
from moesaic.train.hooks import ModelHooks
from moesaic.train.lm_loss import lm_loss
from moesaic.train.memory import MemoryProbe
from moesaic.train.parallel import GradientSync, Layout, build_layout
from moesaic.train.plan_auto import resolve_auto_plan
from moesaic.train.report import Reporter
from moesaic.train.tokens import TokenData

# The optimizer every run uses (part of what ranks must agree on).
ADAMW_BETAS = (0.9, 0.95)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    lo = cfg.lr * cfg.min_lr_ratio
    return lo + 0.5 * (cfg.lr - lo) * (1 + math.cos(math.pi * t))


def _init_distributed(cfg: TrainConfig) -> torch.device:
    if "RANK" not in os.environ:
        return torch.device("cpu")  # a single process without torchrun
    device = torch.device("cpu")
    if device_type_for(cfg.backend) == "cuda":
        device = visible_cuda_device(int(os.environ.get("LOCAL_RANK", "0")))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return init_world(device=device, timeout_s=cfg.timeout_s)
    # The agent's store outlives a restart and torch (2.13) reuses it without a per-attempt
    # prefix: a restarted rank would read its dead peers' gloo addresses (seen as
    # "connectFullMesh ... Connection refused"). Namespace the keys by attempt ourselves.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world_size = int(os.environ["WORLD_SIZE"])
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )
    return init_world(
        device=device,
        timeout_s=cfg.timeout_s,
        store=dist.PrefixStore(f"/moesaic/attempt_{attempt}", agent_store),
        rank=int(os.environ["RANK"]),
        world_size=world_size,
    )


def _make_optimizer(model: MoEGPT, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    return make_adamw(groups, lr=cfg.lr, device=next(model.parameters()).device)


def adamw_kernel(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation for ``device``: the fused kernel on a GPU (one launch for all
    parameters and no host read of the step count), the multi-tensor ``foreach`` one elsewhere
    (the per-parameter loop it replaces launched ~10 small kernels per parameter)."""
    if device.type == "cuda":
        return {"fused": True}
    return {"foreach": True}


def make_adamw(
    params: torch.optim.optimizer.ParamsT, *, lr: float, device: torch.device
) -> torch.optim.AdamW:
    """The run's AdamW (``adamw_kernel``). The fused kernel writes the parameters without
    bumping their version counters, by which hybrid's gathered copies and prefetch know that
    the weights changed (``HybridStrategy._key``): a step post-hook, registered before any
    other (the prefetcher's runs after it), bumps them."""
    kernel = adamw_kernel(device)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=ADAMW_BETAS, **kernel)
    if kernel.get("fused"):
        optimizer.register_step_post_hook(_bump_versions)
    return optimizer


def _bump_versions(optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
    from torch.autograd.graph import increment_version

    increment_version([p for group in optimizer.param_groups for p in group["params"]])


def check_config_agrees(
    cfg: TrainConfig, layout: Layout, data: tuple[int, int], cluster: dict | None = None
) -> None:
    """Refuse to go on unless every rank runs the same configuration (a collective).

    Compares ``cfg.agreement_fields()`` (the model, MoE fields included, the optimizer
    settings, the schedule, ...), the default dtype, the optimizer and the data (train and
    validation window counts): a rank with other ``num_experts`` would make gloo abort, one with
    another ``lr`` would train silently differently. Raises ``RankMismatchError`` (a
    ``ValueError``) naming the first field that differs and the ranks on each side.
    """
    fields = cfg.agreement_fields()
    fields["default_dtype"] = torch.get_default_dtype()
    fields["optimizer"] = f"AdamW(betas={ADAMW_BETAS})"  # its kernel follows the device
    fields["world_size"] = layout.world_size
    fields["data_windows"] = data
    fields["cluster"] = cluster  # its contents (the path may differ between nodes)
    fields["hf_config"] = None if cfg.hf_config is None else run_hf_config(cfg)
    check_ranks_agree(fields, timeout_s=cfg.timeout_s, what="training config")


@torch.no_grad()
def evaluate(
    model: MoEGPT, val: PackedData | TokenData, cfg: TrainConfig, layout: Layout, device
) -> float:
    """Mean validation loss over all ranks' fixed validation batches."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(cfg.eval_batches):
        x_BT, y_BT = val.val_batch(i, layout.rank, layout.world_size, cfg.batch_size)
        ce = lm_loss(model(to_device(x_BT, device)), to_device(y_BT, device))
        _drain_layer_state(model)
        total += torch.stack([ce.double(), torch.ones((), dtype=torch.float64, device=device)])
    reshard(model)  # FSDP2's root stays gathered after a forward no backward follows
    model.train()
    layout.world.all_reduce(total, what="all_reduce of the validation loss")
    return float(total[0] / total[1])


def _drain_layer_state(model: MoEGPT) -> None:
    """Read and drop the MoE layers' per-forward state (aux loss, statistics) of forwards that
    are not training steps (validation): it adds up until read, and would count in the next."""
    aux_loss(model)
    for _, layer in model.moe_layers():
        layer.take_stats()


def _step_statistics(model: MoEGPT, device) -> StatisticsFn:
    """The loop's figures of a step for ``StepParts.statistics``: ``[ce, aux]`` then each MoE
    layer's expert load (summed over every forward of the step: ``take_stats`` adds up all
    chunks of a pipelined step), then the assignments before drops (``routed_E``) of the
    layers with a score bias, for ``update_score_bias`` (in layer order); the step sums them
    over every rank with its health flags, in one collective (``TrainStep.step_sums``)."""
    E = model.config.moe.num_experts

    def pack(ce: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        counts, routed = [], []
        for _, layer in model.moe_layers():
            stats = layer.take_stats()
            zeros_E = torch.zeros(E, dtype=torch.float64, device=device)
            counts.append(zeros_E if stats.counts_E is None else stats.counts_E.to(device).double())
            if layer.router.score_bias is not None:
                routed_E = stats.routed_E
                routed.append(zeros_E if routed_E is None else routed_E.to(device).double())
        head = torch.stack([ce.detach().double(), aux.detach().double()]).to(device)
        return torch.cat([head, *counts, *routed])

    return pack


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host batch on ``device`` without a host sync: to a GPU through pinned memory, copied
    asynchronously (a pageable copy waits for the device: two syncs a training step, the
    inputs and the targets, on an H200, ``benchmarks/results/gpu_train_step_h200.json``). The
    pinned buffer's reuse waits for the copy (torch's caching host allocator records it)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _step_stats(
    model: MoEGPT, statistics: list[float], layout: Layout, device
) -> tuple[float, float, list, list[torch.Tensor]]:
    """Mean loss and aux loss over all ranks, each MoE layer's global expert load and the
    score-biased layers' global assignments before drops, from the step's summed
    ``_step_statistics`` (read on the host with its health flags: no collective here)."""
    E = model.config.moe.num_experts
    L = len(list(model.moe_layers()))
    W = layout.world_size
    loads = [[int(v) for v in statistics[2 + i * E : 2 + (i + 1) * E]] for i in range(L)]
    rest = statistics[2 + L * E :]
    routed_loads = [
        torch.tensor(rest[i : i + E], dtype=torch.float64, device=device)
        for i in range(0, len(rest), E)
    ]
    return statistics[0] / W, statistics[1] / W, loads, routed_loads


def _update_score_biases(model: MoEGPT, routed_loads: list[torch.Tensor]) -> None:
    """Auxiliary-loss-free balancing after an applied optimizer step: each layer with a score
    bias moves it by the step's global load (the same numbers on every rank)."""
    biased = [layer for _, layer in model.moe_layers() if layer.router.score_bias is not None]
    for layer, load_E in zip(biased, routed_loads, strict=True):
        layer.update_score_bias(load_E)


def _check_biases_agree(model: MoEGPT, cfg: TrainConfig) -> None:
    """Before a checkpoint: every rank holds the same score biases (they are saved once)."""
    biases = {
        f"{name}.router.score_bias": layer.router.score_bias.tolist()
        for name, layer in model.moe_layers()
        if layer.router.score_bias is not None
    }
    if biases:
        check_ranks_agree(biases, timeout_s=cfg.timeout_s, what="routers' score biases")


def resolve_auto_domains(cfg: TrainConfig, spec, layout: Layout, device) -> TrainConfig:
    """``--domains auto``: ``cfg`` with the domain sizes of the cost model (a collective), for a
    strategy that has them (``domain_sizes`` among its options: ``hybrid``).

    Rank 0 measures its GEMM throughput (with this worker's threads) and every rank takes rank
    0's number (an all-gather), so all of them compute the same plan; rank 0 logs it.
    """
    moe = cfg.model.moe
    options = moe.options_as(get_strategy(moe.dispatcher).options_class)
    if not cfg.auto_domains or "domain_sizes" not in options.names():
        return cfg
    if layout.rank == 0:
        from moesaic.sim.hybrid_costmodel import measure_gemm_flops

        flops = measure_gemm_flops()
    else:
        flops = 0.0
    mine = torch.tensor([[flops]], dtype=torch.float64, device=device)
    flops = float(layout.world.all_gather_dim0(mine, "all_gather of the measured FLOP/s")[0, 0])
    plan = plan_training_domains(
        cfg.model,
        spec,
        batch_size=cfg.batch_size,
        pipeline_degree=int(cfg.pipeline_degree),
        flops_per_s=flops,
    )
    if layout.rank == 0:
        print(
            f"moesaic train: --domains auto on {spec.name} at {flops / 1e9:.3g} GFLOP/s "
            f"(rank 0, measured): {plan.reason}",
            file=sys.stderr,
            flush=True,
        )
    sizes = plan.chosen.domain_sizes
    options = dataclasses.replace(options, **{"domain_sizes": sizes})  # checked: it has them
    model = dataclasses.replace(cfg.model, moe=dataclasses.replace(moe, options=options))
    return dataclasses.replace(cfg, model=model, auto_domains=False)


def _maybe_resume(cfg, model, optimizer, layout, data: TrainingData) -> tuple[int, int, str | None]:
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    path = latest_checkpoint(cfg.run_dir)
    if path is not None and not (cfg.resume or restarted):
        raise ValueError(already_has_checkpoints(cfg.run_dir, path))
    if path is None:
        if cfg.resume:
            raise ValueError(f"--resume: no checkpoint in {cfg.run_dir}/checkpoints")
        return 0, 0, None  # a fresh run, or a restart before the first checkpoint
    device = next(model.parameters()).device

    # A damaged newest checkpoint: back to the newest intact one (every rank agrees), said once.
    def same_data(path: Path, meta: dict) -> None:  # before shapes: a tokenizer's vocab is one
        check_resume_data(path, meta, data.identity, str(cfg.data))

    chosen = choose_resume_checkpoint(cfg.run_dir, cfg.model, layout, device, same_data)
    if chosen is None:  # removed since latest_checkpoint above
        raise ValueError(f"--resume: no checkpoint in {cfg.run_dir}/checkpoints")
    path, meta, damage = chosen
    note = resume_note(path, damage)
    if note is not None and layout.rank == 0:
        print(f"moesaic train: {note}", file=sys.stderr, flush=True)
    check_resume_step(path, meta, cfg.steps)
    step, consumed = load_checkpoint(path, model=model, optimizer=optimizer, rank=layout.rank)
    return step, consumed, str(path)


def _shard(cfg: TrainConfig, model: torch.nn.Module, layout: Layout, device) -> GradSync:
    """With ``--dp-shard``/``--dp-replicate``: build the training mesh, shard ``model`` in
    place with FSDP2 (``train/fsdp.py``) and return its gradient rules; else the EP x DP
    rules of ``layout``."""
    if not cfg.sharded:
        return GradientSync(layout)
    mesh = build_mesh(cfg.mesh_shape(layout.world_size), device.type, cfg.timeout_s)
    bf16 = cfg.dtype == "bf16"
    if bf16 and isinstance(model, MoEGPT):  # FSDP2's mixed precision replaces autocast
        model.set_autocast(None)
    prefetch = not schedule_spec(cfg.schedule).pipelined  # (shard_model's docstring)
    shard_model(model, mesh, torch.bfloat16 if bf16 else None, prefetch=prefetch)
    return ShardedGradientSync(mesh, layout.world)


def train(cfg: TrainConfig) -> dict:
    """Train on this rank; returns rank 0's summary (other ranks: an empty dict)."""
    device = _init_distributed(cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    ranks_per_host = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    ep_size = cfg.check_world(world, device=device.type, ranks_per_host=ranks_per_host)
    threads = cfg.threads or max(
        1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    )
    torch.set_num_threads(threads)
    layout = build_layout(ep_size, cfg.timeout_s)
    # bytes of text, or the token shards of `moesaic prepare` (memory-mapped)
    data = open_training_data(cfg.data, cfg.data_max_bytes, cfg.val_fraction, cfg.model.seq_len)
    train_data, val_data = data.train, data.val
    spec = check_cluster_and_domains(cfg.cluster, cfg.model.moe, ep_size)
    # Before any collective depends on it (a model with another num_experts aborts gloo).
    windows = (train_data.num_windows, val_data.num_windows)
    check_config_agrees(cfg, layout, windows, None if spec is None else spec.to_dict())
    cfg = resolve_auto_plan(cfg, layout, device)  # --plan auto: rank 0's pick, on every rank
    cfg = resolve_auto_domains(cfg, spec, layout, device)
    torch.manual_seed(cfg.seed)  # alike on every rank: replicated weights agree
    # cfg.model.moe.collective_timeout_s is cfg.timeout_s (TrainConfig sets it).
    model = build_model(cfg, layout.ep_group, spec).to(device)  # MoEGPT, or --hf-config's
    model.set_autocast(torch.bfloat16 if cfg.dtype == "bf16" else None)
    if isinstance(model, MoEGPT):  # TrainConfig refuses it for a transformers model
        model.activation_checkpointing = cfg.activation_checkpointing
    if cfg.compile:
        model.compile_dense()
    grad_sync = _shard(cfg, model, layout, device)  # --dp-shard / --dp-replicate: FSDP2
    optimizer = _make_optimizer(model, cfg)
    probe = MemoryProbe(model, optimizer, device=device, count_cpu=cfg.measure_peak)
    tracing = cfg.trace is not None or cfg.trace_png is not None
    recorder = Recorder(rank=layout.rank) if tracing else None
    parts = StepParts(
        model=model,
        loss_fn=lm_loss,
        grad_sync=grad_sync,
        optimizer=optimizer,
        grad_clip=cfg.grad_clip,
        pipeline_degree=int(cfg.pipeline_degree),  # "auto" is resolved by TrainConfig
        ar_chunk_bytes=cfg.ar_chunk_bytes,
        recorder=recorder,
        statistics=_step_statistics(model, device),
    )
    train_step = make_step(cfg.schedule, parts)
    # The strategies' hooks (hybrid: the next step's expert gathers start right after each
    # optimizer step); they do nothing for the others.
    hooks = ModelHooks(model, recorder=recorder).attach(optimizer)
    start, consumed, resumed_from = _maybe_resume(cfg, model, optimizer, layout, data)
    reporter = Reporter(cfg, layout, start, resumed_from)
    meta = {"model": cfg.model.to_dict(), "train": cfg.to_dict(), "world_size": world}
    meta["ep_size"] = ep_size
    meta.update(data.checkpoint_meta())  # the data's identity, the tokenizer of token shards
    if cfg.hf_config is not None:  # the file's contents (the run's vocabulary): rebuilds it
        meta["hf_config"] = run_hf_config(cfg)
    saver = Checkpointer(
        cfg.run_dir,
        layout=layout,
        meta=meta,
        keep=cfg.keep_checkpoints,
        asynchronous=cfg.async_checkpoint,
        timeout_s=cfg.timeout_s,
    )
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    tokens_per_step = world * cfg.batch_size * cfg.model.seq_len
    skipped_in_a_row = 0
    for step in range(start + 1, cfg.steps + 1):
        if (
            step == cfg.fault_kill_step
            and layout.rank == cfg.fault_kill_rank
            and restart_count == 0
        ):
            print(
                f"[fault injection] rank {layout.rank} kills itself at step {step}",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        lr = lr_at(cfg, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x_BT, y_BT = train_data.train_batch(consumed, layout.rank, cfg.batch_size, cfg.seed)
        if recorder is not None and step <= cfg.steps - TRACE_STEPS + 1:
            recorder.clear()  # keep the last TRACE_STEPS steps only
        with maybe_span(recorder, "step", f"step{step}", step=step):
            result = train_step.run(to_device(x_BT, device), to_device(y_BT, device))
        consumed += world * cfg.batch_size
        loss, aux_val, loads, routed_loads = _step_stats(model, result.statistics, layout, device)
        if result.applied:
            _update_score_biases(model, routed_loads)
        dt = time.perf_counter() - t0
        reporter.train_step(
            step,
            loss,
            aux_val,
            lr,
            result.grad_norm,
            tokens_per_step / dt,
            loads,
            nonfinite=result.nonfinite,
        )
        if step == min(start + 2, cfg.steps):  # state bytes, the second step's peak
            reporter.memory(step, probe.gather(layout.world))
        if result.applied:
            skipped_in_a_row = 0
        else:  # nothing was applied, on any rank (they agreed): the weights are still finite
            skipped_in_a_row += 1
            if cfg.on_nonfinite == "stop":
                raise NonFiniteError(nonfinite_message(step, result.nonfinite))
            if skipped_in_a_row >= cfg.nonfinite_skip_limit:
                raise NonFiniteError(
                    nonfinite_message(step, result.nonfinite, skipped_in_a_row=skipped_in_a_row)
                )
        last = step == cfg.steps and cfg.save_final
        if last or (cfg.eval_every and step % cfg.eval_every == 0):
            hooks.before_evaluation()
            val_loss = evaluate(model, val_data, cfg, layout, device)
            reporter.validation(step, val_loss, data.bits_per_byte(val_loss))
        if last or (cfg.ckpt_every and step % cfg.ckpt_every == 0):
            _check_biases_agree(model, cfg)
            for saved, path in saver.save(model, optimizer, step=step, consumed=consumed):
                reporter.checkpoint(saved, path)
    for saved, path in saver.finish():  # an asynchronous save still in flight
        reporter.checkpoint(saved, path)
    saver.close()
    hooks.close()
    if recorder is not None:
        _write_trace(cfg, layout, recorder, start)
    summary = reporter.finish()
    if dist.is_initialized():
        # Tear the group down on every rank together, before the interpreter exits with gloo's
        # threads still running (one rank of a finished torchrun job aborted so, once in CI:
        # "terminate called without an active exception", SIGABRT after its summary).
        layout.world.barrier("barrier before the process group's teardown")
        dist.destroy_process_group()
    return summary


def _write_trace(cfg: TrainConfig, layout: Layout, recorder: Recorder, start: int) -> None:
    """Gather every rank's spans of the last ``TRACE_STEPS`` steps; rank 0 writes the files."""
    spans_per_rank = gather_spans(layout.world, recorder.events)
    if layout.rank != 0:
        return
    first = max(start + 1, cfg.steps - TRACE_STEPS + 1)
    title = (
        f"moesaic train --schedule {cfg.schedule} --pipeline-degree {cfg.pipeline_degree}: "
        f"steps {first}-{cfg.steps}, {layout.world_size} ranks"
    )
    written = []
    if cfg.trace is not None:
        written.append(str(write_chrome_trace(cfg.trace, spans_per_rank)))
    if cfg.trace_png is not None:
        written.append(str(draw_timeline(cfg.trace_png, spans_per_rank, title=title)))
    lines = [
        f"moesaic train: timeline of steps {first}-{cfg.steps} written to {', '.join(written)}"
    ]
    by_step: dict[str, list[StepFigures]] = {}
    for fig in step_figures([s for spans in spans_per_rank for s in spans]):
        by_step.setdefault(fig.name, []).append(fig)
    for name, figs in by_step.items():  # the slowest rank of each step
        f = max(figs, key=lambda f: f.time_s)
        lines.append(
            f"  {name}: {f.time_s * 1e3:.1f} ms on rank {f.rank}; busy compute "
            f"{f.compute_s * 1e3:.1f} ms, communication {f.comm_s * 1e3:.1f} ms; "
            f"{f.ratio:.2f}x the overlap bound"
        )
    print("\n".join(lines), file=sys.stderr, flush=True)
