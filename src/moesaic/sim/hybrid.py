"""HybridEP's step as a task graph, with the domain sizes its cost model chooses.

The costs are those of :mod:`moesaic.planning.stepmodel` (``stream_inputs`` for the compute,
the gathers' and token hops' traffic of :func:`moesaic.sim.hybrid_costmodel.evaluate_domains`),
but the network phases are priced by the closed forms of :mod:`moesaic.sim.collectives`
(:func:`level_exchange_s`): equal to ``evaluate_domains`` on any cluster (tested), without its
``P x P`` matrices, so 8,000 ranks plan in milliseconds. :func:`plan_domains_fast` ranks every
candidate by the same step formula and tie rule as ``plan_step`` (tested to choose the same).

Per MoE block, forward then backward (``hybrid`` as built: gathers inside the layer, or
prefetched under the pre-expert compute; one dropless exchange per hop)::

    AT -> AG (gather lane) -> D (a2a) -> E -> C (a2a) -> next block
    backward: C -> E (x2) -> D -> RS (gradient reduce, gather lane) -> AT (x2)

Domain sizes all 1 is classic EP (``dropless``): no gathers, one all-to-all per hop.

That graph is ``hybrid`` under the ``vanilla`` schedule as HybridEP's benchmark runs it (no
data-parallel gradient all-reduce; ``SimOptions.hybrid_step = "benchmark"``); a training step
under ``vanilla`` is the block pipeline at R = 1 with :func:`hybrid_costs`. Under ``moe-only`` and ``flowmoe``, :func:`hybrid_costs`
gives the block pipeline of :mod:`moesaic.sim.pipelined` the same gathers and gradient reduce
around dropless's exchange over the offset group, as the runtime pipelines it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moesaic.checks import check_positive_int
from moesaic.config import MoEConfig
from moesaic.placement.compress import kept_entries
from moesaic.sim.collectives import LinkModel, level_exchange_s
from moesaic.sim.graph import SimGraph, SimTask
from moesaic.sim.hybrid_costmodel import (
    StreamInputs,
    domain_size_choices,
    fastest_smallest,
    shared_expert_gathers,
    stream_inputs,
)
from moesaic.sim.model import ModelSpec
from moesaic.sim.pipelined import Costs, ExpertGathers
from moesaic.sim.profile import Profile

__all__ = [
    "HybridParts",
    "build_hybrid",
    "hybrid_costs",
    "hybrid_parts",
    "moe_config",
    "plan_domains_fast",
]


def moe_config(model: ModelSpec) -> MoEConfig:
    """The ``MoEConfig`` of the model's MoE layers (for the placement cost model)."""
    return MoEConfig(
        hidden_size=model.hidden,
        ffn_hidden_size=model.ffn_hidden,
        num_experts=model.experts,
        top_k=model.top_k,
        activation=model.activation,
        capacity_factor=model.capacity_factor or None,
    )


@dataclass(kw_only=True, slots=True, frozen=True)
class HybridParts:
    """Seconds of one block's pieces with given domain sizes (``predict_step``'s parts)."""

    domain_sizes: tuple[int, ...]
    pre_expert: float
    expert: float
    gather: float
    all_to_all: float
    grad_reduce: float
    prefetch: bool

    @property
    def step_s(self) -> float:
        """``predict_step``'s block time (forward + backward), for planning."""
        first = (
            max(self.pre_expert, self.gather) if self.prefetch else self.pre_expert + self.gather
        )
        forward = first + 2 * self.all_to_all + self.expert
        backward = 2 * self.pre_expert + 2 * self.expert + 2 * self.all_to_all + self.grad_reduce
        return forward + backward

    @property
    def paper_latency_s(self) -> float:
        """The paper's ``Lat_final`` (Eq. 10): ``max(Lat_PE, Lat_AG) + 2 Lat_A2A``, one block's
        forward with the gathers overlapping the pre-expert compute (Eq. 7, case 1) and the
        expert compute hidden; no backward and so no gradient reduce (for Fig. 17)."""
        return max(self.pre_expert, self.gather) + 2 * self.all_to_all


def _inputs(model: ModelSpec, world: int, flops_per_s: float, cr: float = 1.0) -> StreamInputs:
    return stream_inputs(
        moe_config(model),
        tokens_per_rank=model.tokens,
        ep_size=world,
        flops_per_s=flops_per_s,
        act_bytes=model.act_bytes,
        param_bytes=model.param_bytes,
        seq_len=model.seq_len,
        compression_ratio=cr,
    )


def _phases(
    link: LinkModel, inputs: StreamInputs, domain_sizes: tuple[int, ...], *, reduce: bool = False
):
    """(gather seconds, one all-to-all's seconds): every level's phase, summed. With ``reduce``
    the first is the gathers' adjoint, the gradient reduce, which the runtime issues as one
    all-to-all per level (``strategies.hybrid._GatheredExperts.backward``) and which is priced
    as one (the all-to-all's measured share, not the all-gather's)."""
    ag = a2a = 0.0
    levels = link.spec.levels
    for level, lv in enumerate(levels):
        s = domain_sizes[level]
        if s > 1:
            bundle = inputs.expert_bytes * math.prod(domain_sizes[:level])
            ag += level_exchange_s(link, level, s - 1, bundle, gather=not reduce)
        if s < lv.size:
            a2a += level_exchange_s(link, level, lv.size // s - 1, inputs.data_bytes * s / lv.size)
    return ag, a2a


def hybrid_parts(
    link: LinkModel,
    model: ModelSpec,
    domain_sizes: tuple[int, ...],
    flops_per_s: float,
    *,
    prefetch: bool = False,
    compression_ratio: float = 1.0,
    shared_expert_every: int = 1,
    shared_expert: str = "domain",
) -> HybridParts:
    """One block's parts on ``link`` with ``domain_sizes`` (each a divisor of its level's size).

    ``compression_ratio`` > 1 is +Migration's SR compression: gathers move compressed experts
    and the shared expert's all-reduce (``shared_expert_gathers``: over the domain, and the
    offset group for ``shared_expert`` "all", every ``shared_expert_every`` gathers); the
    gradient reduce stays dense (``predict_step``).
    """
    ds = tuple(domain_sizes)
    if len(ds) != link.spec.num_levels or any(
        not isinstance(s, int) or s < 1 or lv.size % s for s, lv in zip(ds, link.spec.levels)
    ):
        raise ValueError(f"domain_sizes ({list(ds)}) must give a divisor of each level's size")
    check_positive_int("shared_expert_every", shared_expert_every)
    sent = _inputs(model, link.world_size, flops_per_s, compression_ratio)
    dense = _inputs(model, link.world_size, flops_per_s)
    gather, a2a = _phases(link, sent, ds)
    reduce, _ = _phases(link, dense, ds, reduce=True)  # dense gradients: the gathers' bytes back
    numel = model.hidden * model.ffn_hidden
    compressed = kept_entries(numel, compression_ratio) < numel
    sizes = [lv.size for lv in link.spec.levels]
    for shared, group in shared_expert_gathers(
        dense, ds, sizes, compressed=compressed, scope=shared_expert
    ):
        gather += _phases(link, shared, group)[0] / shared_expert_every
    return HybridParts(
        domain_sizes=ds,
        pre_expert=sent.pre_expert_s,
        expert=sent.experts_per_rank * sent.expert_s,
        gather=gather,
        all_to_all=a2a,
        grad_reduce=reduce,
        prefetch=prefetch,
    )


def plan_domains_fast(
    link: LinkModel, model: ModelSpec, flops_per_s: float, **kwargs: Any
) -> tuple[HybridParts, HybridParts]:
    """``(chosen, classic)``: ``plan_step``'s rule (fastest step, ties to smaller domains) over
    every divisor tuple, with closed-form phases; ``kwargs`` are :func:`hybrid_parts`'s."""
    cands = [
        hybrid_parts(link, model, ds, flops_per_s, **kwargs)
        for ds in domain_size_choices(link.spec)
    ]
    return fastest_smallest(cands, lambda c: c.step_s), cands[0]


def build_hybrid(parts: HybridParts, model: ModelSpec, profile: Profile) -> SimGraph:
    """The step's graph: ``model.layers`` blocks of ``parts``, forward then backward."""
    g = SimGraph()
    ov = profile.task_overhead_s
    at_s, e_s = parts.pre_expert + ov, parts.expert + ov
    prev: SimTask | None = None
    for blk in range(1, model.layers + 1):
        at = g.add("compute", SimTask(f"AT1.{blk}", "compute", at_s, "fwd", blk, 1), prev)
        ag_wait = prev if parts.prefetch else at
        ag = g.add("gather", SimTask(f"AG{blk}", "gather", parts.gather, "fwd", blk), ag_wait)
        # prefetched: the gather runs beside AT, and D waits for both
        d_wait = (at, ag) if parts.prefetch else ag
        d = g.add("net", SimTask(f"D1.{blk}", "a2a", parts.all_to_all, "fwd", blk, 1), d_wait)
        e = g.add("compute", SimTask(f"E1.{blk}", "compute", e_s, "fwd", blk, 1), d)
        prev = g.add("net", SimTask(f"C1.{blk}", "a2a", parts.all_to_all, "fwd", blk, 1), e)
    for blk in range(model.layers, 0, -1):
        c = g.add("net", SimTask(f"C1.{blk}", "a2a", parts.all_to_all, "bwd", blk, 1), prev)
        e = g.add("compute", SimTask(f"E1.{blk}", "compute", 2 * e_s, "bwd", blk, 1), c)
        d = g.add("net", SimTask(f"D1.{blk}", "a2a", parts.all_to_all, "bwd", blk, 1), e)
        rs = g.add("gather", SimTask(f"RS{blk}", "gather", parts.grad_reduce, "bwd", blk), d)
        prev = g.add("compute", SimTask(f"AT1.{blk}", "compute", 2 * at_s, "bwd", blk, 1), rs)
    g.add("compute", SimTask("optimizer", "optimizer", ov), prev)
    return g


def hybrid_costs(
    link: LinkModel, model: ModelSpec, profile: Profile, degree: int, parts: HybridParts
) -> Costs:
    """``hybrid`` under a pipelined schedule (moe-only, flowmoe): the stage model of
    :mod:`moesaic.sim.pipelined` with dropless's exchange over the offset group of
    ``parts.domain_sizes`` (R chunks), ``parts``' gathers once before the pipeline and its
    gradient reduce once per block (:class:`~moesaic.sim.pipelined.ExpertGathers`). Domains all
    1: dropless's costs."""
    gathers = ExpertGathers(
        gather_s=parts.gather, reduce_s=parts.grad_reduce, prefetch=parts.prefetch
    )
    return Costs(
        model,
        link,
        profile,
        degree,
        strategy="hybrid",
        domain_sizes=parts.domain_sizes,
        gathers=gathers,
    )
