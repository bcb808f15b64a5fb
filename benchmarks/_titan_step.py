"""torchtitan side of the moesaic-vs-torchtitan whole-training-step race (one device).

Measures one full training step of torchtitan (0.3.0) on a Qwen3-MoE model built from a
transformers ``Qwen3MoeConfig`` dict: forward on random token ids, loss, backward, grad-norm
clip, optimizer step, zero_grad. Reports tokens/s (median of host-timed, device-synced steps),
a streamed figure (all timed steps back to back, one sync), peak memory, parameter counts,
torchtitan's own FLOPs/token and MFU.

What is followed from torchtitan, and where:

* Model: ``torchtitan.models.qwen3.Qwen3Model`` / ``Qwen3TransformerBlock`` built from configs
  assembled exactly as ``torchtitan/models/qwen3/__init__.py::_build_qwen3_moe_layers`` does
  (fused QKV, qk-norm, softmax router with ``route_norm``, GroupedExperts via
  ``torch._grouped_mm``, ``make_moe_config`` default ``load_balance_coeff=1e-3``, i.e.
  aux-loss-free expert-bias balancing, the registry's init functions), FlexAttention backend
  (``model_registry`` default ``attn_backend="flex"``) with block-causal masks from positions.
* Build/init: ``torchtitan/trainer.py::Trainer.__init__``: build on the meta device in fp32
  (``training.dtype="float32"``), ``parallelize_fn``, ``to_empty``, ``init_weights``, ``train()``.
* Parallelize: ``torchtitan/models/qwen3/parallelize.py::parallelize_qwen3`` with a world of 1.
  In torchtitan 0.3.0 there is no ``torch.autocast`` in the trainer: mixed precision on one GPU
  comes from FSDP2 ``fully_shard`` on a 1-rank mesh with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
  (``torchtitan/distributed/fsdp.py::apply_fsdp_to_decoder``). That is what
  ``precision="fsdp"`` (default) does, via ``parallelize_qwen3`` itself (a 1-rank process group
  is created if none exists). ``precision="autocast"`` is an alternative (no FSDP wrapper, bf16
  autocast around forward+loss) for comparison only; it is not what the trainer does.
* Compile: ``torchtitan/distributed/compile.py::apply_compile`` (per-TransformerBlock
  ``torch.compile(fullgraph=True)``, ``capture_scalar_outputs=True``), reached through
  ``parallelize_qwen3``; the loss is compiled as ``CompileConfig.components`` defaults to
  ``["model", "loss"]`` (``BaseLoss._maybe_compile``).
* Loss: ``ChunkedLossWrapper(CrossEntropyLoss)`` (8 chunks, sum / valid tokens) with the model's
  ``_skip_lm_head`` set, as every qwen3 entry in ``config_registry.py`` and
  ``Trainer.__init__``.
* Step: ``Trainer.train_step`` / ``_forward_backward_body``: ``zero_grad``, masks from positions
  (``post_dataloading_process``), forward, loss, backward, ``dist_utils.clip_grad_norm_``
  (``training.max_norm=1.0``, foreach), ``optimizers.step()`` (``default_adamw``: AdamW, lr 8e-4,
  betas (0.9, 0.95), eps 1e-8, wd 0.1, ``implementation="fused"``) whose pre-hook is
  ``register_moe_load_balancing_hook`` (expert-bias update), then ``lr_schedulers.step()``.
* Not reproduced: the trainer's CUDA-graph wrapping of forward+backward
  (``training.disable_cuda_graphs=False`` by default; MoE dispatch syncs with the host and the
  MoE registry entries that matter turn it off), activation checkpointing (trainer default
  ``SelectiveAC``; here ``ac="none"`` by default, ``"selective"``/``"full"`` available),
  dataloading, metrics, checkpointing, GC control.
* FLOPs: ``Qwen3Model.Config.get_nparams_and_flops`` ->
  ``torchtitan/models/utils.py::get_moe_model_nparams_and_flops``.

torchtitan is imported only inside functions. It needs ``spmd_types``, ``tyro`` (+
``docstring_parser``, ``typeguard``) at import time for the modules used here.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

_MODEL_FLAVOUR_NOTE = "torchtitan 0.3.0 qwen3 MoE layers as built by model_registry"


def titan_available() -> str | None:
    """Return None when the torchtitan modules used here import, else the reason."""
    try:
        import torchtitan.components.loss
        import torchtitan.components.optimizer
        import torchtitan.distributed.compile
        import torchtitan.models.qwen3
        import torchtitan.models.qwen3.parallelize  # noqa: F401
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
        f"{hf.get('router_aux_loss_coef')} not mapped: torchtitan qwen3 MoE uses no aux loss; "
        "it balances with its aux-loss-free expert bias (load_balance_coeff=1e-3, updated by "
        "register_moe_load_balancing_hook before each optimizer step)"
    )
    return notes


def _build_model_config(
    hf: dict[str, Any], seq_len: int, attn_backend: str
) -> tuple[Any, list[str]]:
    """Map an HF Qwen3-MoE config onto torchtitan's ``Qwen3Model.Config``."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import (
        get_attention_config,
        make_ffn_config,
        make_gqa_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _EMBEDDING_SKIP_INIT,
        _LINEAR_INIT,
        _NORM_INIT,
        _moe_experts_init,
        _residual_output_init,
    )
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    notes = _check_hf(hf)
    dim = int(hf["hidden_size"])
    n_layers = int(hf["num_hidden_layers"])
    n_heads = int(hf["num_attention_heads"])
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or dim // n_heads)
    vocab = int(hf["vocab_size"])
    eps = float(hf.get("rms_norm_eps", 1e-6))
    theta = float(hf.get("rope_theta", 1e6))
    tied = bool(hf.get("tie_word_embeddings", False))
    n_exp = int(hf["num_experts"])
    top_k = int(hf["num_experts_per_tok"])
    max_pos = int(hf.get("max_position_embeddings", seq_len))
    if seq_len > max_pos:
        raise ValueError(f"max_position_embeddings={max_pos} < seq_len={seq_len}")
    if eps != 1e-6:
        notes.append(f"rms_norm_eps={eps} used (torchtitan registry hard-codes 1e-6)")

    def norm(d: int) -> Any:
        return RMSNorm.Config(normalized_shape=d, eps=eps, param_init=_NORM_INIT)

    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=max_pos, theta=theta)
    if attn_backend == "sdpa":
        # get_attention_config refuses "sdpa" for LMs (it cannot take per-document masks);
        # with one document per row block-causal == causal, so the class itself is exact.
        # Used for CPU runs: FlexAttention has no CPU backward.
        inner_attention: Any = ScaledDotProductAttention.Config()
        notes.append("attention: torchtitan ScaledDotProductAttention (causal), not flex")
    else:
        inner_attention = get_attention_config(attn_backend)
        notes.append(f"attention: torchtitan {attn_backend!r} backend, block-causal masks")
    output_init = _residual_output_init(n_layers)
    layers = []
    n_dense = 0
    for i in range(n_layers):
        attention = make_gqa_config(
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            wqkv_param_init=_LINEAR_INIT,
            wo_param_init=output_init,
            inner_attention=inner_attention,
            fuse_qkv=True,
            rope=rope,
            qk_norm=norm(head_dim),
        )
        if _moe_layer(hf, i):
            ffn_kwargs: dict[str, Any] = {
                "moe": make_moe_config(
                    num_experts=n_exp,
                    router=make_router_config(
                        dim=dim,
                        num_experts=n_exp,
                        gate_param_init=_LINEAR_INIT,
                        top_k=top_k,
                        score_func="softmax",
                        route_norm=bool(hf.get("norm_topk_prob", True)),
                    ),
                    routed_experts=make_routed_experts_config(
                        dim=dim,
                        hidden_dim=int(hf["moe_intermediate_size"]),
                        num_experts=n_exp,
                        top_k=top_k,
                        param_init=_moe_experts_init(n_layers),
                        comm_backend="standard",
                    ),
                )
            }
        else:
            n_dense += 1
            ffn_kwargs = {
                "feed_forward": make_ffn_config(
                    dim=dim,
                    hidden_dim=int(hf["intermediate_size"]),
                    w1_param_init=_LINEAR_INIT,
                    w2w3_param_init=_LINEAR_INIT,
                )
            }
        layers.append(
            Qwen3TransformerBlock.Config(
                attention_norm=norm(dim), ffn_norm=norm(dim), attention=attention, **ffn_kwargs
            )
        )
    if n_dense:
        notes.append(
            f"{n_dense} dense layer(s) from mlp_only_layers/decoder_sparse_step built as "
            "torchtitan FeedForward (SwiGLU, hidden=intermediate_size, init as the registry's "
            "dense qwen3 layers); torchtitan's own MoE registry makes every layer MoE"
        )
    if not bool(hf.get("norm_topk_prob", True)):
        notes.append("norm_topk_prob=False -> router route_norm=False")
    notes.append(
        "fused QKV, qk-norm, softmax top-k router, GroupedExperts (bf16 torch._grouped_mm), "
        "one document per row, RoPE theta/max_pos from HF"
    )
    if tied:
        notes.append("tie_word_embeddings -> enable_weight_tying (embedding init skipped)")
    config = Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=norm(dim),
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init=_EMBEDDING_SKIP_INIT if tied else _EMBEDDING_INIT,
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=layers,
    )
    return config, notes


def _ensure_process_group(device: torch.device) -> bool:
    """Create a 1-rank process group if none exists; return whether one was created."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("titan_train_step_bench runs on one rank; world size != 1")
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


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
    precision: str = "fsdp",
    ac: str = "none",
    lr: float = 8e-4,
    attn_backend: str | None = None,
) -> dict:
    """Time torchtitan's training step on ``hf_config``; see the module docstring."""
    import torch.distributed as dist
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import (
        LRSchedulersContainer,
        default_adamw,
        register_moe_load_balancing_hook,
    )
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    if precision not in ("fsdp", "autocast"):
        raise ValueError(f"precision={precision!r}: 'fsdp' (trainer) or 'autocast'")
    device = torch.device(device)
    if attn_backend is None:
        attn_backend = "flex" if device.type == "cuda" else "sdpa"
    model_config, notes = _build_model_config(hf_config, seq_len, attn_backend)
    notes.insert(0, _MODEL_FLAVOUR_NOTE)
    parallelism = ParallelismConfig()
    training = TrainingConfig(local_batch_size=batch_size, seq_len=seq_len)
    compile_config = CompileConfig(enable=compile)
    # Qwen3Model.Config.update_from_config minus its Trainer import (torchdata): the only
    # non-validation effect for a world of 1 is attaching the sharding config.
    set_qwen3_sharding_config(
        model_config,
        enable_sp=parallelism.enable_sequence_parallel,
        enable_ep=parallelism.expert_parallel_degree > 1,
    )

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = model_config.build()
    num_params, flops_per_token = model_config.get_nparams_and_flops(model, seq_len)

    ac_config = {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[ac]
    parallel_dims = ParallelDims.from_config(parallelism, 1)
    # The 1-rank meshes (fully_shard, the spmd_types context, the MoE balancing hook's
    # "loss" mesh lookup) need a process group.
    created_pg = _ensure_process_group(device)
    import torchtitan.distributed.parallel_dims as tt_pd

    if tt_pd.device_type != device.type:
        # torchtitan picks its mesh device type once at import ("cuda" when no
        # accelerator is found); a CPU smoke run needs a CPU mesh.
        tt_pd.device_type = device.type
        notes.append(f"torchtitan mesh device_type patched to {device.type!r}")
    if precision == "fsdp":
        model = parallelize_qwen3(
            model,
            parallel_dims=parallel_dims,
            training=training,
            parallelism=parallelism,
            compile_config=compile_config,
            ac_config=ac_config,
            dump_folder="",
        )
        notes.append("mixed precision: FSDP2 1-rank mesh, param bf16 / reduce fp32 (trainer)")
    else:
        # Same order as parallelize_qwen3 minus fully_shard: AC, then apply_compile.
        if ac_config is not None:
            ac_config.build(dump_folder="").apply(model)
        if compile:
            apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
        notes.append("mixed precision: torch.autocast bf16 (NOT what torchtitan 0.3.0 does)")
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    loss_fn = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=model_config.vocab_size)
    ).build(compile_config=compile_config)
    if seq_len % loss_fn.num_chunks:
        raise ValueError(f"seq_len must be divisible by {loss_fn.num_chunks} (ChunkedLossWrapper)")
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True

    opt_config = default_adamw(lr=lr)
    if device.type != "cuda":
        opt_config.implementation = "foreach"
        notes.append("optimizer implementation foreach on CPU (trainer default fused is CUDA)")
    optimizers = opt_config.build(model_parts=[model])
    register_moe_load_balancing_hook(optimizers, [model], parallel_dims)
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=warmup + steps
    )
    train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)

    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, model_config.vocab_size, (batch_size, seq_len + 1), generator=gen)
    inputs = tokens[:, :-1].contiguous().to(device)
    labels = tokens[:, 1:].contiguous().to(device)
    positions = torch.arange(seq_len, device=device).unsqueeze(0).expand(batch_size, -1)
    params = list(model.parameters())
    amp = (
        torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        if precision == "autocast"
        else None
    )

    def step() -> torch.Tensor:
        optimizers.zero_grad(set_to_none=True)
        global_valid_tokens = torch.tensor(labels.numel(), device=device)
        masks = None if attn_backend == "sdpa" else model.get_attention_masks(positions=positions)
        with train_context():
            if amp is not None:
                with amp:
                    pred = model(inputs, positions=positions, attention_masks=masks)
                    loss, _ = loss_fn(pred, labels, global_valid_tokens, positions=positions)
            else:
                pred = model(inputs, positions=positions, attention_masks=masks)
                loss, _ = loss_fn(pred, labels, global_valid_tokens, positions=positions)
            del pred
            loss.backward()
        dist_utils.clip_grad_norm_(params, training.max_norm, foreach=True)
        optimizers.step()
        lr_schedulers.step()
        return loss.detach()

    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    losses: list[float] = []
    try:
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
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    finally:
        if created_pg:
            dist.destroy_process_group()

    ntok = batch_size * seq_len
    med = statistics.median(times)
    tps = ntok / med
    moe_cfg = next(layer.moe for layer in model_config.layers if layer.moe is not None)
    # Active params the way get_moe_model_nparams_and_flops counts them (all router +
    # top_k/num_experts of routed experts + everything dense, embeddings included).
    n_exp_params = sum(p.numel() for n, p in model.named_parameters() if "moe.routed_experts" in n)
    active = num_params - n_exp_params + n_exp_params * moe_cfg.router.top_k // moe_cfg.num_experts
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
        "precision": precision,
        "ac": ac,
        "notes": notes,
    }
