"""Static vs dynamic taskflow executor, serial vs tile-interleaved SwiGLU+Add (HyperParallel-MoE
§6.1-6.2, Figs. 9-10), on this CPU.

Writes ``benchmarks/results/taskflow_sched.json``.

a) Per-task scheduling overhead. A taskized SwiGLU+Add graph of ``--tasks`` tasks with a small
   width (h_in = 128, h_out = 64) and 1, 8, 64 or 512 rows per task, plus a no-op launch, on the
   static executor (one worker consuming the compiled interleaved order) and the dynamic one
   (Scheduler thread + 1 or 2 Processors). Overhead per task = (wall - time inside the launches)
   / tasks; for the no-op launch, wall / tasks. The paper: ~0.1 us static, ~2.36 us dynamic per
   AIV task; the goal here: static <= 1/5 of dynamic.
b) SwiGLU+Add (h_in = 4096, h_out = 2048, fp32, ``--tile-m`` rows per tile) over a row sweep up to
   several times the last-level cache: the untiled baseline (two whole-tensor ops), the static
   executor on the serial and the interleaved schedule, and the dynamic executor (1 and 2
   processors; its order is decided at run time, and the measured producer-consumer distance
   says which order it produced).

Every configuration is timed in each of ``--rounds`` rounds, configurations alternating within a
round (the starting one rotates); ratios are taken within a round, and medians over rounds are
reported with min and max. ``torch.set_num_threads(1)``: every op runs on one core, as one
vector unit runs one tile in the paper, so tile order and executor are the only differences (the
dynamic executor with 2 processors may run two tiles at once on the machine's two cores).

    python benchmarks/taskflow_sched.py [--rounds 5] [--quick] [--trace FILE]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import queue
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moesaic.bench.meta import run_metadata
from moesaic.comm.counters import EventCounters
from moesaic.taskflow.plan import Schedule, TaskGraph
from moesaic.taskflow.runtime.executors import engine_lanes
from moesaic.taskflow.tasks import TaskDescriptor
from moesaic.trace import Recorder, write_chrome_trace
from taskflow_microbench import (  # beside this script
    SwigluAddShape,
    chain_graph,
    make_buffers,
    make_launch,
    noop_launch,
    order_distance,
    run_graph,
    run_untiled,
    swiglu_add_graph,
    swiglu_add_schedule,
)

OUT = Path(__file__).parent / "results" / "taskflow_sched.json"
Launch = Callable[[TaskDescriptor], None]
# (executor, processors)
EXECUTOR_RUNS = (("static", 1), ("dynamic", 1), ("dynamic", 2))


def machine_facts() -> dict:
    """CPU model and caches (from sysfs), memory, load average."""
    caches = []
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for d in sorted(base.glob("index*")):
        level, kind, size, shared = (
            (d / name).read_text().strip() for name in ("level", "type", "size", "shared_cpu_list")
        )
        caches.append({"level": int(level), "type": kind, "size": size, "shared_cpu_list": shared})
    model = ""
    try:
        for line in subprocess.check_output(["lscpu"], text=True).splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu_model": model,
        "caches": caches,
        "memory_gib": round(mem / 2**30, 1),
        "load_average_before": os.getloadavg(),
    }


def llc_bytes(facts: dict) -> int:
    last = max(facts["caches"], key=lambda c: c["level"])
    size = last["size"]
    unit = {"K": 2**10, "M": 2**20, "G": 2**30}[size[-1]]
    return int(size[:-1]) * unit


def copy_bandwidth_gbs() -> float:
    """One-core copy bandwidth (read + write bytes / s) of a 512 MiB buffer, best of 3."""
    src = torch.ones(2**27)
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    return 2 * src.numel() * 4 / best / 1e9


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class TimedLaunch:
    """Wraps a launch: total seconds inside it and the order of the uids it ran."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.times: list[float] = []  # list.append is atomic: processors may share one
        self.uids: list[int] = []

    def __call__(self, task: TaskDescriptor) -> None:
        t0 = time.perf_counter()
        self.launch(task)
        self.times.append(time.perf_counter() - t0)
        self.uids.append(task.uid)


def _stats(xs: list[float], scale: float = 1.0) -> dict:
    return {"median": statistics.median(xs) * scale, "min": min(xs) * scale, "max": max(xs) * scale}


RATIOS = (("static", "dynamic_p1"), ("static", "dynamic_p2"))


def run_executor(
    ex: str, p: int, graph: TaskGraph, sched: Schedule, launch: Launch, lanes: object = None
) -> None:
    run_graph(ex, graph, sched, launch, processors=p, lanes=lanes)


def _name(ex: str, p: int) -> str:
    return f"{ex}_p{p}" if ex == "dynamic" else ex


def _print_overhead(what: str, row: dict) -> None:
    us = {k: row[k]["overhead_us"]["median"] for k in ("static", "dynamic_p1", "dynamic_p2")}
    print(
        f"a) {what}: us/task static {us['static']:.2f}, dynamic p1 {us['dynamic_p1']:.2f}, "
        f"p2 {us['dynamic_p2']:.2f}; static/dynamic_p1 "
        f"{row['static_over_dynamic_p1']['median']:.3f}",
        flush=True,
    )


def overhead_point(size: int, tasks: int, rounds: int) -> dict:
    """Part a at one task size (0: no-op launch): every executor run alternating per round."""
    shape = SwigluAddShape(
        rows=max(size, 1) * (tasks // 2), tile_m=max(size, 1), h_in=128, h_out=64
    )
    graph = swiglu_add_graph(shape)
    sched = swiglu_add_schedule(graph, "interleaved")
    real = make_launch(graph, make_buffers(shape)) if size else noop_launch
    n = len(graph.tasks)
    program = engine_lanes(graph, sched, 0)  # compiled once, as a plan's is
    per: dict[str, dict[str, list[float]]] = {}
    for k in range(rounds + 1):  # round 0 warms up
        for j in range(len(EXECUTOR_RUNS)):
            ex, p = EXECUTOR_RUNS[(j + k) % len(EXECUTOR_RUNS)]
            launch = TimedLaunch(real) if size else real
            gc.collect()
            wall = _timed(functools.partial(run_executor, ex, p, graph, sched, launch, program))
            inside = sum(launch.times) if isinstance(launch, TimedLaunch) else 0.0
            if k:
                d = per.setdefault(_name(ex, p), {})
                d.setdefault("wall", []).append(wall)
                d.setdefault("launch", []).append(inside)
                d.setdefault("overhead", []).append((wall - inside) / n)
    row: dict = {"rows_per_task": size or "no-op", "tasks": n, "width_in_out": [128, 64]}
    for name, d in per.items():
        row[name] = {
            "overhead_us": _stats(d["overhead"], 1e6),
            "launch_us_per_task": statistics.median(d["launch"]) / n * 1e6,
            "wall_ms": _stats(d["wall"], 1e3),
        }
    for st, dyn in RATIOS:
        ratios = [s / d for s, d in zip(per[st]["overhead"], per[dyn]["overhead"])]
        row[f"{st}_over_{dyn}"] = _stats(ratios)
    _print_overhead(f"{row['rows_per_task']!s:>5} rows/task", row)
    return row


VARIANTS = ("untiled", "static_serial", "static_interleaved", "dynamic_p1", "dynamic_p2")


def run_variant(name: str, graph: TaskGraph, scheds: dict[str, Schedule], launch: Launch) -> None:
    """Run "static_serial", "static_interleaved", "dynamic_p1" or "dynamic_p2"."""
    ex, how = name.split("_")
    p = int(how[1:]) if ex == "dynamic" else 1
    sched = scheds["serial" if how == "serial" else "interleaved"]
    run_graph(ex, graph, sched, launch, processors=p)


def chain_point(tasks: int, rounds: int) -> dict:
    """Part a on a dependency chain with a no-op launch: every task is released by the one
    before it, so the dynamic executor pays its Scheduler and Processor hand-offs per task."""
    graph, sched = chain_graph(tasks)
    program = engine_lanes(graph, sched, 0)
    per: dict[str, list[float]] = {}
    for k in range(rounds + 1):  # round 0 warms up
        for j in range(len(EXECUTOR_RUNS)):
            ex, p = EXECUTOR_RUNS[(j + k) % len(EXECUTOR_RUNS)]
            gc.collect()
            wall = _timed(
                functools.partial(run_executor, ex, p, graph, sched, noop_launch, program)
            )
            if k:
                per.setdefault(_name(ex, p), []).append(wall / tasks)
    row: dict = {"graph": "chain", "rows_per_task": "no-op", "tasks": tasks}
    for name, xs in per.items():
        row[name] = {"overhead_us": _stats(xs, 1e6)}
    for st, dyn in RATIOS:
        row[f"{st}_over_{dyn}"] = _stats([s / d for s, d in zip(per[st], per[dyn])])
    _print_overhead("chain no-op", row)
    return row


def components(calls: int = 20000) -> dict:
    """What one task's bookkeeping is made of, per call in us (median of 5 batches): an
    ``EventCounters.wait`` on a complete event and a ``bump`` (the static executor's per-task
    cost), a bump whose listener enqueues, a ``SimpleQueue`` put+get on one thread, and a
    one-way thread hand-off (half a ping-pong round trip between two threads)."""
    counters = EventCounters(2)
    counters.bump(0)
    listened = EventCounters(2)
    q: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    listened.add_listener(lambda ev, count: q.put(ev))

    def bump_and_drain() -> None:
        listened.bump(1)
        q.get()

    def put_get() -> None:
        q.put(0)
        q.get()

    def per_call(fn: Callable[[], object]) -> float:
        return (
            statistics.median(
                _timed(lambda: [fn() for _ in range(calls)]) / calls for _ in range(5)
            )
            * 1e6
        )

    ping: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    pong: queue.SimpleQueue[int | None] = queue.SimpleQueue()

    def echo() -> None:
        while ping.get() is not None:
            pong.put(0)

    th = threading.Thread(target=echo)
    th.start()
    rounds = calls // 10
    t0 = time.perf_counter()
    for _ in range(rounds):
        ping.put(0)
        pong.get()
    handoff = (time.perf_counter() - t0) / rounds / 2 * 1e6
    ping.put(None)
    th.join()
    return {
        "wait_complete_event_us": per_call(lambda: counters.wait(0, 1, 60.0)),
        "bump_us": per_call(lambda: counters.bump(1)),
        "bump_with_listener_and_get_us": per_call(bump_and_drain),
        "simplequeue_put_get_us": per_call(put_get),
        "thread_handoff_one_way_us": handoff,
    }


def _ratio(walls: dict[str, list[float]], a: str, b: str) -> dict:
    return _stats([x / y for x, y in zip(walls[a], walls[b])])


def swiglu_add_point(m: int, tile_m: int, rounds: int, llc: int) -> dict:
    """Part b at M = ``m``: serial vs interleaved (static), static vs dynamic, untiled."""
    shape = SwigluAddShape(rows=m, tile_m=tile_m)
    graph = swiglu_add_graph(shape)
    bufs = make_buffers(shape)
    launch = make_launch(graph, bufs)
    scheds = {o: swiglu_add_schedule(graph, o) for o in ("serial", "interleaved")}
    runs: dict[str, Callable[[], None]] = {"untiled": functools.partial(run_untiled, bufs)}
    for name in VARIANTS[1:]:
        runs[name] = functools.partial(run_variant, name, graph, scheds, launch)
    run_untiled(bufs)
    expected = bufs.out_MHo.clone()
    distance = {}
    for name in VARIANTS[1:]:  # correctness, and the order each executor produced
        bufs.out_MHo.zero_()
        timed = TimedLaunch(launch)
        run_variant(name, graph, scheds, timed)
        if not torch.equal(bufs.out_MHo, expected):
            raise RuntimeError(f"{name} at M={m}: output differs from the untiled ops")
        distance[name] = order_distance(timed.uids)
    del expected
    walls: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for k in range(rounds):
        for j in range(len(VARIANTS)):
            name = VARIANTS[(j + k) % len(VARIANTS)]
            gc.collect()
            walls[name].append(_timed(runs[name]))
    n = len(graph.tasks)
    row: dict = {
        "rows": m,
        "tile_m": tile_m,
        "tasks": n,
        "working_set_mib": shape.working_set_bytes() / 2**20,
        "working_set_over_llc": shape.working_set_bytes() / llc,
        "order_distance": distance,
    }
    for v in VARIANTS:
        row[v] = {"wall_ms": _stats(walls[v], 1e3)}
    row["serial_over_interleaved"] = _ratio(walls, "static_serial", "static_interleaved")
    row["dynamic_p1_over_static"] = _ratio(walls, "dynamic_p1", "static_interleaved")
    row["dynamic_p2_over_static"] = _ratio(walls, "dynamic_p2", "static_interleaved")
    row["untiled_over_interleaved"] = _ratio(walls, "untiled", "static_interleaved")
    extra = [(d - s) / n for d, s in zip(walls["dynamic_p1"], walls["static_interleaved"])]
    row["dynamic_p1_extra_us_per_task"] = _stats(extra, 1e6)
    med = {v: row[v]["wall_ms"]["median"] for v in VARIANTS}
    print(
        f"b) M={m:>6} ({row['working_set_over_llc']:.2f}x LLC): ms untiled {med['untiled']:.1f} "
        f"serial {med['static_serial']:.1f} interleaved {med['static_interleaved']:.1f} "
        f"dyn1 {med['dynamic_p1']:.1f} dyn2 {med['dynamic_p2']:.1f}; serial/inter "
        f"{row['serial_over_interleaved']['median']:.3f} dyn1/static "
        f"{row['dynamic_p1_over_static']['median']:.3f}",
        flush=True,
    )
    return row


def write_trace(path: str, rows: int, tile_m: int) -> dict:
    """One configuration (M = ``rows``) run three times into one Chrome trace: static serial
    and static interleaved (lane "vector"), then dynamic with 2 processors."""
    shape = SwigluAddShape(rows=rows, tile_m=tile_m)
    graph = swiglu_add_graph(shape)
    launch = make_launch(graph, make_buffers(shape))
    rec = Recorder(0)
    for ex, order, p in (
        ("static", "serial", 1),
        ("static", "interleaved", 1),
        ("dynamic", "interleaved", 2),
    ):
        run_graph(ex, graph, swiglu_add_schedule(graph, order), launch, processors=p)  # warm
        run_graph(ex, graph, swiglu_add_schedule(graph, order), launch, processors=p, recorder=rec)
    write_chrome_trace(path, [rec.events])
    return {
        "path": path,
        "rows": rows,
        "tile_m": tile_m,
        "spans": len(rec.events),
        "runs": ["static serial", "static interleaved", "dynamic p2"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tasks", type=int, default=2000, help="tasks per graph in part a")
    ap.add_argument("--tile-m", type=int, default=32, help="rows per tile in part b")
    ap.add_argument("--max-rows", type=int, default=65536)
    ap.add_argument("--quick", action="store_true", help="small sizes, 2 rounds (a smoke run)")
    ap.add_argument("--trace", default="", help="write a Chrome trace of M=2048 to this file")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    facts = machine_facts()
    llc = llc_bytes(facts)
    rounds = 2 if args.quick else args.rounds
    tasks = 200 if args.quick else args.tasks
    max_rows = 4096 if args.quick else args.max_rows
    rows_list = [m for m in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072) if m <= max_rows]
    facts["copy_bandwidth_gbs_one_core"] = copy_bandwidth_gbs()
    result: dict[str, Any] = {
        "meta": {**run_metadata(), **facts, "torch_threads": torch.get_num_threads()},
        "config": {
            "rounds": rounds,
            "tasks_part_a": tasks,
            "tile_m_part_b": args.tile_m,
            "rows_part_b": rows_list,
            "tile_sweep_rows": 32768,
            "dtype": "float32",
            "h_in_out_part_b": [4096, 2048],
            "llc_bytes": llc,
            "quick": args.quick,
        },
        "notes": {
            "overhead": "(wall - time inside the launches) / tasks; no-op and chain: wall / tasks",
            "dynamic_p2": "2 processors run launches at once on the 2 cores, so wall - launch "
            "time is not an overhead there (it goes negative); its wall time is in wall_ms",
            "engine_lanes": "the static executor runs the event engine's lanes (engine_lanes), "
            "built once per graph, as the layer's runtime keeps them per plan",
            "order_distance": "mean positions between SwiGLU tile i and Add tile i in the "
            "executed order: 1 = interleaved, tiles = serial",
        },
        "paper": {
            "static_us_per_task": 0.1,
            "dynamic_us_per_task": 2.36,
            "interleave_speedup_M32K": 1.23,
            "dynamic_over_static_M2K": 7.65,
            "dynamic_over_static_M32K": 1.47,
        },
        "overhead": [overhead_point(size, tasks, rounds) for size in (0, 1, 8, 64, 512)],
        "overhead_chain": chain_point(tasks, rounds),
        "components": components(),
        "swiglu_add": [],
    }
    for m in rows_list:  # one M at a time, so only one set of buffers is alive
        result["swiglu_add"].append(swiglu_add_point(m, args.tile_m, rounds, llc))
        gc.collect()
    result["tile_sweep"] = []
    for tile_m in () if args.quick else (8, 128, 512):  # tile height at M = 32K
        result["tile_sweep"].append(swiglu_add_point(32768, tile_m, rounds, llc))
        gc.collect()
    if args.trace:
        result["trace"] = write_trace(args.trace, 2048, args.tile_m)
    result["meta"]["load_average_after"] = os.getloadavg()
    result["meta"]["elapsed_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} in {result['meta']['elapsed_s']} s")


if __name__ == "__main__":
    main()
