"""CommPool (FlowMoE Alg. 2) on 2-rank gloo worlds: averaged gradients, chunk boundaries, the
priority rule (read from the recorded spans and the recorded issue order), and deadlines.

Each world runs several checks in one spawn (a spawn costs ~2 s on this machine): the
equivalence, priority, tail, late-tail and clone workers share one world; the workers return plain data
and the assertions run here.
"""

from __future__ import annotations

import functools
import math
import os
import time

import pytest
import torch
from torch import nn

from moesaic.comm.collectives import CollectiveError, record_collectives
from moesaic.comm.world import run_world
from moesaic.schedule.pool import CommPool
from moesaic.trace import Recorder
from moesaic.train.parallel import GradientSync, build_layout

TIMEOUT_S = 20.0
SP_BYTES = (64, 1000, 4096, 1 << 20)  # tiny (many chunks, params split), odd, mid, one chunk


def _model() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    expert = nn.Linear(16, 4)  # stands in for an expert shard (sharded over the EP group)
    for p in expert.parameters():
        p._moesaic_expert = True  # type: ignore[attr-defined]
    model.append(expert)
    return model


def _backward_in_chunks(model: nn.Module, x_BH: torch.Tensor, chunks: int = 2) -> None:
    """R backward passes (one per batch chunk), as the pipelined schedules run them."""
    for x in x_BH.chunk(chunks):
        (model(x).square().mean() / chunks).backward()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _reference(rank: int, ep_size: int):
    """The model, its gradient rules, its input and the plain result: the same R backward
    passes, then the bulk all-reduce (``GradientSync.sync``); gradients zeroed afterwards."""
    sync = GradientSync(build_layout(ep_size=ep_size, timeout_s=TIMEOUT_S))
    model = _model()
    torch.manual_seed(100 + rank)
    x_BH = torch.randn(8, 8)
    _backward_in_chunks(model, x_BH)
    sync.sync(list(model.parameters()))
    ref = _grads(model)
    model.zero_grad(set_to_none=True)
    return sync, model, x_BH, ref


def _equivalence_worker(rank: int, world: int) -> dict:
    sync, model, x_BH, ref = _reference(rank, world)  # experts: no replicas (DP = 1)

    rec = Recorder(rank)
    pool = CommPool(
        grad_sync=sync, params=list(model.parameters()), chunk_bytes=SP_BYTES[0],
        recorder=rec, timeout_s=TIMEOUT_S,
    )  # fmt: skip
    out: dict = {"equal": [], "chunks": [], "phases": []}
    for sp in (SP_BYTES[0], *SP_BYTES):  # the first step learns the hook counts
        pool.chunk_bytes = sp
        rec.clear()
        pool.begin_step()
        _backward_in_chunks(model, x_BH)
        pool.finish()
        out["equal"].append(all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters())))
        ars = sorted((s for s in rec.events if s.resource == "allreduce"), key=lambda s: s.start)
        out["chunks"].append([s.args["bytes"] for s in ars])
        out["phases"].append([s.args["phase"] for s in ars])
        model.zero_grad(set_to_none=True)
    # a step with one backward pass more than the first: the third pass reaches a parameter
    # whose chunk already left (the first ready chunk goes in the step's opening gap), which
    # must not pass silently
    pool.begin_step()
    _backward_in_chunks(model, x_BH[:4])  # passes 1 and 2 (2 rows each)
    (model(x_BH[4:]).square().mean()).backward()
    try:
        pool.finish()
        out["late"] = ""
    except RuntimeError as exc:
        out["late"] = str(exc)
    pool.close()
    replicated = [p for p in model.parameters() if not getattr(p, "_moesaic_expert", False)]
    out["replicated_bytes"] = sum(p.numel() * 4 for p in replicated)
    return out


def test_pool_grads_equal_plain_all_reduce_and_chunk_boundaries():
    res = _shared_world("equivalence")
    for r in res:
        # chunked all-reduce sums the same two values per element as the flat one: bitwise equal
        assert r["equal"] == [True] * (len(SP_BYTES) + 1)
        total = r["replicated_bytes"]
        for sp, sizes in zip((SP_BYTES[0], *SP_BYTES), r["chunks"]):
            # one bucket (replicated, fp32): full Sp chunks (rounded down to whole floats), the
            # remainder last; experts have no replicas here and are not reduced
            step = sp // 4 * 4
            want = [step] * (total // step) + ([total % step] if total % step else [])
            assert sorted(sizes, reverse=True) == want, (sp, sizes)
            assert len(sizes) == math.ceil(total / step)
        assert set(r["phases"][0]) == {"finish"}  # first step: counts unknown, all at finish
        for phases in r["phases"][1:]:
            assert "bwd" in phases  # later steps: chunks leave during the backward
        assert "accumulated after its chunk was all-reduced" in r["late"], r["late"]


def _priority_worker(rank: int, world: int) -> dict:
    layout = build_layout(ep_size=world, timeout_s=TIMEOUT_S)
    model = _model()
    torch.manual_seed(100 + rank)
    x_BH = torch.randn(8, 8)
    rec = Recorder(rank)
    pool = CommPool(
        grad_sync=GradientSync(layout), params=list(model.parameters()), chunk_bytes=256,
        recorder=rec, timeout_s=TIMEOUT_S,
    )  # fmt: skip
    rows = torch.full((4096, 64), float(rank))
    logs = []
    for step in range(3):
        rec.clear()
        pool.begin_step()
        with record_collectives() as log:
            if step > 0:
                # rank 1 joins the all-to-all 0.3 s late, so on rank 0 it stays in flight
                # while the whole backward runs and every gradient is ready: the all-to-all
                # closed the step's opening gap, so no chunk may start before it is waited
                if rank == 1:
                    time.sleep(0.3)
                pending = pool.all_to_all(
                    torch.empty_like(rows), rows, None, None, group=layout.ep, name="D1.1",
                    phase="fwd", block=1, chunk=1,
                )  # fmt: skip
                _backward_in_chunks(model, x_BH)
                received = pending.wait()  # opens a gap: one chunk
                assert torch.equal(received[2048:], torch.ones(2048, 64))
            else:
                _backward_in_chunks(model, x_BH)
            pool.finish()
        logs.append([what for _, _, _, what in log])
        model.zero_grad(set_to_none=True)
    pool.close()
    spans = [(s.resource, s.name, s.start, s.end, dict(s.args)) for s in rec.events]
    return {"spans": spans, "logs": logs}


def test_pool_priority_all_to_all_first_and_one_chunk_per_gap():
    res = _shared_world("priority")
    assert res[0]["logs"] == res[1]["logs"]  # one issue order on both ranks
    for r in res:
        spans = r["spans"]
        a2a = [s for s in spans if s[0] == "a2a"]
        ars = sorted((s for s in spans if s[0] == "allreduce"), key=lambda s: s[2])
        assert len(a2a) == 1 and ars
        _, _, a_start, a_end, _ = a2a[0]
        # no chunk starts while the all-to-all is queued or in flight
        assert not [s for s in ars if a_start <= s[2] <= a_end]
        # exactly one chunk in the gap the wait opened; finish issues the rest
        assert [s[4]["phase"] for s in ars].count("bwd") == 1
    # the issue order: the all-to-all, then one chunk, then the rest at finish
    last = res[0]["logs"][-1]
    assert last[0] == "all_to_all D1.1" and last[1].startswith("all_reduce chunk AR0")


def _recorded_pool(rank: int, world: int):
    """The reference model and its gradients, and a pool of 128-byte chunks recording spans."""
    sync, model, x_BH, ref = _reference(rank, world)
    rec = Recorder(rank)
    pool = CommPool(
        grad_sync=sync, params=list(model.parameters()), chunk_bytes=128, recorder=rec,
        timeout_s=TIMEOUT_S,
    )  # fmt: skip
    return sync, model, x_BH, ref, rec, pool


def _tail_worker(rank: int, world: int) -> dict:
    sync, model, x_BH, ref, rec, pool = _recorded_pool(rank, world)
    rows = torch.full((4096, 64), float(rank))
    for _ in range(2):  # the first step learns the hook counts
        rec.clear()
        pool.begin_step()
        if rank == 1:
            time.sleep(0.3)  # rank 0's all-to-all stays in flight through its backward
        pending = pool.all_to_all(
            torch.empty_like(rows), rows, None, None, group=sync.layout.ep, name="D1.1",
            phase="bwd", block=1, chunk=1,
        )  # fmt: skip
        pool.end_all_to_alls()  # the step's last all-to-all
        if rank == 1:
            # Rank 1's gradients, hence its chunks, come 0.3 s after rank 0's: none of rank 0's
            # tail chunks can complete before all of them are issued.
            time.sleep(0.3)
        _backward_in_chunks(model, x_BH)
        pending.wait()  # the last all-to-all waited: every ready chunk goes now
        pool.finish()
        equal = all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters()))
        model.zero_grad(set_to_none=True)
    pool.close()
    spans = [(s.resource, s.name, s.start, s.end, dict(s.args)) for s in rec.events]
    return {"spans": spans, "equal": equal}


def test_pool_tail_chunks_go_at_once_after_the_last_all_to_all():
    """After end_all_to_alls and the completion of the last all-to-all, the ready chunks are
    issued without waiting one by one (several in flight), never while it is in flight."""
    res = _shared_world("tail")
    assert all(r["equal"] for r in res)
    spans = res[0]["spans"]
    a_start, a_end = next((s[2], s[3]) for s in spans if s[0] == "a2a")
    tail = sorted((s for s in spans if s[0] == "allreduce"), key=lambda s: s[2])
    assert len(tail) > 2 and {s[4]["phase"] for s in tail} == {"tail"}
    assert min(s[2] for s in tail) >= a_end > a_start
    # all issued before the first completed (rank 1 issues its chunks 0.3 s later): several in flight
    assert max(s[2] for s in tail) < min(s[3] for s in tail)


def _late_tail_worker(rank: int, world: int) -> dict:
    """The last all-to-all waited before the backward: every gradient completes in the tail."""
    sync, model, x_BH, ref, rec, pool = _recorded_pool(rank, world)
    rows = torch.full((64, 8), float(rank))
    out: dict = {"equal": [], "calls": []}
    for _ in range(3):  # the first step learns the hook counts and where the tail opened
        rec.clear()
        pool.begin_step()
        pool.all_to_all(
            torch.empty_like(rows), rows, None, None, group=sync.layout.ep, name="D1.1",
            phase="bwd", block=1, chunk=1,
        ).wait()  # fmt: skip
        pool.end_all_to_alls()
        _backward_in_chunks(model, x_BH)
        pool.finish()
        out["equal"].append(all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters())))
        ars = [s for s in rec.events if s.resource == "allreduce"]
        out["calls"].append([(s.args["phase"], s.args["bytes"]) for s in ars])
        model.zero_grad(set_to_none=True)
    pool.close()
    replicated = [p for p in model.parameters() if not getattr(p, "_moesaic_expert", False)]
    out["replicated_bytes"] = sum(p.numel() * 4 for p in replicated)
    return out


def test_pool_gradients_completing_in_the_tail_go_as_one_call():
    """Gradients that completed after the step's last all-to-all (in rank 0's first step) are
    one chunk, not one per Sp: they go as one call (in the tail from the second step; 128-byte
    Sp: 13 chunks otherwise), summed exactly as before."""
    for r in _shared_world("late_tail"):
        assert r["equal"] == [True] * 3
        assert r["replicated_bytes"] > 8 * 128  # more than 8 chunks of Sp
        # the first step: built at finish, after the agreement: the tail already one chunk
        assert r["calls"][0] == [("finish", r["replicated_bytes"])]
        for calls in r["calls"][1:]:
            assert calls == [("tail", r["replicated_bytes"])]


def _clone_worker(rank: int, world: int) -> dict:
    layout = build_layout(ep_size=world, timeout_s=TIMEOUT_S)
    rec = Recorder(rank)
    model = _model()
    pool = CommPool(
        grad_sync=GradientSync(layout), params=list(model.parameters()), chunk_bytes=256,
        recorder=rec, timeout_s=TIMEOUT_S, a2a_groups=[layout.ep],
    )  # fmt: skip
    rows = torch.full((64, 8), float(rank))
    counts = torch.tensor([rank, rank])
    got = torch.empty_like(counts)
    if rank == 0:  # rows first, then the counts while the rows are still in flight
        pending = pool.all_to_all(torch.empty_like(rows), rows, None, None, group=layout.ep,
                                  name="D1.1", phase="fwd", block=1, chunk=1)  # fmt: skip
        layout.ep.all_to_all_single(got, counts, what="dispatch counts")
        counts_done = time.perf_counter()
        received = pending.wait()
    else:  # the counts first; the rows 0.3 s later
        layout.ep.all_to_all_single(got, counts, what="dispatch counts")
        counts_done = time.perf_counter()
        time.sleep(0.3)
        pending = pool.all_to_all(torch.empty_like(rows), rows, None, None, group=layout.ep,
                                  name="D1.1", phase="fwd", block=1, chunk=1)  # fmt: skip
        received = pending.wait()
    rows_done = time.perf_counter()
    pool.close()
    return {
        "early_s": rows_done - counts_done,
        "counts": got.tolist(),
        "rows": [received[:32].unique().tolist(), received[32:].unique().tolist()],
    }


def test_pool_all_to_alls_on_their_own_group_do_not_block_the_ep_group():
    """With a2a_groups, the rows travel on a clone of the EP group: a synchronous exchange on
    the EP group itself (a strategy's counts) completes while rows are still in flight (on
    one group, rank 0's counts would be paired with rank 1's rows, or wait behind them)."""
    res = _shared_world("clone")
    assert res[0]["counts"] == [0, 1] and res[1]["counts"] == [0, 1]
    assert res[0]["rows"] == res[1]["rows"] == [[0.0], [1.0]]  # rows from rank 0, rank 1
    assert res[0]["early_s"] > 0.2  # rank 0's counts were done long before its rows


def _shared_worker(rank: int, world: int) -> dict:
    """The equivalence, priority, tail and clone checks, one after another in one world (each
    builds its own model and pool and closes it)."""
    workers = {
        "equivalence": _equivalence_worker,
        "priority": _priority_worker,
        "tail": _tail_worker,
        "late_tail": _late_tail_worker,
        "clone": _clone_worker,
    }
    return {name: worker(rank, world) for name, worker in workers.items()}


@functools.cache
def _results() -> list[dict]:
    return run_world(_shared_worker, 2)


def _shared_world(name: str) -> list[dict]:
    """Per rank, what ``name``'s worker returned in the shared world."""
    return [r[name] for r in _results()]


def _deadline_worker(rank: int, world: int, done: str) -> str:
    timeout_s = 1.5
    layout = build_layout(ep_size=world, timeout_s=timeout_s)
    model = _model()
    x_BH = torch.randn(4, 8)
    pool = CommPool(
        grad_sync=GradientSync(layout), params=list(model.parameters()), chunk_bytes=128,
        recorder=Recorder(rank), timeout_s=timeout_s,
    )  # fmt: skip
    pool.begin_step()
    _backward_in_chunks(model, x_BH)
    pool.finish()
    msgs = []
    pool.begin_step()
    if rank == 0:
        _backward_in_chunks(model, x_BH)
        for what in ("finish", "a2a"):
            try:
                if what == "finish":
                    pool.finish()
                else:
                    rows = torch.ones(4, 2)
                    pool.all_to_all(
                        torch.empty_like(rows), rows, None, None, group=layout.ep, name="C2.3"
                    ).wait()
            except CollectiveError as exc:
                msgs.append(str(exc))
        open(done, "w").close()
    else:
        # No backward, no finish, no all-to-all: never joins (until rank 0 is done, at most
        # 2 * timeout_s + 1.5 s).
        deadline = time.monotonic() + 2 * timeout_s + 1.5
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.02)
    return "\n".join(msgs)


def test_pool_peer_that_never_joins_is_a_collective_error(tmp_path):
    msg0, _ = run_world(_deadline_worker, 2, str(tmp_path / "done"))
    lines = msg0.splitlines()
    assert len(lines) == 2, msg0
    assert "all_reduce chunk AR" in lines[0] and "rank 0" in lines[0]
    assert "all_to_all C2.3" in lines[1] and "collective_timeout_s=1.5" in lines[1]


def test_pool_bad_chunk_bytes_names_the_option():
    model = _model()
    sync = GradientSync(build_layout(ep_size=1, timeout_s=5.0))
    for bad in (0, -4, 1.5):
        with pytest.raises(ValueError, match="chunk_bytes"):
            CommPool(
                grad_sync=sync, params=list(model.parameters()), chunk_bytes=bad,
                recorder=Recorder(), timeout_s=5.0,
            )  # fmt: skip


def _replicas_worker(rank: int, world: int) -> list[bool]:
    """EP 2 x DP 2: replicated gradients over all 4 ranks, expert shards over their DP pair
    ({0, 2} and {1, 3}): three reduction rank sets, one chunk sequence."""
    sync, model, x_BH, ref = _reference(rank, 2)
    pool = CommPool(
        grad_sync=sync, params=list(model.parameters()), chunk_bytes=96,
        recorder=Recorder(rank), timeout_s=TIMEOUT_S,
    )  # fmt: skip
    close = []
    for _ in range(3):
        pool.begin_step()
        _backward_in_chunks(model, x_BH)
        time.sleep(0.1)
        pool.finish()
        # 4 addends: gloo's ring sums them in an order that depends on the buffer's cut, so
        # equal to fp32 rounding, not bitwise
        close.append(
            all(torch.allclose(a, p.grad, rtol=1e-6, atol=1e-7) for a, p in zip(ref, model.parameters()))
        )  # fmt: skip
        model.zero_grad(set_to_none=True)
    pool.close()
    return close


def test_pool_expert_replicas_reduced_over_their_dp_group():
    assert run_world(_replicas_worker, 4) == [[True] * 3] * 4
