"""HybridEP expert domains of a training run: ``--domains auto|S0,S1,...`` and ``--cluster``.

``model.moe.options.domain_sizes`` (``--domains``, a ``hybrid`` option) is given as sizes
(``[1, 2]`` in TOML, ``1,2`` as a flag) or as ``"auto"``; ``"auto"`` becomes
``TrainConfig.auto_domains`` and is resolved when the run starts (:func:`plan_training_domains`):
the training-step model
(:func:`moesaic.planning.stepmodel.plan_step`, the last line of ``moesaic plan``) on the inputs
below, from the cluster description (``--cluster FILE.toml``) and a measured GEMM throughput.

What the cost model is told about a training run (the same rules for ``moesaic plan --model``):

* ``T``, tokens per rank per MoE forward: ``batch_size x seq_len / pipeline_degree`` (a
  pipelined schedule runs each MoE layer once per chunk);
* the priced MoE block is the steady-state one: with several MoE blocks, the second and later
  ones have only their own attention (and router) in front (``m = 0`` dense blocks before, Eq. 2;
  ``m = moe_layer_freq - 1`` when only every N-th block is MoE); with a single MoE block the
  dense blocks before it count (``m = dense_layers``, or its index with ``moe_layer_freq``);
  the first of several MoE blocks has more cover than the plan assumes, never less;
* bytes per element: 4 (``moesaic train`` trains in fp32), for tokens and experts alike.

Torch-free to import: ``moesaic plan`` uses it without torch (:func:`check_cluster_and_domains`
imports the strategy's class, and with it torch).
"""

from __future__ import annotations

from typing import Any

from moesaic.checks import check_positive_int, is_int
from moesaic.cluster.spec import ClusterSpec
from moesaic.config import MoEConfig
from moesaic.models.config import MoEGPTConfig
from moesaic.planning.stepmodel import StepPlan, plan_step
from moesaic.sim.hybrid_costmodel import StreamInputs, stream_inputs
from moesaic.strategies.hybrid_options import HybridOptions

__all__ = [
    "AUTO",
    "TRAIN_DTYPE_BYTES",
    "check_cluster_and_domains",
    "dense_blocks_before",
    "hybrid_options",
    "load_cluster",
    "model_stream_inputs",
    "parse_domain_sizes",
    "plan_training_domains",
    "split_auto_domains",
    "tokens_per_forward",
]

AUTO = "auto"
# moesaic train runs in fp32 (torch's default dtype): bytes of a token element and of a weight.
TRAIN_DTYPE_BYTES = 4


def parse_domain_sizes(value: object) -> str | tuple[int, ...] | None:
    """``model.moe.options.domain_sizes`` as given: None, ``"auto"``, ints, or ``"S0,S1,..."``.

    Returns ``"auto"``, a tuple of ints, or None; each size is checked to be a positive int.
    """
    if value is None:
        return None
    if value == AUTO:
        return AUTO
    rule = "must be 'auto' or positive ints, one per cluster level, outermost first ('1,2')"
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        if not all(p.isdigit() for p in parts):
            raise ValueError(f"model.moe.options.domain_sizes ({value!r}) {rule}")
        value = [int(p) for p in parts]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"model.moe.options.domain_sizes ({value!r}) {rule}")
    for i, s in enumerate(value):
        if not is_int(s) or s < 1:
            raise ValueError(f"model.moe.options.domain_sizes[{i}] ({s!r}) {rule}")
    return tuple(value)


def split_auto_domains(model: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``[model]`` with ``moe.options.domain_sizes`` parsed; ``"auto"`` is taken out and returned
    as True.

    ``model`` is a ``[model]`` table after ``nest_legacy_keys`` (not modified).
    """
    moe = model.get("moe")
    if not isinstance(moe, dict):
        return model, False
    options = moe.get("options")
    if not isinstance(options, dict) or "domain_sizes" not in options:
        return model, False
    sizes = parse_domain_sizes(options["domain_sizes"])
    options = dict(options)
    if sizes == AUTO:
        del options["domain_sizes"]
    else:
        options["domain_sizes"] = sizes
    return {**model, "moe": {**moe, "options": options}}, sizes == AUTO


def load_cluster(path: str, *, option: str = "cluster") -> ClusterSpec:
    """The cluster description of ``--cluster`` (or of ``option``, e.g. ``emulate``); errors
    name the option and the file."""
    try:
        return ClusterSpec.from_toml(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{option}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{option} ({path}): {exc}") from None


def check_cluster_and_domains(
    cluster: str | None, moe: MoEConfig, ep_size: int
) -> ClusterSpec | None:
    """The run's cluster (None without ``--cluster``), checked against the EP size and the domains.

    Raises ValueError when the cluster's world size is not the expert-parallel size, or when
    the strategy refuses its options on the cluster's levels (without a cluster, one level of
    the EP size): :meth:`MoEStrategy.check_levels`, e.g. ``hybrid``'s domain sizes must have
    one size per level, each dividing the level's size.
    """
    spec = None if cluster is None else load_cluster(cluster)
    if spec is not None and spec.world_size != ep_size:
        raise ValueError(
            f"cluster ({cluster}) describes {spec.world_size} ranks but the expert-parallel "
            f"group has ep = {ep_size}: the cluster file must describe one EP group "
            "(its world_size must equal --ep, or the number of ranks when --ep is not given)"
        )
    from moesaic.strategies.registry import get_strategy  # the class imports torch

    levels = [lv.size for lv in spec.levels] if spec is not None else [ep_size]
    where = f"the levels of cluster {cluster}" if spec is not None else "one level of ep"
    try:
        get_strategy(moe.dispatcher).check_levels(moe, tuple(levels))
    except ValueError as exc:
        raise ValueError(f"model.moe.{exc} ({where}: sizes {levels})") from None
    return spec


def hybrid_options(moe: MoEConfig) -> HybridOptions:
    """``moe``'s ``hybrid`` options, or their defaults when ``moe`` runs another strategy (the
    cost model prices ``hybrid`` whatever the model's dispatcher)."""
    return moe.options if isinstance(moe.options, HybridOptions) else HybridOptions()


def tokens_per_forward(batch_size: int, seq_len: int, pipeline_degree: int) -> int:
    """``T`` of the cost model: tokens one MoE forward of one rank sees."""
    check_positive_int("pipeline_degree", pipeline_degree)
    return batch_size * seq_len // pipeline_degree


def dense_blocks_before(model: MoEGPTConfig) -> int:
    """``m`` of Eq. 2 for the priced MoE block (see the module docstring)."""
    if model.num_moe_layers == 1:
        return model.first_moe_block or 0
    return model.moe_layer_freq - 1


def model_stream_inputs(
    model: MoEGPTConfig,
    *,
    tokens_per_rank: int,
    ep_size: int,
    flops_per_s: float,
    compression_ratio: float | None = None,
    dtype_bytes: int = TRAIN_DTYPE_BYTES,
) -> StreamInputs:
    """``stream_inputs`` of ``model``'s MoE block (``compression_ratio``: default the model's)."""
    moe = model.moe
    if moe.num_experts % ep_size:
        raise ValueError(
            f"num_experts ({moe.num_experts}) must be divisible by the cluster's world size "
            f"({ep_size}): each rank holds num_experts / world_size experts"
        )
    cr = hybrid_options(moe).compression_ratio if compression_ratio is None else compression_ratio
    return stream_inputs(
        moe,
        tokens_per_rank=tokens_per_rank,
        ep_size=ep_size,
        flops_per_s=flops_per_s,
        act_bytes=dtype_bytes,
        param_bytes=dtype_bytes,
        compression_ratio=cr,
        seq_len=model.seq_len,
        dense_blocks_before=dense_blocks_before(model),
        dense_ffn_hidden_size=model.dense_hidden or 4 * model.d_model,
    )


def plan_training_domains(
    model: MoEGPTConfig,
    spec: ClusterSpec,
    *,
    batch_size: int,
    pipeline_degree: int,
    flops_per_s: float,
) -> StepPlan:
    """``--domains auto``: the domain sizes that minimise this run's predicted training step.

    :func:`moesaic.planning.stepmodel.plan_step` (the paper's forward plus the backward and
    the dense gradient reduce of gathered experts, with the prefetcher training attaches), on
    the inputs ``moesaic plan`` derives. A pure function of its arguments: ranks that pass the
    same ``flops_per_s`` (the training loop broadcasts rank 0's measurement) get the same plan.
    """
    moe = model.moe
    if moe.num_experts % spec.world_size:
        raise ValueError(
            f"num_experts ({moe.num_experts}) must be divisible by the cluster's world size "
            f"({spec.world_size}): each rank holds num_experts / world_size experts"
        )
    return plan_step(
        spec,
        moe,
        tokens_per_rank=tokens_per_forward(batch_size, model.seq_len, pipeline_degree),
        flops_per_s=flops_per_s,
        blocks=max(1, model.num_moe_layers),
        seq_len=model.seq_len,
        act_bytes=TRAIN_DTYPE_BYTES,
        param_bytes=TRAIN_DTYPE_BYTES,
        compression_ratio=hybrid_options(moe).compression_ratio,
        shared_expert_every=hybrid_options(moe).shared_expert_every,
        shared_expert=hybrid_options(moe).shared_expert,
        prefetch=True,
        dense_blocks_before=dense_blocks_before(model),
        dense_ffn_hidden_size=model.dense_hidden or 4 * model.d_model,
    )
