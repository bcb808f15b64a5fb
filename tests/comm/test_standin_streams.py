"""The device-stream branches (what NCCL takes) run on CPU through ``comm.streams``' stand-in
(issue 49, "the device branches run in CI").

With ``MOESAIC_STANDIN_STREAMS=1`` a gloo world on CPU takes every branch an NCCL world takes:
``EPGroup.on_stream`` is true, so ``Pending.wait`` is a stream wait (``Streams.wait_work``),
completion callbacks fire at issue, the pool times its all-to-all and chunk spans with events,
and HybridEP's prefetch is enqueued from the calling thread on a side stream that the forward
waits for (``ExpertPrefetcher._run_on_stream``, ``HybridStrategy._gathered``).

Each rank trains every schedule x every strategy it runs (``supports``: taskflow runs vanilla
only) for 3 AdamW steps twice in one process, on the plain gloo path and through the stand-in,
from the same seed and batches, on 2 ranks at EP 2 and on 4 ranks at EP 4 (hybrid with expert
domains of 2 there: level, prefetch and row groups all distinct). Compared:

* every step's gradients, as the optimizer sees them, and the losses: **bitwise**. The stand-in
  changes where work is issued from and how it is waited for (the prefetch on the calling
  thread instead of a worker, a stream wait instead of a host wait), never the arithmetic or
  its order (each collective reduces the same tensors on the same ranks in the same group), so
  any difference is a defect of the device branch (as 3bca125's prefetch, whose gradients went
  missing there);
* the collectives (``record_collectives``): on every communicator the same sequence as the
  gloo path's, and for every pair of ranks one order across the communicators both hold
  (``test_collective_order.assert_same_order``, NCCL's requirement), construction included;
* the trace spans (resource, name) of each path: the event-timed spans of the stand-in name the
  same transfers as the gloo path's completion callbacks;
* the stand-in's own log (``record_streams``): the branches really ran (stream waits for
  collectives; events for the pool's spans; the prefetch's side stream for hybrid), and
  nothing went through it on the gloo path;
* no stream hazard (``record_streams(check_hazards=True)`` on the stand-in runs): no kernel
  read on one stream what another wrote before waiting for it. A prefetch missing either of
  its waits is refused (``test_hazard_check_catches_a_prefetch_without_its_waits``), so the
  bitwise equality above is not the host's strict order hiding a missing device wait.
"""

from __future__ import annotations

import collections
import functools
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_collective_order import assert_same_order

from moesaic.comm.collectives import CollectiveError, EPGroup, record_collectives
from moesaic.comm.streams import (
    ENV_VAR,
    HostStream,
    HostStreams,
    StreamHazardError,
    device_streams,
    record_streams,
    standin_streams_enabled,
)
from moesaic.comm.world import run_world
from moesaic.models import MoEGPT, MoEGPTConfig
from moesaic.schedule import make_step, schedule_names
from moesaic.schedule.base import StepParts
from moesaic.strategies import get_strategy, strategy_names
from moesaic.trace import Recorder

B, T, R, STEPS = 4, 8, 2, 3
SP = 4096  # the pool's chunk bytes: the replicated gradients leave in several chunks


def _runs(strategy: str, schedule: str) -> bool:
    """What the strategy declares it runs under (``MoEStrategy.supports``)."""
    return get_strategy(strategy).supports.runs_under(schedule)


CASES = [(sc, st) for sc in schedule_names() for st in strategy_names() if _runs(st, sc)]


# Strategy options per (strategy, EP): hybrid at EP 4 gathers in pairs and sends rows across
# them (at EP 2 its default domain, the whole group: gathers only).
OPTIONS: dict[tuple[str, int], dict[str, Any]] = {("hybrid", 4): {"domain_sizes": [2]}}


def _config(strategy: str, ep: int) -> MoEGPTConfig:
    moe: dict[str, Any] = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16}
    moe.update(dispatcher=strategy, aux_loss_coef=0.01)
    if (strategy, ep) in OPTIONS:
        moe["options"] = OPTIONS[(strategy, ep)]
    return MoEGPTConfig.from_dict(
        {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": T, "moe": moe}
    )


def _lm_loss(logits_BTV, y_BT):
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())


def _train(layout, schedule: str, strategy: str, ep: int, batches, rank: int) -> dict:
    """Construction and 3 optimizer steps: each step's gradients, losses, collectives, the
    stand-in's stream log and the trace spans."""
    from moesaic.strategies.prefetch import ExpertPrefetcher
    from moesaic.train.hooks import ModelHooks
    from moesaic.train.parallel import GradientSync

    recorder = Recorder(rank)
    # (any thread, construction to the last step; on the stand-in, every read of what another
    # stream wrote must come after a wait for it)
    with record_streams(check_hazards=standin_streams_enabled()) as streams_log:
        with record_collectives() as log:
            torch.manual_seed(0)
            model = MoEGPT(_config(strategy, ep), ep_group=layout.ep_group)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            grads: list[dict[str, torch.Tensor | None]] = []

            def keep(_opt: Any, _args: Any, _kwargs: Any) -> None:
                grads.append(
                    {
                        n: None if p.grad is None else p.grad.clone()
                        for n, p in model.named_parameters()
                    }
                )

            optimizer.register_step_pre_hook(keep)
            hooks = ModelHooks(model, recorder=recorder).attach(optimizer)
            parts = StepParts(
                model=model,
                loss_fn=_lm_loss,
                grad_sync=GradientSync(layout),
                optimizer=optimizer,
                pipeline_degree=R,  # (a schedule that does not pipeline ignores it)
                ar_chunk_bytes=SP,
                recorder=recorder,
            )
            step = make_step(schedule, parts)
        prefetchers = [h for h in hooks.hooks if isinstance(h, ExpertPrefetcher) and h.layers]
        logs, losses = [list(log)], []
        for x_BT in batches:
            with record_collectives() as log:
                result = step.run(x_BT[:, :-1], x_BT[:, 1:])
                assert result.applied
                for prefetcher in prefetchers:  # its gathers (gloo: a thread) are this step's
                    prefetcher.wait()
            logs.append(list(log))
            losses.append(float(result.ce))
        if hasattr(step, "close"):
            step.close()
        hooks.close()
    spans = collections.Counter((s.resource, s.name) for s in recorder.events)
    return {
        "grads": grads,
        "losses": losses,
        "logs": logs,
        "streams": [e[:2] for e in streams_log],
        "spans": spans,
        "prefetching": bool(prefetchers),
    }


def _world(rank: int, world_size: int) -> dict:
    from moesaic.train.parallel import build_layout

    ep = world_size
    layout = build_layout(ep, 60.0)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    batches = [torch.randint(0, 256, (B, T + 1), generator=gen) for _ in range(STEPS)]
    out = {}
    for schedule, strategy in CASES:
        for path in ("gloo", "standin"):
            if path == "standin":
                os.environ[ENV_VAR] = "1"
            try:
                out[(schedule, strategy, path)] = _train(
                    layout, schedule, strategy, ep, batches, rank
                )
            finally:
                os.environ.pop(ENV_VAR, None)
    return out


@functools.cache
def _results(world_size: int) -> list[dict]:
    assert ENV_VAR not in os.environ  # the gloo path must be the plain one
    return run_world(_world, world_size, timeout_s=400.0)


def _ids() -> list[str]:
    return [f"{sc}-{st}" for sc, st in CASES]


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize(("schedule", "strategy"), CASES, ids=_ids())
def test_standin_trains_like_gloo(ep, schedule, strategy):
    """3 steps through the stand-in: gradients and losses bitwise the gloo path's, every
    parameter's gradient present in every step."""
    for rank, results in enumerate(_results(ep)):
        want, got = results[(schedule, strategy, "gloo")], results[(schedule, strategy, "standin")]
        assert len(got["grads"]) == STEPS
        assert got["losses"] == want["losses"], rank
        for s in range(STEPS):
            assert got["grads"][s].keys() == want["grads"][s].keys()
            for name, g in want["grads"][s].items():
                assert g is not None, f"rank {rank} step {s}: {name} has no gradient"
                assert got["grads"][s][name] is not None, f"rank {rank} step {s}: {name}"
                assert torch.equal(got["grads"][s][name], g), f"rank {rank} step {s}: {name}"


def _by_communicator(log) -> dict[tuple[Any, str], list[tuple[Any, ...]]]:
    out: dict[tuple[Any, str], list[tuple[Any, ...]]] = collections.defaultdict(list)
    for ranks, lane, op, what in log:
        out[(ranks, lane)].append((op, what))
    return dict(out)


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize(("schedule", "strategy"), CASES, ids=_ids())
def test_standin_keeps_the_collective_order(ep, schedule, strategy):
    """Construction and every step: on each communicator the stand-in issues the gloo path's
    sequence; across ranks one order on the communicators each pair shares."""
    results = _results(ep)
    for s in range(STEPS + 1):
        logs = [r[(schedule, strategy, "standin")]["logs"][s] for r in results]
        assert_same_order(logs, f"stand-in step {s}")
        for rank, r in enumerate(results):
            want = _by_communicator(r[(schedule, strategy, "gloo")]["logs"][s])
            assert _by_communicator(logs[rank]) == want, f"rank {rank} step {s}"
    assert any(log for r in results for log in r[(schedule, strategy, "standin")]["logs"][1:])


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize(("schedule", "strategy"), CASES, ids=_ids())
def test_standin_takes_the_device_branches(ep, schedule, strategy):
    """The stand-in's log shows the device branches ran (and the gloo path never touched it);
    its event-timed spans name the same transfers as the gloo path's callbacks."""
    for r in _results(ep):
        want, got = r[(schedule, strategy, "gloo")], r[(schedule, strategy, "standin")]
        assert want["streams"] == []
        kinds = collections.Counter(entry[0] for entry in got["streams"])
        assert kinds["wait_work"] > 0, kinds  # every host wait became a stream wait
        # The pool's transfers across ranks (row all-to-alls on the rows lane, gradient chunks
        # on the grad lane): a start and an end event each (their spans' times).
        ops = collections.Counter(e[1:3] for log in got["logs"][1:] for e in log)
        chunks = sum(c for (res, name), c in got["spans"].items() if _chunk(res, name))
        assert chunks == ops[("grad", "all_reduce")]
        transfers = ops[("rows", "all_to_all")] + ops[("grad", "all_reduce")]
        assert kinds["record"] >= 2 * transfers, (kinds, ops)
        if got["prefetching"]:  # hybrid's prefetch on its side stream, the forward waiting
            assert kinds["wait_stream"] == STEPS, kinds
            assert kinds["wait_event"] == 2 * (STEPS - 1)  # 2 layers, each forward but the 1st
            assert kinds["record_stream"] > 0
        assert got["spans"] == want["spans"]


def _chunk(resource: str, name: str) -> bool:
    """A span of the pool's gradient chunks (``schedule/pool.py``: "AR<k>")."""
    return resource == "allreduce" and name.startswith("AR")


# ---- the stand-in itself ----------------------------------------------------------------------


def test_device_streams_is_chosen_by_the_switch(monkeypatch):
    """A CPU has device streams only with the switch on; it is read on every call."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert not standin_streams_enabled()
    with pytest.raises(ValueError, match=rf"{ENV_VAR}=1"):
        device_streams(torch.device("cpu"))
    monkeypatch.setenv(ENV_VAR, "1")
    assert isinstance(device_streams(torch.device("cpu")), HostStreams)
    assert device_streams(torch.device("cpu")) is device_streams(torch.device("cpu"))
    monkeypatch.setenv(ENV_VAR, "0")
    assert not standin_streams_enabled()


def test_host_streams_keep_issue_order_and_check_waits():
    """Streams are per thread and nest; an event waited for before it was recorded raises;
    elapsed time is the host time between two records; the log is in issue order."""
    streams = HostStreams()
    side = streams.new_stream()
    unrecorded = streams.event()
    with pytest.raises(RuntimeError, match="never recorded"):
        side.wait_event(unrecorded)
    start, end = streams.event(timing=True), streams.event(timing=True)
    start.record()
    side.wait_stream(streams.current())
    with streams.use(side):
        assert streams.current() is side
        torch.ones(1000).sum()
        end.record()
    assert streams.current().name == "main"
    end.wait()
    assert start.query() and end.query()
    assert end.elapsed_time(start) <= 0.0 <= start.elapsed_time(end)
    assert streams.log is not None
    assert [e[:2] for e in streams.log] == [
        ("record", "main"),
        ("wait_stream", "side1"),
        ("record", "side1"),
        ("wait_event", "main"),
    ]
    with pytest.raises(RuntimeError, match="timing=True"):
        streams.event().elapsed_time(end)


def _dead_peer(rank: int, world_size: int) -> str:
    """Rank 0 all-reduces through the stand-in; rank 1 never joins: a CollectiveError under
    the deadline, not a hang."""
    os.environ[ENV_VAR] = "1"
    group = EPGroup(None, timeout_s=1.0)
    if rank == 1:
        return "left"
    x = torch.ones(4)
    assert group.on_stream(x)
    with record_streams() as log:
        try:
            group.all_reduce(x, what="lonely all_reduce")
        except CollectiveError as exc:
            assert log == [("wait_work", "main")]
            return str(exc)
    return "no error"


def test_standin_wait_keeps_the_deadline():
    """A stream wait on the stand-in still ends in a ``CollectiveError`` naming the
    collective (on a device the watchdog has that role; the host must not hang here)."""
    out = run_world(_dead_peer, 2, timeout_s=60.0, pg_timeout_s=5.0)
    assert out[1] == "left"
    assert "lonely all_reduce failed on rank 0/2" in out[0], out[0]
    assert "collective_timeout_s=1" in out[0]


def test_hazard_check_finds_a_read_before_its_wait(monkeypatch):
    """A kernel on the main stream reading what a side stream wrote raises until the main
    stream waited for that write: by an event recorded after it, or by ``wait_stream``; an
    event recorded before the write is not enough."""
    monkeypatch.setenv(ENV_VAR, "1")
    streams = device_streams(torch.device("cpu"))
    side = streams.new_stream()
    with record_streams(check_hazards=True):
        early = streams.event()
        early.record(side)
        with streams.use(side):
            x = torch.ones(4) * 2
        with pytest.raises(StreamHazardError, match=rf"stream main reads .* stream {side.name}"):
            x + 1
        early.wait()
        with pytest.raises(StreamHazardError):
            x + 1
        ready = streams.event()
        ready.record(side)
        ready.wait()
        assert torch.equal(x + 1, torch.full((4,), 3.0))
        with streams.use(side):
            y = x * 3  # the side stream reads its own writes: no wait needed
        streams.current().wait_stream(side)
        assert torch.equal(y - 1, torch.full((4,), 5.0))


def _broken_prefetch(rank: int, world_size: int, broken: str) -> str:
    """Hybrid at EP 2 under vanilla through the stand-in with the hazard check, its
    prefetcher missing one of its two waits: the forward's wait for the side stream's event,
    or the side stream's wait for the optimizer's update."""
    from moesaic.strategies.prefetch import ExpertPrefetcher
    from moesaic.train.parallel import build_layout

    os.environ[ENV_VAR] = "1"
    if broken == "forward waits":
        run = ExpertPrefetcher._run_on_stream

        def without_ready(self, jobs):
            run(self, jobs)
            for _, strategy, _, _ in jobs:
                strategy.prefetch_ready = None

        ExpertPrefetcher._run_on_stream = without_ready  # type: ignore[method-assign]
    elif broken == "side waits":
        HostStream.wait_stream = lambda self, other: None  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, 256, (B, T + 1), generator=gen) for _ in range(2)]
    try:
        _train(build_layout(2, 60.0), "vanilla", "hybrid", 2, batches, rank)
    except StreamHazardError as exc:
        return str(exc)
    return "trained"


@pytest.mark.parametrize("broken", ["nothing", "forward waits", "side waits"])
def test_hazard_check_catches_a_prefetch_without_its_waits(broken):
    """The check is what makes the stand-in's runs above able to fail on a missing wait: a
    prefetch without either wait is refused at the first read of the unwaited-for data (the
    second forward's experts; the side stream's read of the updated weights), and the real
    prefetcher trains."""
    out = run_world(_broken_prefetch, 2, broken, timeout_s=120.0)
    for message in out:
        if broken == "nothing":
            assert message == "trained"
        else:
            writer = "main" if broken == "side waits" else "side"
            assert f"that stream {writer}" in message, message
