"""FlowMoE's block pipeline: a rank's batch in R chunks, each MoE block cut into stages that run
forward and backward in the order of a schedule (the paper's Eqs. 2-5).

Shape legend: B sequences, T positions, D width, R chunks, N rows this rank sends, M rows it
receives, K top-k.

Stages of MoE block l and chunk r (``models/gpt.py`` blocks, ``MoELayer`` phases):

* ``AT{r}.{l}`` (compute): the previous MoE block's combine tail (unpermute the received rows
  with the top-k weights, add the residual) or the embedding, any dense blocks in between,
  ``attention_stage``, the gate (``route``) and the rows to send (``MoELayer.send``);
* ``D{r}.{l}`` (communication): the dispatch all-to-all of those rows;
* ``E{r}.{l}`` (compute): regroup, the experts, the rows to send back (``expert_rows``);
* ``C{r}.{l}`` (communication): the combine all-to-all;
* ``head{r}``: the last combine tail, any dense blocks after, the logits and the chunk's loss
  weighted by its share of the batch (B_r / B, App. H).

Each compute stage's forward runs on detached leaf copies of its inputs and keeps its outputs;
its backward is ``torch.autograd.backward(outputs, grads)`` at the moment the schedule says, and
the gradients of its leaves go to the stage before it (GPipe-style manual stage backward). The
all-to-alls of rows (forward) and of their gradients (backward, splits swapped) are issued
asynchronously through the communication pool (``CommPool.all_to_all``), so the main thread
computes one chunk while another chunk's rows travel. Every rank issues every all-to-all, in the
same order, whatever its number of tokens.

Aux loss: after ``AT{R}.{l}`` all R chunks are routed, and ``MoELayer.take_aux_terms`` gives one
term per chunk (each in its own chunk's graph) summing to the aux loss of the whole batch; term r
joins the outputs of ``AT{r}.{l}`` (gradient 1). With the per-chunk loss weights, R = 1, 2, 4
give the gradients of the vanilla step up to summation order. (With a ``capacity_factor`` each
chunk's capacity comes from its own tokens, as for any microbatch, so what is dropped, and then
the result, can differ from the whole batch's; without one, nothing is dropped and R does not
change the mathematics.)

Two orders (``overlap_attention``):

* True (FlowMoE): forward ``AT1..ATR`` of block l, each issuing its ``D`` at once, then
  ``E1..ER`` (each waits its ``D``, then issues its ``C``); ``AT{r}.{l+1}`` waits only
  ``C{r}.{l}``. Backward: ``AT{R..1}.{l+1}`` (each issues ``C{r}.{l}``'s gradient), ``E{R..1}``
  (wait it, backward, issue ``D``'s gradient), ``AT{R..1}.{l}`` (wait it, backward).
* False (moe-only, the Tutel/ScheMoE way): the attention and gate of every chunk run before the
  block's first ``D`` is issued, and every ``C`` of block l completes before block l + 1 starts;
  in the backward every ``C`` gradient is issued after the block above is done, and every ``D``
  gradient completes before the attention backward starts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from moesaic.experts import GroupedExperts, expert_compute_dtype, expert_ffn
from moesaic.layer import MoELayer
from moesaic.schedule.base import LossFn
from moesaic.strategies.base import ExchangeHandle, ExpertRun

if TYPE_CHECKING:
    from moesaic.strategies.base import ExpertFn
    from moesaic.trace import Recorder

__all__ = ["A2AIssuer", "BlockPipeline", "check_degree"]

_KINDS = {"D": "dispatch", "C": "combine"}  # stage letter -> ExchangeHandle.splits kind


class PendingRows(Protocol):
    def wait(self) -> torch.Tensor: ...


class A2AIssuer(Protocol):
    """What the pipeline needs of the communication pool (``CommPool.all_to_all``)."""

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int] | None,
        input_splits: list[int] | None,
        *,
        group: Any,
        name: str,
        **args: Any,
    ) -> PendingRows: ...

    def end_all_to_alls(self) -> None:
        """The step's last all-to-all has been issued."""


def _cast_once(experts: GroupedExperts) -> ExpertFn:
    """A layer's own experts for a step's R chunks: where the rows compute in another dtype
    than the weights (bf16 autocast of fp32 weights), the weights are cast once, on the first
    chunk, and every chunk computes on (and keeps for its backward) that one cast instead of
    one of its own; the gradients reach the weights through it."""
    casts: dict[torch.dtype, tuple[torch.Tensor | None, ...]] = {}

    def run(x_MH: torch.Tensor, counts_e: Sequence[int]) -> torch.Tensor:
        dtype = expert_compute_dtype(x_MH.device, x_MH.dtype)
        weights = (experts.w1, experts.w3, experts.w2)
        if all(w is None or w.dtype == dtype for w in weights):
            return experts(x_MH, counts_e)
        if dtype not in casts:
            casts[dtype] = tuple(None if w is None else w.to(dtype) for w in weights)
        w1, w3, w2 = casts[dtype]
        assert w1 is not None and w2 is not None  # internal: w3 alone is optional
        kernels = experts.kernel_choice.for_device(x_MH.device)
        return expert_ffn(x_MH, counts_e, w1, w3, w2, kernels=kernels)

    return run


def _hold_root(model: nn.Module, hold: bool) -> None:
    """Under FSDP2 (``train/fsdp.py``) the root's own parameters (embedding, final norm, head)
    are one unit, and each chunk's ``embed`` and ``head`` is an FSDP2 call of its own: left
    alone, each call's backward reduce-scatters the root's gradients and reshards it, and the
    next call gathers it again (2R reduce-scatters and 2R - 1 gathers a step). Held, the root
    stays gathered and its gradients accumulate unreduced (FSDP2's gradient-accumulation
    path); released before the last root call's backward, which reduce-scatters their sum
    once. A model not sharded by FSDP2 is left as it is."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(not hold, recurse=False)
        model.set_reshard_after_backward(not hold, recurse=False)


def check_degree(degree: int, batch: int) -> None:
    """R must cut the batch into R equal, non-empty chunks."""
    if batch % degree:
        raise ValueError(
            f"pipeline_degree ({degree}) must divide this rank's batch size ({batch}): "
            "--pipeline-degree cuts the batch into R equal chunks along the batch dimension"
        )


class _Stage:
    """One compute task's piece of autograd: detached leaf inputs, kept outputs, their grads."""

    __slots__ = ("grads", "leaves", "outputs")

    def __init__(self) -> None:
        self.leaves: dict[str, torch.Tensor] = {}
        self.outputs: list[torch.Tensor] = []
        self.grads: list[torch.Tensor | None] = []

    def leaf(self, key: str, t: torch.Tensor) -> torch.Tensor:
        leaf = t.detach().requires_grad_(t.is_floating_point())
        self.leaves[key] = leaf
        return leaf

    def out(self, t: torch.Tensor, grad: torch.Tensor | None = None) -> int:
        """Keep ``t`` for the backward, with gradient ``grad`` or one set later through the
        returned index (``set_grad``); -1 (nothing kept) when ``t`` needs no gradient."""
        if not t.requires_grad:
            return -1
        self.outputs.append(t)
        self.grads.append(grad)
        return len(self.outputs) - 1

    def set_grad(self, index: int, grad: torch.Tensor) -> None:
        if index >= 0:
            self.grads[index] = grad

    def backward(self) -> dict[str, torch.Tensor]:
        """Run this stage's backward; the gradients of its leaves (zeros where none reached).

        An output whose gradient never arrived contributes nothing (its consumer did not use
        it: e.g. the top-k weights of a plan that kept no assignment)."""
        pairs = [(t, g) for t, g in zip(self.outputs, self.grads) if g is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        grads = {
            k: leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            for k, leaf in self.leaves.items()
            if leaf.requires_grad
        }
        self.leaves, self.outputs, self.grads = {}, [], []  # free the graph's references
        return grads


@dataclass(slots=True)
class _MoEOut:
    """What ``AT{r}.{l}`` hands on: its stage and the tensors of its outputs, detached."""

    stage: _Stage
    x: torch.Tensor  # residual stream after attention
    weights_TK: torch.Tensor  # top-k combine weights
    rows: torch.Tensor  # rows to send (input of D)
    handle: ExchangeHandle
    # Indices into stage.outputs (for their gradients); -1 when the output needs none.
    i_x: int = -1
    i_w: int = -1
    i_rows: int = -1


@dataclass(slots=True)
class _Chunk:
    """One chunk's state between stages."""

    r: int  # 1-based
    x_BT: torch.Tensor
    y_BT: torch.Tensor
    weight: float  # B_r / B
    at: list[_MoEOut] = field(default_factory=list)
    experts: list[_Stage] = field(default_factory=list)
    head: _Stage | None = None
    pending: PendingRows | None = None  # the all-to-all in flight for this chunk
    received: torch.Tensor | None = None  # rows received by the last wait


class BlockPipeline:
    """Runs the forward and backward of a pipelined step on a block model (``MoEGPT``).

    Args:
        model: a model with ``embed(idx_BT)``, ``blocks`` (each with ``attention_stage`` and an
            ``moe`` MoELayer, or a dense block run whole) and ``head(x_BTD)``.
        degree: R, the number of chunks.
        overlap_attention: True: FlowMoE's order; False: moe-only's (module docstring).
        recorder: where the compute stages' spans go (None: nowhere).
        schedule: the schedule's name, for the strategies' ``supports`` check (None: only
            that they have dispatch/combine phases).

    Raises:
        ValueError: the model is not a block model, or an MoE layer's strategy has no
            dispatch/combine phases (the error names the dispatcher).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        degree: int,
        overlap_attention: bool,
        recorder: Recorder | None = None,
        schedule: str | None = None,
    ) -> None:
        blocks = getattr(model, "blocks", None)
        if not (hasattr(model, "embed") and hasattr(model, "head") and blocks is not None):
            raise ValueError(
                f"the pipelined schedules need a block model with embed(), blocks and head() "
                f"(MoEGPT); got {type(model).__name__}"
            )
        self.model = model
        self.degree = degree
        self.overlap_attention = overlap_attention
        self.recorder = recorder
        # Dense blocks run whole inside the compute stage that precedes them.
        # (1-based block number, block, its MoE layer); blocks are duck-typed (Any): any module
        # with attention_stage and an ``moe`` layer.
        self.moe_blocks: list[tuple[int, Any, MoELayer]] = []
        self.dense_before: list[list[nn.Module]] = []
        dense: list[nn.Module] = []
        for i, block in enumerate(blocks):
            layer = getattr(block, "moe", None)
            if isinstance(layer, MoELayer):
                layer.exchange_strategy(schedule)  # a clear error now, not mid-step
                self.moe_blocks.append((i + 1, block, layer))
                self.dense_before.append(dense)
                dense = []
            else:
                dense.append(block)
        self.dense_after = dense
        self.timeout_s = min((m.ep.timeout_s for _, _, m in self.moe_blocks), default=60.0)
        self.pool: A2AIssuer | None = None  # set for the duration of run()
        # each MoE block's experts, from one block ahead of its expert stages until its
        # expert backward is finished (``_prepare``), for the duration of run()
        self.runs: list[ExpertRun | None] = []
        self._prepared_at: list[float] = []  # when each block's experts were prepared

    # ---- recording ----------------------------------------------------------------------

    def _span(self, name: str, resource: str = "compute", **args: Any) -> Any:
        from moesaic.trace import maybe_span

        return maybe_span(self.recorder, resource, name, **args)

    def _prepare(self, j: int) -> None:
        """Prepare MoE block j's experts for the step (``hybrid`` issues its gathers here;
        ``_experts_ready`` waits for them): block 0's before the first stage, block j + 1's
        once block j's have arrived, so one block's transfer is in flight while the stages
        before its experts run, and no more than one block ahead. The R chunks share one
        cast of a layer's own experts to the rows' compute dtype (``_cast_once``)."""
        if j >= len(self.moe_blocks):
            return
        layer = self.moe_blocks[j][2]
        self._prepared_at[j] = time.perf_counter()
        run = layer.prepare_experts()
        if run.fn is layer.experts and isinstance(layer.experts, GroupedExperts):
            run = dataclasses.replace(run, fn=_cast_once(layer.experts))
        self.runs[j] = run

    def _run_of(self, j: int) -> ExpertRun:
        run = self.runs[j]
        assert run is not None  # internal: prepared one block ahead, finished after its use
        return run

    def _experts_ready(self, j: int) -> None:
        """Before MoE block j's first expert stage: what preparing its experts started has
        arrived (a ``gather`` span ``G.{block}`` from the preparation to here when it
        communicated: the transfer was in flight during the stages in between); then the
        next block's are prepared."""
        run = self._run_of(j)
        if run.wait is not None:
            run.wait()
        if self.recorder is not None and run.stats.collectives:
            blk = self.moe_blocks[j][0]
            start, end = self._prepared_at[j], time.perf_counter()
            self.recorder.add("gather", f"G.{blk}", start, end, phase="fwd", block=blk)
        self._prepare(j + 1)

    # ---- the step -------------------------------------------------------------------------

    def run(
        self, x_BT: torch.Tensor, y_BT: torch.Tensor, loss_fn: LossFn, pool: A2AIssuer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of the batch in R chunks; parameters' ``.grad`` accumulate.

        Returns the loss (the chunks' losses weighted by their share: the batch's mean) and the
        aux loss (every MoE layer's, of the whole batch), both detached.
        """
        B, R = x_BT.shape[0], self.degree
        check_degree(R, B)
        chunks = [
            _Chunk(r=r + 1, x_BT=x, y_BT=y, weight=x.shape[0] / B)
            for r, (x, y) in enumerate(zip(x_BT.split(B // R), y_BT.split(B // R)))
        ]
        self.pool = pool
        J = len(self.moe_blocks)
        self.runs, self._prepared_at = [None] * J, [0.0] * J
        self._prepare(0)
        aux = self._forward(chunks)
        ce = self._heads(chunks, loss_fn)
        self._backward(chunks)
        self.pool, self.runs = None, []
        return ce, aux.to(ce.device)

    # ---- forward --------------------------------------------------------------------------

    def _forward(self, chunks: Sequence[_Chunk]) -> torch.Tensor:
        aux = torch.zeros((), device=chunks[0].x_BT.device)
        for j, (blk, _, layer) in enumerate(self.moe_blocks):
            if j > 0 and not self.overlap_attention:
                for c in chunks:  # barrier: every C of block j - 1 before this block
                    self._wait(c)
            for c in chunks:
                if j > 0 and self.overlap_attention:
                    self._wait(c)
                with self._span(f"AT{c.r}.{blk}", phase="fwd", block=blk, chunk=c.r):
                    c.at.append(self._attention(c, j))
                if self.overlap_attention:
                    self._dispatch(c, j)
            if not self.overlap_attention:
                for c in chunks:
                    self._dispatch(c, j)
            aux = aux + self._aux(chunks, layer).to(aux.device)
            self._experts_ready(j)
            for c in chunks:
                rows = self._wait(c)
                with self._span(f"E{c.r}.{blk}", phase="fwd", block=blk, chunk=c.r):
                    stage = _Stage()
                    y = layer.expert_rows(stage.leaf("rows", rows), c.at[j].handle, self._run_of(j))
                    stage.out(y)
                    c.experts.append(stage)
                self._a2a(c, j, "C", y.detach(), fwd=True)
        return aux

    def _tail(self, stage: _Stage, c: _Chunk, j: int) -> torch.Tensor:
        """The stage's input: the embedding (j = 0) or MoE block j - 1's combine tail."""
        if j == 0:
            return self.model.embed(c.x_BT)  # type: ignore[operator]
        prev, layer = c.at[j - 1], self.moe_blocks[j - 1][2]
        assert c.received is not None  # internal: _wait stored the combine's rows
        x = stage.leaf("x", prev.x)
        w = stage.leaf("w", prev.weights_TK)
        rows = stage.leaf("rows", c.received)
        return x + layer.receive(rows, prev.handle, w, like=x)

    def _attention(self, c: _Chunk, j: int) -> _MoEOut:
        stage = _Stage()
        x = self._tail(stage, c, j)
        for dense in self.dense_before[j]:
            x = dense(x)
        _, block, layer = self.moe_blocks[j]
        x, h = block.attention_stage(x)
        routed = layer.route(h)
        out = layer.send(routed)
        w = routed.plan.topk_weights_TK
        return _MoEOut(
            stage,
            x.detach(),
            w.detach(),
            out.rows.detach(),
            out.handle,
            i_x=stage.out(x),
            i_w=stage.out(w),
            i_rows=stage.out(out.rows),
        )

    def _aux(self, chunks: Sequence[_Chunk], layer: MoELayer) -> torch.Tensor:
        """Each chunk's aux term joins its AT stage (gradient 1); returns their detached sum."""
        terms = layer.take_aux_terms()
        R = len(chunks)
        if len(terms) < R:
            raise RuntimeError(f"expected {R} pending aux terms (one per chunk), got {len(terms)}")
        # Forwards left pending before this step (the vanilla step would count them too) go
        # with the first chunk. The sum stays on the terms' device (no host sync per chunk).
        extra, own = terms[: len(terms) - R], terms[len(terms) - R :]
        total = torch.zeros((), device=own[0].device) if own else torch.zeros(())
        for c, term in zip(chunks, own):
            stage = c.at[-1].stage
            for t in [*extra, term] if c.r == 1 else [term]:
                stage.out(t, torch.ones_like(t))
                total = total + t.detach().to(total.device)
        return total

    def _heads(self, chunks: Sequence[_Chunk], loss_fn: LossFn) -> torch.Tensor:
        J = len(self.moe_blocks)
        ce = torch.zeros((), device=chunks[0].x_BT.device)
        if J and not self.overlap_attention:
            for c in chunks:
                self._wait(c)
        for c in chunks:
            if J and self.overlap_attention:
                self._wait(c)
            with self._span(f"head{c.r}", phase="fwd", chunk=c.r):
                stage = _Stage()
                x = self._tail(stage, c, J)
                for dense in self.dense_after:
                    x = dense(x)
                loss = loss_fn(self.model.head(x), c.y_BT)  # type: ignore[operator]
                weighted = loss * c.weight
                stage.out(weighted, torch.ones_like(weighted))
                c.head = stage
            ce = ce.to(loss.device) + weighted.detach()
        return ce

    # ---- backward -------------------------------------------------------------------------

    def _backward(self, chunks: Sequence[_Chunk]) -> None:
        J = len(self.moe_blocks)
        rev = list(reversed(chunks))
        if not J:
            assert self.pool is not None  # internal: only run() calls
            self.pool.end_all_to_alls()
        _hold_root(self.model, True)
        try:
            self._backward_stages(rev, J)
        finally:
            _hold_root(self.model, False)

    def _backward_stages(self, rev: list[_Chunk], J: int) -> None:
        # The head stages, then for each MoE block from the last: experts, then attention.
        # The last root call's backward (the last chunk's embed in block 0's attention stage,
        # or its head without MoE blocks) reduces the root's gradients: _hold_root.
        for c in rev:
            with self._span(f"head{c.r}", phase="bwd", chunk=c.r):
                assert c.head is not None
                if not J and c is rev[-1]:
                    _hold_root(self.model, False)
                grads = c.head.backward()
                c.head = None
            if J:
                self._hand_back(c, J, grads, issue=self.overlap_attention)
        for j in reversed(range(J)):
            blk = self.moe_blocks[j][0]
            if not self.overlap_attention:
                for c in rev:
                    self._a2a(c, j, "C", c.received, fwd=False)  # type: ignore[arg-type]
            for c in rev:
                g = self._wait(c)
                with self._span(f"E{c.r}.{blk}", phase="bwd", block=blk, chunk=c.r):
                    stage = c.experts.pop()
                    stage.set_grad(0, g)
                    rows_grad = stage.backward()["rows"]
                self._a2a(c, j, "D", rows_grad, fwd=False)
            finish = self._run_of(j).finish_backward
            if finish is not None:  # while the D gradients travel
                with self._span(f"G.{blk}", "gather", phase="bwd", block=blk):
                    finish()
            self.runs[j] = None  # what it held for the chunks' backward is no longer needed
            if j == 0:
                self.pool.end_all_to_alls()  # type: ignore[union-attr]
            if not self.overlap_attention:
                for c in rev:
                    self._wait(c)
            for c in rev:
                if self.overlap_attention:
                    self._wait(c)
                at = c.at.pop()
                at.stage.set_grad(at.i_rows, c.received)  # type: ignore[arg-type]
                if j == 0 and c is rev[-1]:
                    _hold_root(self.model, False)
                with self._span(f"AT{c.r}.{blk}", phase="bwd", block=blk, chunk=c.r):
                    grads = at.stage.backward()
                if j > 0:
                    self._hand_back(c, j, grads, issue=self.overlap_attention)

    def _hand_back(self, c: _Chunk, j: int, grads: dict[str, torch.Tensor], *, issue: bool):
        """A stage's leaf gradients to MoE block j - 1: residual and weights to its AT stage,
        the received rows' gradient to the combine all-to-all back (issued now or later)."""
        prev = c.at[j - 1]
        prev.stage.set_grad(prev.i_x, grads["x"])
        prev.stage.set_grad(prev.i_w, grads["w"])
        if issue:
            self._a2a(c, j - 1, "C", grads["rows"], fwd=False)
        else:
            c.received = grads["rows"]  # issued by the block's barrier

    # ---- communication --------------------------------------------------------------------

    def _dispatch(self, c: _Chunk, j: int) -> None:
        self._a2a(c, j, "D", c.at[j].rows, fwd=True)

    def _a2a(self, c: _Chunk, j: int, kind: str, rows: torch.Tensor, *, fwd: bool) -> None:
        """Issue chunk c's ``kind`` all-to-all of MoE block j: rows forward, or gradients back.

        Dispatch (D) sends ``in_splits`` rows and receives ``out_splits``; combine (C) the
        reverse; the gradient of either goes the other way.
        """
        blk, _, layer = self.moe_blocks[j]
        assert self.pool is not None  # internal: only run() issues
        send, recv = c.at[j].handle.splits(_KINDS[kind], forward=fwd)
        rows = rows.detach().contiguous()
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        phase = "fwd" if fwd else "bwd"
        c.pending = self.pool.all_to_all(
            out,
            rows,
            recv,
            send,
            group=layer.exchange_strategy().exchange_group,
            name=f"{kind}{c.r}.{blk}",
            phase=phase,
            block=blk,
            chunk=c.r,
        )

    def _wait(self, c: _Chunk) -> torch.Tensor:
        """Wait for chunk c's all-to-all in flight; its rows (also kept in ``c.received``)."""
        assert c.pending is not None  # internal: the schedule waits only what it issued
        c.received, c.pending = c.pending.wait(), None
        return c.received
