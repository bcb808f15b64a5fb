"""The concurrent executors (static two-queue workers, dynamic actors) with one-sided puts match
``ReferenceMoE``, forward and backward, at EP 1, 2 and 4, on the cases of the sequential
executor's tests (SwiGLU; GELU with fall-backs and many-to-one events; a skew that leaves ranks
and slots empty). Also: a step that does not fit its bucket is refused before any transfer, a
peer that dies mid-plan is a ``CollectiveError`` within the deadline, and the executors' own
error paths (a failing task, a wait that never ends) surface on the calling thread.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from test_taskflow_exec import CASES, Case, _cfg, _data, check_against_reference, two_rank_inputs

from moesaic.comm.collectives import CollectiveError, EPGroup
from moesaic.placement import ExpertPlacement
from moesaic.routing import Router
from moesaic.taskflow import CompileOptions, ShapeBucket, compile_plan
from moesaic.taskflow.plan import Schedule, TaskGraph
from moesaic.taskflow.runtime.concurrent import TaskflowRuntime
from moesaic.taskflow.runtime.executors import make_counters, run_dynamic, run_static
from moesaic.taskflow.tasks import Event, EventRef, ProducerRef, Region, TaskDescriptor
from moesaic.testing import run_world
from moesaic.trace import Recorder, chrome_trace

N, H, F, E = 24, 16, 12, 8
EXECUTORS = ("static", "dynamic")


def run_case(c: Case, P: int, rank: int, rt: TaskflowRuntime) -> dict[str, torch.Tensor]:
    d, T, e = _data(c), N // P, E // P
    rows, local = slice(rank * T, (rank + 1) * T), slice(rank * e, (rank + 1) * e)
    router = Router(_cfg(c))
    with torch.no_grad():
        router.weight.copy_(d["router"])
    x = d["x"][rows].clone().requires_grad_()
    routing, _ = router(x, ExpertPlacement.contiguous(E, P))
    bucket = rt.bucket(routing, hidden=H, ffn=F, activation=c.activation)
    assert bucket is not None
    fwd_plan, bwd_plan = rt.plans(bucket)
    w3 = d["w3"][local] if c.activation == "swiglu" else None
    w = (d["w1"][local], d["w2"][local], w3)
    fwd = rt.forward(fwd_plan, x.detach(), routing, *w)
    bwd = rt.backward(bwd_plan, d["dy"][rows], routing, fwd.saved, *w)
    gx, grouter = torch.autograd.grad(
        routing.topk_weights_TK, (x, router.weight), bwd.dtopk_weights_TK
    )
    out = {"y": fwd.y_TH.clone(), "dx": bwd.dx_TH + gx, "dw1": bwd.dw1_eHF,
           "dw2": bwd.dw2_eFH, "drouter": grouter}  # fmt: skip
    if w3 is not None:
        out["dw3"] = bwd.dw3_eHF
    return out


def _runtime(c: Case, group: EPGroup, executor: str, recorder=None) -> TaskflowRuntime:
    # the static executor runs the pipelined order (the strategy's default); the dynamic one
    # decides the order itself (the cases' per-direction unsplit options are the sequential
    # executor's tests' business: a runtime has one set of options for both directions)
    options = CompileOptions(pipeline=executor == "static")
    return TaskflowRuntime(group, executor=executor, tile_m=c.tile_m, gmm_tile_m=c.gmm_tile_m,
                           options=options, timeout_s=30, recorder=recorder)  # fmt: skip


def concurrent_world(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    group = EPGroup(None, timeout_s=60)
    results: dict = {}
    for executor in EXECUTORS:
        for c in CASES:
            rt = _runtime(c, group, executor)
            results[executor, c.name] = run_case(c, world, rank, rt)
            # a second step on the same runtime reuses the plans and the window
            again = run_case(c, world, rank, rt)
            assert len(rt._plans) == 1, "a second step of one bucket compiled again"
            for k in again:
                assert torch.equal(again[k], results[executor, c.name][k]), k
    return results


def error_world(rank: int, world: int) -> dict[str, str]:
    """A step that does not fit the bucket; then a peer that dies in the middle of a plan."""
    torch.set_num_threads(1)
    group = EPGroup(None, timeout_s=60)
    x, routing, w = two_rank_inputs(CASES[0], rank)
    rt = TaskflowRuntime(group, tile_m=1, timeout_s=2.0)
    out = {}
    small = ShapeBucket(tokens=12, hidden=H, ffn=F, experts=E, top_k=2, ep_size=2, slot_rows=1,
                        tile_m=1)  # fmt: skip
    sent_before = rt.channel.puts if rt.channel is not None else 0  # made by a first step
    try:
        rt.forward(compile_plan(small, "forward", rank), x, routing, *w)
    except ValueError as exc:
        out["too_big"] = str(exc)
    out["puts_after_refusal"] = str((rt.channel.puts if rt.channel else 0) - sent_before)
    plan = compile_plan(ShapeBucket(tokens=12, hidden=H, ffn=F, experts=E, top_k=2, ep_size=2,
                                    slot_rows=16, tile_m=1), "forward", rank)  # fmt: skip
    if rank == 1:  # joins the step, puts its first tiles, then dies mid-plan
        original = rt.channel.put
        calls = [0]

        def dying_put(*args, **kwargs):
            calls[0] += 1
            if calls[0] > 3:
                os._exit(0)
            original(*args, **kwargs)

        rt.channel.put = dying_put  # type: ignore[method-assign]
    start = time.perf_counter()
    try:
        rt.forward(plan, x, routing, *w)
    except CollectiveError as exc:
        out["dead_peer"] = str(exc)
        out["dead_peer_s"] = f"{time.perf_counter() - start:.2f}"
    return out


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_ep1_matches_reference(case, executor):
    rec = Recorder()
    rt = _runtime(case, EPGroup(None, timeout_s=10), executor, rec)
    check_against_reference(case.name, [run_case(case, 1, 0, rt)])
    lanes = {s.resource for s in rec.events}
    assert lanes == ({"matrix", "vector"} if executor == "static" else {"processor0", "processor1"})
    # the Chrome trace has one track per queue (or processor) of the rank
    tracks = {e["args"]["name"] for e in chrome_trace([rec.events])["traceEvents"]
              if e.get("ph") == "M" and e["name"] == "thread_name"}  # fmt: skip
    assert lanes <= tracks
    plans = rt.plans(next(iter(rt._plans)))
    assert len(rec.events) == sum(len(p.tasks) for p in plans)  # every task ran, once


@pytest.mark.parametrize("world", [2, 4])
def test_ep_worlds_match_reference(world):
    per_rank = run_world(concurrent_world, world, timeout_s=240)
    for executor in EXECUTORS:
        for c in CASES:
            check_against_reference(c.name, [r[executor, c.name] for r in per_rank])


def test_refusal_and_dead_peer():
    err, dead = run_world(error_world, 2, timeout_s=120, allow_dead=True)
    assert dead is None  # rank 1 died mid-plan
    assert "more than the bucket's slot_rows" in err["too_big"]
    assert err["puts_after_refusal"] == "0"  # refused before any transfer
    # rank 0 gets a CollectiveError within the 2 s deadline (plus a little), not a hang
    assert "dead_peer" in err, err
    assert float(err["dead_peer_s"]) < 8


def _chain(n: int) -> tuple[TaskGraph, Schedule]:
    """A 2-queue graph: n tiles A on 'vector' each releasing tile B on 'matrix'."""

    tasks, events = [], []
    for i in range(n):
        r = Region(buffer="x", rank=0, start=i, stop=i + 1)
        events.append(
            Event(id=i, threshold=1, producers=(ProducerRef(rank=0, op="a", task_index=i),))
        )
        tasks.append(TaskDescriptor(uid=2 * i, op="a", task_type="a", task_index=i, split_num=n,
                                    split_value=1, dependent_event=-1, inputs=(r,), outputs=(r,),
                                    trigger_events=(EventRef(rank=0, event=i),)))  # fmt: skip
        tasks.append(TaskDescriptor(uid=2 * i + 1, op="b", task_type="b", task_index=i,
                                    split_num=n, split_value=1, dependent_event=i, inputs=(r,),
                                    outputs=(r,), trigger_events=()))  # fmt: skip
    graph = TaskGraph(buffers=(), tasks=tuple(tasks), events=tuple(events), remote_writes=(),
                      task_num={"a": n, "b": n})  # fmt: skip
    sched = Schedule(executor="two_queue", queues=(("matrix", tuple(range(1, 2 * n, 2))),
                                                    ("vector", tuple(range(0, 2 * n, 2)))))  # fmt: skip
    return graph, sched


@pytest.mark.parametrize("run", [run_static, run_dynamic])
def test_executors_order_and_errors(run):
    graph, sched = _chain(50)
    seen: list[int] = []
    run(graph, sched, 0, lambda t: seen.append(t.uid), make_counters(graph, 0), timeout_s=5)
    assert sorted(seen) == list(range(100))
    for i in range(50):  # never a B tile before its A tile
        assert seen.index(2 * i) < seen.index(2 * i + 1)

    def failing(t):
        if t.uid == 7:
            raise RuntimeError("tile 7 broke")

    with pytest.raises(RuntimeError, match="tile 7 broke"):
        run(graph, sched, 0, failing, make_counters(graph, 0), timeout_s=5)
    # a B tile whose event never fires (its A tile 'lost'): a CollectiveError, not a hang
    counters = make_counters(graph, 0)
    start = time.perf_counter()
    lost = Schedule(executor="two_queue", queues=(("matrix", (1,)), ("vector", ())))
    with pytest.raises(CollectiveError):
        run(graph, lost, 0, lambda t: None, counters, timeout_s=0.5)
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("run", [run_static, run_dynamic])
def test_interrupted_caller_stops_its_workers(run):
    # Ctrl-C while the calling thread waits for the workers (it hung `bench layer` at EP 1): the
    # run raises KeyboardInterrupt at once and leaves no worker waiting out its 20 s deadline.
    graph, _ = _chain(2)
    stuck = Schedule(executor="two_queue", queues=(("matrix", ()), ("vector", (1,))))
    main = threading.main_thread().ident
    assert threading.current_thread().ident == main and main is not None
    # Python's own Ctrl-C handler for the test's length: an earlier test of the session may
    # have left SIGINT ignored (a training worker's entry point ignores it before it exits).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
    start = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run(graph, stuck, 0, lambda t: None, make_counters(graph, 0), timeout_s=20)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert time.perf_counter() - start < 10

    def workers() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("moesaic-")]

    while workers() and time.perf_counter() - start < 10:  # a finished worker is gone at once
        time.sleep(0.01)
    assert not workers()


def layer_world(rank: int, world: int) -> list[str]:
    """The taskflow strategy's byte accounting equals the group's traffic on a bucket's first
    step (which runs the fingerprint check) and on the next ones (which do not)."""
    import moesaic

    torch.set_num_threads(1)
    cfg = moesaic.MoEConfig(
        hidden_size=H,
        ffn_hidden_size=F,
        num_experts=E,
        dispatcher="taskflow",
        options={"tile_m": 64},
    )
    torch.manual_seed(0)
    layer = moesaic.MoELayer(cfg)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(rank))
    seen = []
    for step in range(3):
        before = layer.ep.traffic.snapshot()
        y = layer(x.clone().requires_grad_())
        after = layer.ep.traffic.snapshot()
        y.sum().backward()
        stats = layer.take_stats().comm
        assert list(stats.peer_bytes_P) == [b - a for a, b in zip(before[0], after[0])], step
        assert stats.collectives == after[1] - before[1], step
        seen.append(f"{step}:{stats.collectives}")
    return seen


def test_layer_accounting_on_first_and_later_steps():
    per_rank = run_world(layer_world, 2, timeout_s=120)
    first, second, third = (int(s.split(":")[1]) for s in per_rank[0])
    assert first == second + 1 == third + 1  # only the first step runs the fingerprint check


def test_inference_keeps_no_activations(monkeypatch):
    """Under no_grad the forward plan keeps nothing for a backward that cannot run (no copy of
    the window); with autograd on it keeps them, and the output is the same bit for bit."""
    import moesaic
    from moesaic.taskflow.runtime import concurrent

    kept: list[int] = []
    real = concurrent.TaskflowRuntime.forward

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        kept.append(len(out.saved))
        return out

    monkeypatch.setattr(concurrent.TaskflowRuntime, "forward", spy)
    cfg = moesaic.MoEConfig(
        hidden_size=H,
        ffn_hidden_size=F,
        num_experts=E,
        dispatcher="taskflow",
        options={"tile_m": 4},
    )
    torch.manual_seed(0)
    layer = moesaic.MoELayer(cfg)
    x = torch.randn(10, H)
    with torch.no_grad():
        y0 = layer(x)
    y1 = layer(x)
    assert kept == [0, 4] and torch.equal(y0, y1.detach())
