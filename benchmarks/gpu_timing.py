"""Timing one GPU step, shared by the GPU benchmarks (``gpu_layer.py``, ``gpu_persistent.py``):
the dense-GEMM rate the step's bound is priced at, synchronised and streamed step times, the host
syncs of one step and its kernel time from the profiler's device events. Each takes the step as
a callable; on a CPU device the GPU-only figures are None or empty."""

from __future__ import annotations

import gzip
import shutil
import statistics
import time
import warnings
from pathlib import Path

import torch

from moesaic.testing import SYNC_WARNING


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dense_gemm_tflops(c: dict, device, dtype, reps: int = 10) -> float:
    rows = c["T"] * c["K"]
    a = torch.randn(rows, c["H"], device=device, dtype=dtype)
    b = torch.randn(c["H"], c["F"], device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(device)
        times.append((time.perf_counter() - t0) / reps)
    return 2.0 * rows * c["H"] * c["F"] / statistics.median(times) / 1e12


def step_times(step, device, iters: int, warmup: int, stream: int) -> dict:
    for _ in range(warmup):
        step()
    sync(device)
    single = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        sync(device)
        single.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(stream):
        step()
    t_host = time.perf_counter()
    sync(device)
    return {
        "step_ms": 1e3 * statistics.median(single),
        "step_ms_min": 1e3 * min(single),
        "stream_ms": 1e3 * (time.perf_counter() - t0) / stream,
        # The host's time to issue a streamed step: near stream_ms, the host is the bound (or
        # the launch queue filled up and held it back: then the GPU is).
        "host_ms": 1e3 * (t_host - t0) / stream,
    }


def host_syncs(step, device) -> list[str] | None:
    """Where the operations of one step that made the host wait for the GPU were issued (the
    Python line of each; a backward's are the ``backward()`` call's)."""
    if device.type != "cuda":
        return None
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)
    return [f"{w.filename}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)]


def kernel_profile(step, device, trace: Path | None, steps: int = 3) -> dict:
    """``device_summary`` of ``steps`` calls of ``step`` under the profiler (CPU and CUDA
    activities); the trace, gzipped, to ``trace`` when given."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return {}
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync(device)
    if trace is not None:
        raw = trace.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    return device_summary(prof, steps)


def device_summary(prof, steps: int, top: int = 25) -> dict:
    """Kernel time (the GPU activities' durations summed), the time the GPU was busy (their
    union), its idle time between the first and the last, and the top kernels by time, each per
    step. From the profiler's device events only: its per-op table also charges each CPU op
    with its kernels' time, so summing that table counts every kernel twice."""
    events = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, None
    gaps = []
    for s, e in spans:
        if end is None or s >= end:
            if end is not None:
                gaps.append(s - end)
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    window = (spans[-1][1] - spans[0][0]) if spans else 0.0
    by_name: dict[str, list[float]] = {}
    for e in events:
        count_time = by_name.setdefault(e.name, [0, 0.0])
        count_time[0] += 1
        count_time[1] += e.time_range.end - e.time_range.start
    kernels = sorted(((n, c, t) for n, (c, t) in by_name.items()), key=lambda k: -k[2])
    total = sum(k[2] for k in kernels)
    return {
        "kernel_ms": total / 1e3 / steps,
        "busy_ms": busy / 1e3 / steps,
        "window_ms": window / 1e3 / steps,
        "gap_ms": (window - busy) / 1e3 / steps,
        "largest_gaps_us": sorted(gaps, reverse=True)[:8],
        "launches_per_step": sum(k[1] for k in kernels) / steps,
        "top_kernels": [
            {"name": n[:160], "per_step": cnt / steps, "ms_per_step": t / 1e3 / steps}
            for n, cnt, t in kernels[:top]
        ],
    }
