"""torchtitan side of the moesaic-vs-torchtitan whole-training-step race (one device).

Measures one full training step of torchtitan 0.2.2 (the release that runs on the device
machine's torch 2.11; 0.3.0 needs a newer torch: ``DataParallelMeshDims``) on a Qwen3-MoE model
built from a transformers ``Qwen3MoeConfig`` dict: forward on random token ids, loss, backward,
grad-norm clip, optimizer step, LR scheduler step. Reports tokens/s (median of host-timed,
device-synced steps), a streamed figure (all timed steps back to back, one sync), peak memory,
parameter counts, torchtitan's own FLOPs/token and MFU.

What is followed from torchtitan 0.2.2, and where:

* Model: ``torchtitan.models.qwen3.Qwen3Model(Qwen3ModelArgs)`` with the fields its
  ``qwen3_args["30B-A3B"]`` flavour sets (qk-norm, ``MoEArgs``: softmax router, ``route_norm``
  from ``norm_topk_prob``, no shared experts, ``score_before_experts=False``,
  ``load_balance_coeff=1e-3``, grouped GEMMs), the sizes from the HF config; SDPA causal
  attention (the flavour's default ``attn_type``).
* Build/init: ``torchtitan/train.py::Trainer.__init__``: ``update_from_config``, build on the meta
  device in fp32, ``parallelize_qwen3``, ``to_empty``, ``init_weights``, ``train()``.
* Parallelize: ``models/qwen3/infra/parallelize.py::parallelize_qwen3`` with a world of one:
  activation checkpointing as ``ac`` says (the trainer's default is selective; "none" here, as the
  moesaic run), then per-block ``torch.compile`` (``apply_compile``); no FSDP at one rank.
* Mixed precision: ``distributed/utils.py::maybe_enable_amp``: without FSDP, bf16
  ``torch.autocast`` around forward and loss (fp32 master weights), what moesaic's ``--dtype
  bf16`` does too.
* Loss: ``build_cross_entropy_loss`` (sum; compiled when ``compile`` is on, its default
  components ``["model", "loss"]``), divided by the valid tokens as ``forward_backward_step``.
* Step: ``Trainer.train_step``: ``zero_grad``, forward, loss, backward,
  ``dist_utils.clip_grad_norm_`` (``max_norm=1.0``, foreach), ``optimizers.step()``
  (``build_optimizers``: AdamW lr 8e-4, eps 1e-8, wd 0.1, fused on CUDA),
  ``lr_schedulers.step()``. The qwen3 train spec registers no MoE load-balancing hook.
* Not reproduced: dataloading, metrics, checkpointing, GC control.
* FLOPs: ``Qwen3ModelArgs.get_nparams_and_flops`` ->
  ``torchtitan/models/utils.py::get_moe_model_nparams_and_flops``.

torchtitan is imported only inside functions. Its package imports ``datasets`` (carried to the
device machine as wheels with ``dill`` and ``multiprocess``: ``benchmarks/gpu_wheels.sh``).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

_MODEL_FLAVOUR_NOTE = "torchtitan 0.2.2 Qwen3Model, the 30B-A3B flavour's fields, HF sizes"


def titan_available() -> str | None:
    """Return None when the torchtitan modules used here import, else the reason."""
    try:
        import torchtitan.components.loss
        import torchtitan.components.lr_scheduler
        import torchtitan.components.optimizer
        import torchtitan.distributed.utils
        import torchtitan.models.qwen3  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _moe_layer(hf: dict[str, Any], i: int) -> bool:
    """HF Qwen3MoeDecoderLayer rule for whether layer ``i`` is sparse."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    return (
        i not in set(hf.get("mlp_only_layers", []) or [])
        and int(hf["num_experts"]) > 0
        and (i + 1) % step == 0
    )


def _check_hf(hf: dict[str, Any]) -> list[str]:
    """Refuse fields that would make the torchtitan model materially different."""
    notes: list[str] = []
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r}: torchtitan experts are SwiGLU/silu")
    if hf.get("attention_bias", False):
        raise ValueError("attention_bias=True: torchtitan qwen3 attention has no biases")
    if hf.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=True: not supported by torchtitan qwen3")
    if hf.get("rope_scaling"):
        raise ValueError(f"rope_scaling={hf['rope_scaling']!r}: torchtitan qwen3 has plain RoPE")
    if int(hf.get("shared_expert_intermediate_size", 0) or 0) > 0:
        raise ValueError("shared_expert_intermediate_size: Qwen3-MoE has no shared experts")
    if int(hf.get("num_experts", 0) or 0) <= 0:
        raise ValueError("num_experts: must be > 0 for a MoE race")
    if not any(_moe_layer(hf, i) for i in range(int(hf["num_hidden_layers"]))):
        raise ValueError("mlp_only_layers/decoder_sparse_step: leave no MoE layer")
    notes.append(
        "router_aux_loss_coef="
        f"{hf.get('router_aux_loss_coef')} not mapped: torchtitan qwen3 MoE uses no aux loss "
        "(its expert bias, load_balance_coeff=1e-3, has no update hook in the qwen3 train spec)"
    )
    return notes


def _model_args(hf: dict[str, Any], seq_len: int) -> tuple[Any, list[str]]:
    """Map an HF Qwen3-MoE config onto torchtitan 0.2.2's ``Qwen3ModelArgs``."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    notes = _check_hf(hf)
    n_layers = int(hf["num_hidden_layers"])
    if not all(_moe_layer(hf, i) for i in range(n_layers)):
        raise ValueError(
            "mlp_only_layers/decoder_sparse_step: torchtitan 0.2.2's qwen3 makes every layer MoE"
        )
    dim = int(hf["hidden_size"])
    n_heads = int(hf["num_attention_heads"])
    max_pos = int(hf.get("max_position_embeddings", seq_len))
    if seq_len > max_pos:
        raise ValueError(f"max_position_embeddings={max_pos} < seq_len={seq_len}")
    args = Qwen3ModelArgs(
        vocab_size=int(hf["vocab_size"]),
        max_seq_len=max_pos,
        head_dim=int(hf.get("head_dim") or dim // n_heads),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        qk_norm=True,
        hidden_dim=int(hf["intermediate_size"]),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta", 1e6)),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        moe_enabled=True,
        moe_inter_dim=int(hf["moe_intermediate_size"]),
        moe_args=MoEArgs(
            num_experts=int(hf["num_experts"]),
            num_shared_experts=0,
            top_k=int(hf["num_experts_per_tok"]),
            score_func="softmax",
            route_norm=bool(hf.get("norm_topk_prob", True)),
            route_scale=1.0,
            score_before_experts=False,
        ),
    )
    notes.append("SDPA causal attention, fused grouped-GEMM experts, qk-norm, RoPE from HF")
    return args, notes


def titan_train_step_bench(
    hf_config: dict,
    *,
    batch_size: int,
    seq_len: int,
    steps: int,
    warmup: int,
    device: torch.device,
    compile: bool,
    seed: int = 0,
    peak_tflops: float | None = None,
    ac: str = "none",
    extra_steps: int = 0,
) -> dict:
    """Time torchtitan's training step on ``hf_config``; see the module docstring."""
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3

    device = torch.device(device)
    args, notes = _model_args(hf_config, seq_len)
    notes.insert(0, _MODEL_FLAVOUR_NOTE)
    job = JobConfig()
    job.training.local_batch_size = batch_size
    job.training.seq_len = seq_len
    job.training.steps = warmup + 2 * steps + extra_steps
    job.compile.enable = compile
    job.activation_checkpoint.mode = ac
    if device.type != "cuda":
        job.optimizer.implementation = "foreach"
        notes.append("optimizer implementation foreach on CPU (the default fused is CUDA)")
    args.update_from_config(job)
    parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1
    )

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Qwen3Model(args)
    num_params, flops_per_token = args.get_nparams_and_flops(model, seq_len)
    model = parallelize_qwen3(model, parallel_dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = build_cross_entropy_loss(job)
    optimizers = build_optimizers([model], job.optimizer, parallel_dims)
    lr_schedulers = build_lr_schedulers(optimizers, job.lr_scheduler, job.training.steps)
    amp = dist_utils.maybe_enable_amp(
        parallel_dims, job.training.mixed_precision_param, device.type
    )
    train_context = dist_utils.get_train_context(False)

    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (batch_size, seq_len + 1), generator=gen)
    inputs = tokens[:, :-1].contiguous().to(device)
    labels = tokens[:, 1:].contiguous().to(device)
    params = list(model.parameters())

    def step() -> torch.Tensor:
        optimizers.zero_grad()
        valid = torch.tensor(labels.numel(), device=device).float()
        with train_context():
            with amp:
                pred = model(inputs)
                loss = loss_fn(pred, labels) / valid
            del pred
            loss.backward()
        dist_utils.clip_grad_norm_(params, job.training.max_norm, foreach=True)
        optimizers.step()
        lr_schedulers.step()
        return loss.detach()

    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    losses: list[float] = []
    for _ in range(warmup):
        losses.append(float(step()))
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times: list[float] = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    stream_s = time.perf_counter() - t0
    losses.append(float(loss))
    for _ in range(extra_steps):  # untimed, for a caller's hooks (gpu_train_step's profile)
        loss = step()
    sync()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None

    ntok = batch_size * seq_len
    med = statistics.median(times)
    tps = ntok / med
    moe = args.moe_args
    # Active params the way get_moe_model_nparams_and_flops counts them (all router +
    # top_k/num_experts of routed experts + everything dense, embeddings included).
    n_exp_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = num_params - n_exp_params + n_exp_params * moe.top_k // moe.num_experts
    return {
        "tokens_per_s": tps,
        "step_ms_median": med * 1e3,
        "step_ms_min": min(times) * 1e3,
        "step_ms_max": max(times) * 1e3,
        "stream_tokens_per_s": ntok * steps / stream_s,
        "losses": [losses[0], losses[-1]],
        "losses_finite": all(math.isfinite(x) for x in losses),
        "peak_memory_gib": peak,
        "num_params": num_params,
        "active_params_per_token": active,
        "flops_per_token": flops_per_token,
        "flops_formula": "torchtitan.models.utils.get_moe_model_nparams_and_flops "
        "(6*matmul_active_params + 6*n_layers*n_heads*2*head_dim*seq_len)",
        "mfu": (flops_per_token * tps / (peak_tflops * 1e12)) if peak_tflops else None,
        "compile": compile,
        "precision": "autocast bf16 (maybe_enable_amp at one rank)",
        "ac": ac,
        "notes": notes,
    }
