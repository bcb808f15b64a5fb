"""A training step's time under HybridEP: the paper's forward (Eq. 10) plus what training adds.

The paper's ``Lat_final`` is one MoE layer's forward with expert compute hidden under the
all-to-alls (Eq. 7) and notes (§V) that the backward adds "a constant". The ``hybrid``
strategy as built computes the experts between the two all-to-alls (nothing hides them), runs
a backward with the same two all-to-alls and reduces the gathered experts' gradients to their
owners (dense bytes, whatever the compression), so the prediction compared with measurements is,
per MoE block::

    forward  = max(PE, AG) + 2 A2A + EXP        (prefetched gathers: Fig. 10)
             = PE + AG + 2 A2A + EXP            (gathers issued in the layer: Partition only)
    backward = 2 PE + 2 EXP + 2 A2A + RS        (RS: the gradient reduce, priced as a dense AG)
    AG      += shared-expert all-reduce          (compressed gathers only)

with PE, EXP from FLOPs at a given throughput (``stream_inputs``) and AG, A2A, RS from
:func:`moesaic.sim.hybrid_costmodel.evaluate_domains` on the cluster description. The
data-parallel all-reduce of replicated weights is the same for every strategy and left out.

Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moesaic.checks import check_bool, check_positive_int
from moesaic.cluster.spec import ClusterSpec
from moesaic.config import MoEConfig
from moesaic.placement.compress import kept_entries
from moesaic.sim.hybrid_costmodel import (
    domain_size_choices,
    evaluate_domains,
    fastest_smallest,
    shared_expert_gathers,
    stream_inputs,
)

__all__ = ["StepPlan", "StepPrediction", "plan_step", "predict_step"]


@dataclass(kw_only=True, slots=True, frozen=True)
class StepPrediction:
    """Predicted seconds of one training step, and its parts (per MoE block, seconds).

    Attributes:
        domain_sizes: ``S^l`` per level.
        step_s: ``blocks * (forward_s + backward_s)``.
        forward_s: one block's forward.
        backward_s: one block's backward.
        parts: ``pre_expert``, ``expert``, ``gather``, ``all_to_all`` (one of the two),
            ``grad_reduce``, ``shared_all_reduce``.
    """

    domain_sizes: tuple[int, ...]
    step_s: float
    forward_s: float
    backward_s: float
    parts: dict[str, float]


def predict_step(
    spec: ClusterSpec,
    config: MoEConfig,
    domain_sizes: tuple[int, ...] | list[int],
    *,
    tokens_per_rank: int,
    flops_per_s: float,
    blocks: int = 1,
    seq_len: int | None = None,
    act_bytes: int = 4,
    param_bytes: int = 4,
    compression_ratio: float = 1.0,
    shared_expert_every: int = 1,
    shared_expert: str = "domain",
    prefetch: bool = False,
    dense_blocks_before: int = 0,
    dense_ffn_hidden_size: int | None = None,
) -> StepPrediction:
    """Predicts a training step of ``blocks`` (attention + MoE) blocks under ``hybrid``.

    Args:
        spec: The cluster (its world size is the expert-parallel size).
        config: The MoE layer.
        domain_sizes: ``S^l`` per level (all 1: classic EP, which ``dropless`` runs).
        tokens_per_rank: Tokens each rank feeds each layer.
        flops_per_s: A rank's GEMM throughput, as measured on the running cluster.
        blocks: MoE blocks in the model.
        seq_len: Sequence length for the attention FLOPs (default: ``tokens_per_rank``).
        act_bytes: Bytes per activation element on the wire.
        param_bytes: Bytes per expert parameter.
        compression_ratio: SR compression ratio of the gathers (1: none).
        shared_expert_every: The shared experts' all-reduce runs every this many gathers
            (``hybrid``'s option ``HybridOptions.shared_expert_every``): its time is spread over
            them.
        shared_expert: What the shared expert is the mean of (``HybridOptions.shared_expert``):
            its all-reduce's groups (``shared_expert_gathers``).
        prefetch: Gathers prefetched under the pre-expert computation (Fig. 10).
        dense_blocks_before: Dense blocks before each MoE block (``stream_inputs``).
        dense_ffn_hidden_size: Their FFN width (``stream_inputs``).
    """
    check_positive_int("blocks", blocks)
    check_bool("prefetch", prefetch)
    check_positive_int("shared_expert_every", shared_expert_every)
    common = dict(
        tokens_per_rank=tokens_per_rank,
        ep_size=spec.world_size,
        flops_per_s=flops_per_s,
        act_bytes=act_bytes,
        param_bytes=param_bytes,
        seq_len=seq_len,
        dense_blocks_before=dense_blocks_before,
        dense_ffn_hidden_size=dense_ffn_hidden_size,
    )
    sent = stream_inputs(config, compression_ratio=compression_ratio, **common)  # type: ignore[arg-type]
    dense = stream_inputs(config, **common)  # type: ignore[arg-type]
    moved = evaluate_domains(spec, sent, domain_sizes)
    grads = evaluate_domains(spec, dense, domain_sizes)
    gather_s = sum(moved.ag_s)
    numel = config.hidden_size * config.ffn_hidden_size
    compressed = kept_entries(numel, compression_ratio) < numel
    sizes = [lv.size for lv in spec.levels]
    shared_s = sum(
        sum(evaluate_domains(spec, shared, group).ag_s) / shared_expert_every
        for shared, group in shared_expert_gathers(
            dense, moved.domain_sizes, sizes, compressed=compressed, scope=shared_expert
        )
    )
    gather_s += shared_s
    a2a_s = sum(moved.a2a_s)
    pe_s = sent.pre_expert_s
    exp_s = sent.experts_per_rank * sent.expert_s
    first = max(pe_s, gather_s) if prefetch else pe_s + gather_s
    forward_s = first + 2 * a2a_s + exp_s
    reduce_s = sum(grads.ag_s)
    backward_s = 2 * pe_s + 2 * exp_s + 2 * a2a_s + reduce_s
    return StepPrediction(
        domain_sizes=moved.domain_sizes,
        step_s=blocks * (forward_s + backward_s),
        forward_s=forward_s,
        backward_s=backward_s,
        parts={
            "pre_expert": pe_s,
            "expert": exp_s,
            "gather": gather_s - shared_s,
            "shared_all_reduce": shared_s,
            "all_to_all": a2a_s,
            "grad_reduce": reduce_s,
        },
    )


@dataclass(kw_only=True, slots=True, frozen=True)
class StepPlan:
    """The result of :func:`plan_step`: every candidate's step, the chosen one and why."""

    chosen: StepPrediction
    classic: StepPrediction
    candidates: tuple[StepPrediction, ...]
    reason: str


def plan_step(spec: ClusterSpec, config: MoEConfig, **kwargs: Any) -> StepPlan:
    """Domain sizes for training: every divisor tuple priced by :func:`predict_step`.

    :func:`moesaic.sim.hybrid_costmodel.plan_domains` ranks candidates by the paper's forward
    latency; a training step also reduces the gathered experts' gradients (dense, whatever the
    compression) and runs the two all-to-alls again, which favours smaller domains when experts
    are large. Ties go to the smaller domains. ``kwargs`` are :func:`predict_step`'s.
    """
    candidates = tuple(predict_step(spec, config, ds, **kwargs) for ds in domain_size_choices(spec))
    chosen = fastest_smallest(candidates, lambda c: c.step_s)
    classic = candidates[0]
    reason = (
        f"domains {list(chosen.domain_sizes)} predict a {chosen.step_s:.3g} s step vs classic EP "
        f"{classic.step_s:.3g} s ({classic.step_s / chosen.step_s:.2f}x)"
    )
    return StepPlan(chosen=chosen, classic=classic, candidates=candidates, reason=reason)
