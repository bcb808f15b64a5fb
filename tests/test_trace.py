"""moesaic.trace: the recorder, the Chrome trace, the PNG timeline and the overlap figures."""

from __future__ import annotations

import json
import threading
import warnings

import pytest

from moesaic.comm.spans import gather_spans
from moesaic.comm.world import run_world
from moesaic.trace import (
    Recorder,
    Span,
    busy_time,
    chrome_trace,
    draw_timeline,
    overlap_bound,
    step_figures,
    write_chrome_trace,
)


def _spans() -> list[list[Span]]:
    """Two ranks; times chosen so that every ts/dur is an exact number of microseconds."""
    t0 = 100.0
    rank0 = [
        Span(rank=0, resource="compute", name="AT1.1", start=t0, end=t0 + 0.002,
             args={"phase": "fwd", "block": 1, "chunk": 1}),
        Span(rank=0, resource="a2a", name="D1.1", start=t0 + 0.002, end=t0 + 0.005,
             args={"phase": "fwd", "block": 1, "chunk": 1, "bytes": 4096}),
        Span(rank=0, resource="compute", name="AT2.1", start=t0 + 0.002, end=t0 + 0.004),
    ]  # fmt: skip
    rank1 = [
        Span(rank=1, resource="allreduce", name="AR0", start=t0 + 0.001, end=t0 + 0.0015,
             args={"bytes": 1024}),
        Span(rank=1, resource="compute", name="AT1.1", start=t0 + 0.0005, end=t0 + 0.003),
    ]  # fmt: skip
    return [rank0, rank1]


def test_chrome_trace_events_exact():
    trace = chrome_trace(_spans())
    assert set(trace) == {"traceEvents", "displayTimeUnit"}
    events = trace["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    # One named process per rank, one named thread per (rank, resource), in lane order.
    assert meta == [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
        {"name": "process_sort_index", "ph": "M", "pid": 0, "tid": 0, "args": {"sort_index": 0}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "compute"}},
        {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": 0, "args": {"sort_index": 0}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "a2a"}},
        {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": 1, "args": {"sort_index": 1}},
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "rank 1"}},
        {"name": "process_sort_index", "ph": "M", "pid": 1, "tid": 0, "args": {"sort_index": 1}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "compute"}},
        {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": 0, "args": {"sort_index": 0}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "allreduce"}},
        {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": 1, "args": {"sort_index": 1}},
    ]
    complete = [e for e in events if e["ph"] == "X"]
    assert complete == [
        {"name": "AT1.1", "cat": "compute", "ph": "X", "ts": 0.0, "dur": 2000.0, "pid": 0,
         "tid": 0, "args": {"phase": "fwd", "block": 1, "chunk": 1}},
        {"name": "AT2.1", "cat": "compute", "ph": "X", "ts": 2000.0, "dur": 2000.0, "pid": 0,
         "tid": 0},
        {"name": "D1.1", "cat": "a2a", "ph": "X", "ts": 2000.0, "dur": 3000.0, "pid": 0,
         "tid": 1, "args": {"phase": "fwd", "block": 1, "chunk": 1, "bytes": 4096}},
        {"name": "AT1.1", "cat": "compute", "ph": "X", "ts": 500.0, "dur": 2500.0, "pid": 1,
         "tid": 0},
        {"name": "AR0", "cat": "allreduce", "ph": "X", "ts": 1000.0, "dur": 500.0, "pid": 1,
         "tid": 1, "args": {"bytes": 1024}},
    ]  # fmt: skip
    # The structure Perfetto's JSON importer needs: every event has name/ph/pid/tid; complete
    # events have numeric ts >= 0 and dur >= 0; metadata names are strings.
    for e in events:
        assert {"name", "ph", "pid", "tid"} <= set(e) and e["ph"] in ("X", "M")
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0
    json.dumps(trace, allow_nan=False)  # strictly valid JSON


def test_write_chrome_trace_round_trips(tmp_path):
    path = write_chrome_trace(tmp_path / "sub" / "t.json", _spans())
    assert json.loads(path.read_text()) == chrome_trace(_spans())


def test_non_json_args_become_strings():
    span = Span(rank=0, resource="compute", name="x", start=0.0, end=1.0, args={"shape": (2, 3)})
    (event,) = [e for e in chrome_trace([[span]])["traceEvents"] if e["ph"] == "X"]
    assert event["args"] == {"shape": "(2, 3)"}


def test_busy_time_is_a_union():
    def s(resource, start, end):
        return Span(rank=0, resource=resource, name="t", start=start, end=end)

    spans = [
        s("a2a", 0.0, 2.0),
        s("a2a", 1.0, 3.0),  # overlaps the first: [0, 3]
        s("a2a", 3.0, 4.0),  # touches: [0, 4]
        s("a2a", 6.0, 7.0),  # a gap: + 1
        s("a2a", 6.2, 6.5),  # inside: nothing
        s("allreduce", 3.5, 5.0),
        s("compute", 0.0, 2.5),
        s("optimizer", 7.0, 7.5),
    ]
    assert busy_time(spans, "a2a") == pytest.approx(5.0)
    assert busy_time(spans, ("a2a", "allreduce")) == pytest.approx(6.0)  # [0, 5] + [6, 7]
    assert busy_time(spans, "compute") == pytest.approx(2.5)
    assert busy_time(spans, "nothing") == 0.0
    assert overlap_bound(spans) == pytest.approx(6.0)  # max(2.5 + 0.5, 6.0)
    # Per rank, then the slowest rank: rank 1 computes for 10 s.
    other = Span(rank=1, resource="compute", name="t", start=0.0, end=10.0)
    assert overlap_bound([*spans, other]) == pytest.approx(10.0)
    assert overlap_bound([]) == 0.0


def test_recorder_span_add_clear_and_threads():
    rec = Recorder(rank=3)
    with rec.span("compute", "AT1.1", phase="fwd", block=1):
        pass
    with pytest.raises(KeyError), rec.span("compute", "boom"):
        raise KeyError("x")  # a failing task is still recorded
    start = rec.now()
    rec.add("a2a", "D1.1", start, start + 0.5, bytes=8)
    names = [(s.rank, s.resource, s.name) for s in rec.events]
    assert names == [(3, "compute", "AT1.1"), (3, "compute", "boom"), (3, "a2a", "D1.1")]
    assert rec.events[0].args == {"phase": "fwd", "block": 1} and rec.events[0].end >= start - 1
    assert rec.events[2].duration == 0.5 and rec.events[0].kind == "AT"
    with pytest.raises(ValueError, match=r"end .* must be >= start"):
        rec.add("a2a", "bad", 2.0, 1.0)

    def record(k):
        for i in range(500):
            rec.add("allreduce", f"AR{k}.{i}", 0.0, 1.0)

    threads = [threading.Thread(target=record, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(rec.events) == 3 + 4 * 500
    rec.clear()
    assert rec.events == []


def test_disabled_recorder_records_nothing():
    rec = Recorder(enabled=False)
    with rec.span("compute", "x"):
        pass
    rec.add("a2a", "y", 0.0, 1.0)
    assert rec.events == []
    with pytest.raises(ValueError, match=r"rank \(-1\) must be >= 0"):
        Recorder(rank=-1)


def test_draw_timeline_writes_a_png(tmp_path):
    spans = _spans()
    spans[0].append(Span(rank=0, resource="compute", name="E1.1", start=100.004, end=100.006,
                         args={"phase": "bwd"}))  # fmt: skip
    path = draw_timeline(tmp_path / "t.png", spans, title="two ranks")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no lanes: no singular-axis warning either
        empty = draw_timeline(tmp_path / "empty.png", [[], []])
    assert empty.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _gather_world(rank, world_size):
    from moesaic.comm.collectives import EPGroup

    rec = Recorder(rank=rank)
    for i in range(rank + 1):  # ranks record different numbers of spans (payload sizes differ)
        rec.add("compute", f"AT{i}.1", float(i), float(i) + 0.5, chunk=i, note="é")
    return gather_spans(EPGroup(None, 30.0), rec.events)


def test_gather_spans_over_the_world():
    results = run_world(_gather_world, 2)
    assert results[0] == results[1]
    assert [[(s.rank, s.name, s.args) for s in spans] for spans in results[0]] == [
        [(0, "AT0.1", {"chunk": 0, "note": "é"})],
        [(1, "AT0.1", {"chunk": 0, "note": "é"}), (1, "AT1.1", {"chunk": 1, "note": "é"})],
    ]


def test_step_figures_per_rank_and_step():
    def s(rank, resource, name, start, end):
        return Span(rank=rank, resource=resource, name=name, start=start, end=end)

    spans = [
        s(0, "step", "step1", 0.0, 10.0),
        s(0, "compute", "AT1.1", 0.0, 4.0),
        s(0, "a2a", "D1.1", 3.0, 7.0),  # overlaps the compute: busy comm 4 + 1
        s(0, "allreduce", "AR0", 6.0, 8.0),
        s(0, "optimizer", "optimizer", 9.0, 10.0),  # compute 4 + 1
        s(0, "step", "step2", 10.0, 14.0),
        s(0, "compute", "AT1.1", 10.0, 13.0),
        s(1, "step", "step1", 0.5, 9.5),  # rank 1's step 1: nothing else recorded
        s(1, "compute", "AT1.1", 20.0, 21.0),  # outside every step of rank 1
    ]
    figs = step_figures(spans)
    got = [(f.name, f.rank, f.time_s, f.compute_s, f.comm_s, f.bound_s) for f in figs]
    assert got == [
        ("step1", 0, 10.0, 5.0, 5.0, 5.0),
        ("step2", 0, 4.0, 3.0, 0.0, 3.0),
        ("step1", 1, 9.0, 0.0, 0.0, 0.0),
    ]
    assert figs[0].ratio == 2.0 and figs[2].ratio == float("inf")
