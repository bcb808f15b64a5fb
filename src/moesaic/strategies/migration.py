"""HybridEP's expert migration (§IV-B): SR-encoded expert all-gathers and the asynchronous
communicator of Fig. 10.

Shape legend: e local experts, S ranks of the expert domain, X the shape of one expert weight
(H x F or F x H), N = numel(X), k kept residual entries, B bytes of one encoded expert.

Wire format of one weight matrix's ``e`` local experts (what the domain all-gather sends):

* dense (``CR = 1``, or ``k >= N``): the weights themselves ``[e, *X]``, bit-exact;
* sparse: ``[e, B]`` uint8, each row ``k`` residual values (the weight dtype) then their ``k``
  flat positions (int32, ascending), ``B = k * (value bytes + 4)``: the value-index form of
  :mod:`moesaic.placement.compress`, batched over the experts (same kept count, index dtype and
  top-k rule, tested equal to ``sr_encode``/``sr_decode`` per expert).

The shared expert is the mean of the domain's experts (an all-reduce over the domain, issued just
before the gather, on the same group): encoder and decoder must use the same one, and a domain's
mean is closer to its experts than the mean over all ranks. The paper keeps one shared expert for
all ranks, synchronised every iteration; per domain costs the same all-reduce and needs no
other group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from moesaic.comm.collectives import EPGroup
from moesaic.placement.compress import kept_entries
from moesaic.trace import Recorder, maybe_span

if TYPE_CHECKING:
    from torch import nn

    from moesaic.experts import GroupedExperts
    from moesaic.strategies.hybrid import HybridStrategy

__all__ = ["ExpertPrefetcher", "PendingGather", "decode_experts", "encode_experts", "start_gather"]

Weights = tuple[torch.Tensor | None, ...]
Gathered = tuple[Weights, "PendingGather"]  # decoded experts, and what their gathers sent


def encode_experts(
    w_eX: torch.Tensor, shared_X: torch.Tensor | None, compression_ratio: float
) -> torch.Tensor:
    """The wire form of ``e`` experts of one weight matrix (see the module docstring)."""
    e, N = w_eX.shape[0], w_eX[0].numel()
    k = kept_entries(N, compression_ratio)
    if k >= N or shared_X is None:
        return w_eX.detach().contiguous()
    residual_eN = (w_eX.detach() - shared_X).reshape(e, N)
    idx_ek = torch.topk(residual_eN.abs(), k, dim=1, sorted=False).indices
    idx_ek, _ = torch.sort(idx_ek, dim=1)
    values_ek = residual_eN.gather(1, idx_ek)
    value_bytes = values_ek.contiguous().view(torch.uint8).reshape(e, -1)
    index_bytes = idx_ek.to(torch.int32).contiguous().view(torch.uint8).reshape(e, -1)
    return torch.cat([value_bytes, index_bytes], dim=1)


def decode_experts(
    payload: torch.Tensor,
    shared_X: torch.Tensor | None,
    shape_X: Sequence[int],
    dtype: torch.dtype,
    compression_ratio: float,
) -> torch.Tensor:
    """Gathered wire rows ``[S*e, ...]`` -> the experts ``[S*e, *X]`` (shared + residual)."""
    rows, N = payload.shape[0], 1
    for d in shape_X:
        N *= d
    k = kept_entries(N, compression_ratio)
    if k >= N or shared_X is None:
        return payload
    value_len = k * torch.empty((), dtype=dtype).element_size()
    values_rk = payload[:, :value_len].contiguous().view(dtype)
    idx_rk = payload[:, value_len:].contiguous().view(torch.int32).long()
    out_rN = shared_X.reshape(1, N).expand(rows, N).clone()
    out_rN.scatter_add_(1, idx_rk, values_rk)
    return out_rN.reshape(rows, *shape_X)


def _shared_experts(
    weights: Weights, groups: Sequence[EPGroup]
) -> tuple[list[torch.Tensor | None], int]:
    """The mean expert of the domain per weight matrix (the sum all-reduced over each level's
    group in turn covers the domain), and the all-reduce message's bytes."""
    present = [w.detach() for w in weights if w is not None]
    sums = torch.cat([w.sum(dim=0).reshape(-1) for w in present])
    count = present[0].shape[0]
    for g in groups:
        g.all_reduce(sums, what="hybrid shared-expert all_reduce")
        count *= g.size
    out: list[torch.Tensor | None] = []
    offset = 0
    for w in weights:
        if w is None:
            out.append(None)
            continue
        n = w[0].numel()
        out.append((sums[offset : offset + n] / count).reshape(w.shape[1:]).to(w.dtype))
        offset += n
    return out, sums.numel() * sums.element_size()


@dataclass(slots=True)
class PendingGather:
    """Issued all-gathers of one layer's experts; :meth:`result` waits and decodes them.

    Attributes:
        level_bytes: per level group, the bytes this rank sent to each other member (the
            encoded bundle so far, plus the shared experts' all-reduce message when compressed).
        collectives: collectives issued (the shared-expert all-reduces and the gathers).
        shared: the shared experts the bundle was encoded against (None entries: dense).
    """

    finish: Callable[[], Weights]
    level_bytes: list[int]
    collectives: int
    shared: list[torch.Tensor | None]

    def result(self) -> Weights:
        return self.finish()


def start_gather(
    weights: Weights,
    groups: Sequence[EPGroup],
    compression_ratio: float,
    name: str = "experts",
    shared: list[torch.Tensor | None] | None = None,
) -> PendingGather:
    """Encode the local experts and gather them over the domain, level by level.

    Level ``l``'s group gathers the bundles its members hold after the outer levels, so the
    slowest (outermost) links carry the smallest bundles (the cost model's rule). The first
    level's gathers are issued here; :meth:`PendingGather.result` waits them, runs the inner
    levels (each needs the previous one's result) and decodes.

    Args:
        weights: the local expert weights ``[e, *X]`` (w1, w3, w2; None where absent).
        groups: one group per level with a domain size above 1, outermost first.
        compression_ratio: SR compression ratio (1: exact).
        name: names the collectives in errors.
        shared: the shared experts to encode against (every member must pass the same); None
            computes them (an all-reduce per level). Unused when not compressed.
    """
    with torch.no_grad():
        numel = next(w for w in weights if w is not None)[0].numel()
        sparse = kept_entries(numel, compression_ratio) < numel
        shared_bytes = 0
        if not sparse:
            shared = [None] * len(weights)
        elif shared is None:
            shared, shared_bytes = _shared_experts(weights, groups)
        payloads = [
            None if w is None else encode_experts(w, sh, compression_ratio)
            for w, sh in zip(weights, shared)
        ]
        bundle = sum(p.numel() * p.element_size() for p in payloads if p is not None)
        level_bytes, factor = [], 1
        for g in groups:
            level_bytes.append(bundle * factor + shared_bytes)
            factor *= g.size
        first = [
            None if p is None else groups[0].start_all_gather_dim0(p, f"hybrid gather of {name}")
            for p in payloads
        ]

    def finish() -> Weights:
        out: list[torch.Tensor | None] = []
        with torch.no_grad():
            for w, sh, got in zip(weights, shared, first):
                if w is None or got is None:
                    out.append(None)
                    continue
                buffer, wait = got
                wait()
                for g in groups[1:]:
                    buffer = g.all_gather_dim0(buffer, f"hybrid gather of {name}")
                out.append(
                    decode_experts(buffer, sh, tuple(w.shape[1:]), w.dtype, compression_ratio)
                )
        return tuple(out)

    per_level = sum(p is not None for p in payloads) + (1 if shared_bytes else 0)
    return PendingGather(finish, level_bytes, per_level * len(groups), shared)


class ExpertPrefetcher:
    """The asynchronous communicator of Fig. 10 for every ``hybrid`` layer of a model.

    :meth:`start` (called on every rank at the same point, e.g. right after the optimizer step:
    :meth:`attach` registers it as a step post-hook) reserves one pending gather per layer whose
    weights changed, in layer order, then returns at once. The send queue (encode each layer's
    experts and issue its all-gather in the ``prefetch`` lane) and the receive queue (wait each
    gather and decode it) then run: on gloo in a background thread (gloo lets communicators
    run concurrently, each in one order on every rank); on device streams (NCCL, which needs
    one issue order across communicators) enqueued from the calling thread on a side stream,
    the forward's stream waiting for it only where it takes the experts. Each layer's next
    forward takes its experts from there, waiting only if they have not arrived. The gathers
    thus overlap the forward's pre-expert computation (embedding, attention, earlier layers) and
    the encoding overlaps whatever runs between the optimizer step and the forward.

    Args:
        model: a module holding ``MoELayer``\\ s whose dispatcher is ``hybrid``.
        recorder: spans ``encode Lk`` / ``gather Lk`` go to lanes "encode" and "gather".
    """

    def __init__(self, model: nn.Module, *, recorder: Recorder | None = None) -> None:
        from moesaic.layer import MoELayer
        from moesaic.strategies.hybrid import HybridStrategy

        self.layers: list[tuple[HybridStrategy, GroupedExperts]] = [
            (m.strategy, m.experts)
            for m in model.modules()
            if isinstance(m, MoELayer) and isinstance(m.strategy, HybridStrategy)
        ]
        self.recorder = recorder
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moesaic-prefetch")
        self._stream: Any = None  # the side stream of device gathers
        self._lock = threading.Lock()
        self._last: Future[None] | None = None

    def attach(self, optimizer: torch.optim.Optimizer) -> ExpertPrefetcher:
        """Start the prefetch after every ``optimizer.step()``; returns self."""

        def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
            self.start()

        optimizer.register_step_post_hook(hook)
        return self

    def start(self) -> None:
        """Reserve and launch the gathers of every layer whose experts changed (collective)."""
        jobs = []
        for index, (strategy, experts) in enumerate(self.layers):
            fut = strategy.reserve_prefetch(experts)
            if fut is not None:
                jobs.append((index, strategy, experts, fut))
        if jobs and self._on_device(jobs):
            self._run_on_stream(jobs)
        elif jobs:
            with self._lock:
                self._last = self._pool.submit(self._run, jobs)

    @staticmethod
    def _on_device(
        jobs: list[tuple[int, HybridStrategy, GroupedExperts, Future[Gathered]]],
    ) -> bool:
        """Whether the gathers run on device streams (NCCL): then a thread issuing them while
        the main thread issues its own would give each rank another order across
        communicators, which NCCL does not allow."""
        _, strategy, experts, _ = jobs[0]
        return any(g.on_stream(experts.w1) for g in strategy.prefetch_levels)

    def _run_on_stream(
        self, jobs: list[tuple[int, HybridStrategy, GroupedExperts, Future[Gathered]]]
    ) -> None:
        """The send and receive queues enqueued from this thread, in layer order, on a side
        stream: encoding, gathers (stream waits) and decoding all run on the device while the
        host goes on to the forward, which waits for the side stream only where it takes the
        experts (``HybridStrategy._gathered``)."""
        main = torch.cuda.current_stream()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(main)  # the optimizer's update comes first
        with torch.cuda.stream(self._stream):
            self._run(jobs)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        for _, strategy, _, fut in jobs:
            if not fut.done() or fut.exception() is not None:
                continue
            tensors, _pending = fut.result()
            for t in tensors:
                if t is not None:
                    t.record_stream(main)  # allocated on the side stream, used on the main one
            strategy.prefetch_ready = ready

    def _run(
        self, jobs: list[tuple[int, HybridStrategy, GroupedExperts, Future[Gathered]]]
    ) -> None:
        torch.set_grad_enabled(False)
        issued = []
        for index, strategy, experts, fut in jobs:  # send queue: encode + issue, layer order
            try:
                with maybe_span(self.recorder, "encode", f"encode L{index}"):
                    pending = strategy.start_prefetch(experts)
                issued.append((index, fut, pending, time.perf_counter()))
            except BaseException as exc:
                fut.set_exception(exc)
        for index, fut, pending, start_s in issued:  # receive queue: wait + decode
            try:
                result = pending.result()
                if self.recorder is not None:
                    self.recorder.add(
                        "gather",
                        f"gather L{index}",
                        start_s,
                        self.recorder.now(),
                        bytes=sum(pending.level_bytes),
                    )
                fut.set_result((result, pending))
            except BaseException as exc:
                fut.set_exception(exc)

    def wait(self) -> None:
        """Block until the launched prefetches are done (errors surface in the forwards)."""
        with self._lock:
            last = self._last
        if last is not None:
            last.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ExpertPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
