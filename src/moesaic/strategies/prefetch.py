"""HybridEP's asynchronous communicator (Fig. 10): every ``hybrid`` layer's expert gathers issued
right after the optimizer step, so they overlap what runs before each layer's next forward.

It is ``hybrid``'s training hooks (``HybridStrategy.training_hooks``): the training loop calls
:meth:`ExpertPrefetcher.after_optimizer_step` after every optimizer step, as it calls every
strategy's hooks, without knowing which strategy it runs. It knows the strategy only through
:class:`PrefetchedExperts` (``hybrid`` imports this module, never the reverse).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from moesaic.comm.streams import device_streams
from moesaic.strategies.base import StrategyHooks
from moesaic.strategies.migration import Gathered, PendingGather
from moesaic.trace import Recorder, maybe_span

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import nn

    from moesaic.comm.collectives import EPGroup
    from moesaic.comm.streams import Streams
    from moesaic.experts import GroupedExperts
    from moesaic.strategies.base import ExpertFn, MoEStrategy

__all__ = ["ExpertPrefetcher", "PrefetchedExperts"]


@runtime_checkable
class PrefetchedExperts(Protocol):
    """What a strategy whose experts the prefetcher gathers provides (``hybrid``): the
    prefetcher takes the layers whose strategy has it and knows nothing else of them."""

    # set by the prefetcher: the event the forward's stream waits for (device streams)
    prefetch_ready: Any

    def weights_updated(self) -> None:
        """An optimizer step changed the weights: gathered copies of the old ones are stale."""
        ...

    def reserve_prefetch(self, experts: GroupedExperts) -> Future[Gathered] | None:
        """A slot for the next gather on every rank alike; None when none is needed."""
        ...

    def prefetch_levels(self) -> list[EPGroup]:
        """The groups the prefetch's gathers run on (made by the first reserve)."""
        ...

    def start_prefetch(self, experts: GroupedExperts) -> PendingGather:
        """Encode and issue the gathers of ``experts`` on ``prefetch_levels``."""
        ...


class ExpertPrefetcher(StrategyHooks):
    """The asynchronous communicator of Fig. 10 for every ``hybrid`` layer of a model (every
    layer whose strategy is :class:`PrefetchedExperts`).

    :meth:`start` (called on every rank at the same point, e.g. right after the optimizer step:
    :meth:`after_optimizer_step`, or :meth:`attach` registers it as a step post-hook) reserves
    one pending gather per layer whose weights changed, in layer order, then returns at once.
    The send queue (encode each layer's experts and issue its all-gather in the ``prefetch``
    lane) and the receive queue (wait each gather and decode it) then run: on gloo in a background thread (gloo lets communicators
    run concurrently, each in one order on every rank); on device streams (NCCL, which needs
    one issue order across communicators) enqueued from the calling thread on a side stream,
    the forward's stream waiting for it only where it takes the experts. Each layer's next
    forward takes its experts from there, waiting only if they have not arrived. The gathers
    thus overlap the forward's pre-expert computation (embedding, attention, earlier layers) and
    the encoding overlaps whatever runs between the optimizer step and the forward.

    Args:
        layers: ``(strategy, experts)`` of the ``hybrid`` layers, in layer order, or a module
            holding them (each module with a ``hybrid`` ``strategy`` and its ``experts``, as an
            ``MoELayer``); other strategies' layers are left out.
        recorder: spans ``encode Lk`` / ``gather Lk`` go to lanes "encode" and "gather".
        streams: enqueue on these streams (``comm.streams``) whatever the groups' backend
            (a test's CPU stand-in ``HostStreams`` runs the NCCL branch on CPU); default: on
            the experts' device streams (``comm.streams.device_streams``: CUDA's, or the CPU
            stand-in under ``MOESAIC_STANDIN_STREAMS=1``) where the groups run on device
            streams, else a thread.
    """

    def __init__(
        self,
        layers: nn.Module | Sequence[tuple[MoEStrategy, ExpertFn]],
        *,
        recorder: Recorder | None = None,
        streams: Streams | None = None,
    ) -> None:
        pairs: list[tuple[Any, Any]] = (
            [(getattr(m, "strategy", None), getattr(m, "experts", None)) for m in layers.modules()]
            if isinstance(layers, torch.nn.Module)
            else list(layers)
        )
        self.layers: list[tuple[PrefetchedExperts, GroupedExperts]] = [
            (s, e) for s, e in pairs if isinstance(s, PrefetchedExperts)
        ]
        self.recorder = recorder
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moesaic-prefetch")
        self._streams = streams
        self._stream: Any = None  # the side stream of device gathers
        self._lock = threading.Lock()
        self._last: Future[None] | None = None

    def attach(self, optimizer: torch.optim.Optimizer) -> ExpertPrefetcher:
        """Start the prefetch after every ``optimizer.step()``; returns self."""

        def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
            self.after_optimizer_step()

        optimizer.register_step_post_hook(hook)
        return self

    def after_optimizer_step(self) -> None:
        """The training hook: tell each layer its weights changed (an explicit count: not
        every optimizer kernel bumps the version counters), then :meth:`start`."""
        for strategy, _ in self.layers:
            strategy.weights_updated()
        self.start()

    def start(self) -> None:
        """Reserve and launch the gathers of every layer whose experts changed (collective)."""
        jobs = []
        for index, (strategy, experts) in enumerate(self.layers):
            fut = strategy.reserve_prefetch(experts)
            if fut is not None:
                jobs.append((index, strategy, experts, fut))
        if jobs and (self._streams is not None or self._on_device(jobs)):
            self._run_on_stream(jobs)
        elif jobs:
            with self._lock:
                self._last = self._pool.submit(self._run, jobs)

    @staticmethod
    def _on_device(
        jobs: list[tuple[int, PrefetchedExperts, GroupedExperts, Future[Gathered]]],
    ) -> bool:
        """Whether the gathers run on device streams (NCCL): then a thread issuing them while
        the main thread issues its own would give each rank another order across
        communicators, which NCCL does not allow."""
        _, strategy, experts, _ = jobs[0]
        return any(g.on_stream(experts.w1) for g in strategy.prefetch_levels())

    def _run_on_stream(
        self, jobs: list[tuple[int, PrefetchedExperts, GroupedExperts, Future[Gathered]]]
    ) -> None:
        """The send and receive queues enqueued from this thread, in layer order, on a side
        stream: encoding, gathers (stream waits) and decoding all run on the device while the
        host goes on to the forward, which waits for the side stream only where it takes the
        experts (``HybridStrategy._gathered``)."""
        if self._streams is None:  # CUDA's, or the CPU stand-in (MOESAIC_STANDIN_STREAMS=1)
            self._streams = device_streams(jobs[0][2].w1.device)
        streams = self._streams
        main = streams.current()
        if self._stream is None:
            self._stream = streams.new_stream()
        self._stream.wait_stream(main)  # the optimizer's update comes first
        with streams.use(self._stream):
            self._run(jobs)
            ready = streams.event()
            ready.record(self._stream)
        for _, strategy, _, fut in jobs:
            if not fut.done() or fut.exception() is not None:
                continue
            tensors, pending = fut.result()
            # Allocated on the side stream, used on the main one: the decoded experts, and the
            # compressed gather's shared experts (kept for the next gathers' encoding).
            for t in (*tensors, *pending.shared):
                if t is not None:
                    streams.record_stream(t, main)
            strategy.prefetch_ready = ready

    def _run(
        self, jobs: list[tuple[int, PrefetchedExperts, GroupedExperts, Future[Gathered]]]
    ) -> None:
        # A context, never the global switch: on device streams this runs on the caller's
        # thread (the optimizer's post-hook), whose next forward must build a graph.
        with torch.no_grad():
            self._run_queues(jobs)

    def _run_queues(
        self, jobs: list[tuple[int, PrefetchedExperts, GroupedExperts, Future[Gathered]]]
    ) -> None:
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
