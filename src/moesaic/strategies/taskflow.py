"""``taskflow``: the MoE-FFN as compiled tile tasks on a concurrent executor (HyperParallel-MoE,
FlashDMoE).

Shape legend: T tokens on this rank, T' the bucket's tokens (the most of any rank), H hidden,
F expert hidden, E experts, e local experts, K top-k, P ranks.

Per step the group agrees on a shape bucket (one all-reduce of the largest expert load and token
count; ``TaskflowRuntime.bucket``), the layer's runtime compiles that bucket's forward and
backward plans once and runs them on the configured executor (its options' ``executor``,
:class:`~moesaic.strategies.taskflow_options.TaskflowOptions`:
"static" two-queue workers or "dynamic" scheduler + processors) with one-sided tile puts, only
valid rows travelling. Autograd: one Function whose forward runs the forward plan and whose
backward runs the backward plan, returning the gradients of the tokens, of the routing weights
(the router finishes its backward through autograd) and of this rank's experts.

Where the plans run: on CUDA (``kernels`` "auto", the default, or "triton") in the persistent
Triton kernel, one launch per direction (``taskflow.runtime.persistent.PersistentRuntime``:
puts into the peers' symmetric memory at EP > 1); on CPU, for GELU experts or with
``kernels="torch"`` on the host runtime's executor.

Any placement (plans number experts by dispatch slot) and capacity drops (a dropped choice
contributes nothing and gets no gradient) work; a rank with fewer tokens than the bucket pads
with choices marked dropped, and a rank with none still takes part in every collective and put.

Statistics (the forward): dispatch and combine bytes of the rows that left this rank, and as
metadata the bucket all-reduce, the plan fingerprint all-gather, the slot-count all-to-all and
the put headers; each put counts as one collective (one message, one latency).
"""

from __future__ import annotations

import torch

from moesaic.experts import GroupedExperts
from moesaic.kernels.persistent_steps import persistent_steps
from moesaic.routing import RoutingPlan
from moesaic.strategies.base import (
    CommStats,
    ExpertFn,
    MoEStrategy,
    StrategyContext,
    StrategyOutput,
    Supports,
)
from moesaic.strategies.taskflow_options import TaskflowOptions
from moesaic.taskflow.bucket import CompileOptions
from moesaic.taskflow.plan import Plan
from moesaic.taskflow.runtime.concurrent import TaskflowRuntime
from moesaic.taskflow.runtime.persistent import PersistentRuntime
from moesaic.trace import Recorder

__all__ = ["TaskflowStrategy", "pad_routing"]


def pad_routing(plan: RoutingPlan, tokens: int) -> RoutingPlan:
    """``plan`` extended to ``tokens`` tokens; the added tokens' choices are all dropped."""
    T, K = plan.topk_ids_TK.shape
    pad = tokens - T
    if pad < 0:
        raise ValueError(f"tokens ({tokens}) must be >= the plan's tokens ({T})")
    if pad == 0:
        return plan
    ids, w, kept = plan.topk_ids_TK, plan.topk_weights_TK, plan.kept_TK
    return RoutingPlan(
        topk_ids_TK=torch.cat([ids, ids.new_zeros(pad, K)]),
        topk_weights_TK=torch.cat([w, w.new_zeros(pad, K)]),
        kept_TK=torch.cat([kept, kept.new_zeros(pad, K)]),
        counts_E=plan.counts_E,
        order_N=plan.order_N,
        counts_Pe=plan.counts_Pe,
        placement=plan.placement,
        capacity=plan.capacity,
    )


def _runtime_for(cfg) -> tuple[type[TaskflowRuntime], dict]:
    """The runtime class for ``cfg.kernels`` and its extra arguments: the persistent kernel
    (``PersistentRuntime``: one launch per direction) for ``kernels="triton"`` (every step;
    it refuses GELU experts when built) and for ``"auto"``, the default, on CUDA tensors of a
    SwiGLU layer with Triton installed (CPU steps then run on the host runtime); the host
    runtime (``TaskflowRuntime``) for anything else."""
    if persistent_steps(cfg.kernels, cfg.activation, "cuda"):
        return PersistentRuntime, {"activation": cfg.activation, "kernels": cfg.kernels}
    return TaskflowRuntime, {}


class _TaskflowFn(torch.autograd.Function):
    """y = the forward plan's output; its backward runs the backward plan."""

    @staticmethod
    def forward(ctx, x_TH, topk_weights_TK, w1, w2, w3, run):
        strategy, fwd, bwd, routing, box, save = run
        out = strategy.runtime.forward(fwd, x_TH, routing, w1, w2, w3, save=save)
        ctx.run, ctx.saved, ctx.weights = (strategy, bwd, routing), out.saved, (w1, w2, w3)
        box["route"] = out.route  # for the forward's statistics (also without autograd)
        return out.y_TH

    @staticmethod
    def backward(ctx, dy_TH):
        strategy, bwd, routing = ctx.run
        w1, w2, w3 = ctx.weights
        g = strategy.runtime.backward(bwd, dy_TH, routing, ctx.saved, w1, w2, w3)
        ctx.saved = None
        dw3 = g.dw3_eHF.to(w3.dtype) if w3 is not None else None
        dtopk = g.dtopk_weights_TK.to(routing.topk_weights_TK.dtype)
        return g.dx_TH, dtopk, g.dw1_eHF.to(w1.dtype), g.dw2_eFH.to(w2.dtype), dw3, None


def _empty_linked(x_TH: torch.Tensor, plan: RoutingPlan, experts: GroupedExperts) -> torch.Tensor:
    """A ``(0, H)`` output still linked to the input, the routing weights and the experts, so a
    backward through a step without tokens gives them zero gradients (as dropless does) rather
    than failing with "element 0 of tensors does not require grad"."""
    linked = [x_TH, plan.topk_weights_TK, experts.w1, experts.w2, experts.w3]
    zero = sum((t.sum() * 0 for t in linked if t is not None), x_TH.new_zeros(()))
    return x_TH.new_zeros(0, x_TH.shape[1]) + zero


class TaskflowStrategy(MoEStrategy):
    """Compiled tile plans run by a static or dynamic executor with one-sided puts."""

    name = "taskflow"
    needs_expert_weights = True
    options_class = TaskflowOptions
    supports = Supports(
        pipelined=False,
        why=(
            "its dispatch, GEMMs and combine are fused into tile tasks of one compiled plan, so "
            "there are no row all-to-alls for a pipelined schedule to issue between stages"
        ),
        unsharded_why=(
            "its tile tasks read the local experts' weights (w1, w3, w2) directly, outside a "
            "call of the GroupedExperts module around which FSDP2 all-gathers them"
        ),
    )

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        opts = cfg.options_as(TaskflowOptions)
        #: Executed tasks per worker lane and the subscriber's puts (``trace.Span``s); off
        #: until ``recorder.enabled = True``; see ``trace.write_chrome_trace``.
        self.recorder = Recorder(rank=ctx.group.rank, enabled=False)
        runtime_cls, extra = _runtime_for(cfg)
        self.runtime = runtime_cls(
            ctx.group,
            executor=opts.executor,
            tile_m=opts.tile_m,
            options=CompileOptions(pipeline=opts.pipeline),
            transport=opts.transport,
            timeout_s=cfg.collective_timeout_s,
            recorder=self.recorder,
            **extra,
        )

    def plans(self, plan: RoutingPlan) -> tuple[Plan, Plan] | None:
        """The step's agreed (forward, backward) plans (a collective), None if no tokens."""
        cfg = self.ctx.config
        bucket = self.runtime.bucket(
            plan, hidden=cfg.hidden_size, ffn=cfg.ffn_hidden_size, activation=cfg.activation
        )
        return None if bucket is None else self.runtime.plans(bucket)

    def forward(self, x_TH: torch.Tensor, plan: RoutingPlan, experts: ExpertFn) -> StrategyOutput:
        if not isinstance(experts, GroupedExperts):
            raise TypeError(
                "taskflow runs the experts in its own tile tasks and needs the layer's "
                f"GroupedExperts, got {type(experts).__name__}"
            )
        T, H = x_TH.shape
        before = self.runtime.channel.puts_P[:] if self.runtime.channel else None
        plans = self.plans(plan)
        if plans is None:  # no rank has a token: nothing to compute or send
            stats = self._stats(plan, None, None, checked=False)
            return StrategyOutput(y_TH=_empty_linked(x_TH, plan, experts), stats=stats)
        fwd, bwd = plans
        checked = not self.runtime.world_checked(fwd)  # this step runs the fingerprint check
        tokens = fwd.bucket.tokens
        x_pad = torch.cat([x_TH, x_TH.new_zeros(tokens - T, H)]) if tokens > T else x_TH
        routing = pad_routing(plan, tokens)
        box: dict = {}
        inputs = (x_pad, routing.topk_weights_TK, experts.w1, experts.w2, experts.w3)
        # keep activations only when a backward can run (not under no_grad / inference)
        save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
        y = _TaskflowFn.apply(*inputs, (self, fwd, bwd, routing, box, save))
        stats = self._stats(plan, box["route"], before, checked, x_TH.element_size())
        return StrategyOutput(y_TH=y[:T], stats=stats)

    def _stats(
        self, plan: RoutingPlan, route, before: list[int] | None, checked: bool, esize: int = 4
    ) -> CommStats:
        P, me, row = self.group.size, self.group.rank, self.ctx.config.hidden_size
        dropped = plan.kept_TK.numel() - plan.order_N.numel()
        if P == 1:
            return CommStats(dropped_rows=dropped, peer_bytes_P=(0,))
        e = self.placement.num_local
        sent_P = plan.counts_Pe.sum(dim=1).tolist()
        recv_P = [0] * P
        if route is not None:
            recv_P = [sum(route.recv_counts_eP[j][s] for j in range(e)) for s in range(P)]
        channel = self.runtime.channel
        assert channel is not None
        puts_P = [a - b for a, b in zip(channel.puts_P, before or [0] * P)]
        # int64 metadata to each peer: the bucket all-reduce (max load, tokens), the slot-count
        # all-to-all (e counts) and, on a bucket's first step, the fingerprint all-gather (1)
        words = 2 + (e if route is not None else 0) + int(checked)
        meta_P = [0 if p == me else 8 * words for p in range(P)]
        meta_P = [m + n * channel.header_bytes for m, n in zip(meta_P, puts_P)]
        peer = self.peer_bytes(sent_P, recv_P, row * esize)
        return CommStats(
            dispatch_bytes=self.off_rank(sent_P) * row * esize,
            combine_bytes=self.off_rank(recv_P) * row * esize,
            meta_bytes=sum(meta_P),
            dropped_rows=dropped,
            collectives=(2 if route is not None else 1) + int(checked) + sum(puts_P),
            peer_bytes_P=tuple(a + b for a, b in zip(peer, meta_P)),
        )
