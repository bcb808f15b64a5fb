"""What every benchmark result states: machine, versions, commit, date."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from collections.abc import Callable

import torch


def run_metadata() -> dict:
    """Machine, versions, git commit and UTC date of this run."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit or "unknown",
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def time_calls(fn: Callable[[], object], iters: int, warmup: int) -> list[float]:
    """Wall seconds of ``iters`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def summarize(times: list[float]) -> dict:
    """Median and spread (min, max) in milliseconds."""
    ordered = sorted(times)
    return {
        "median_ms": 1e3 * ordered[len(ordered) // 2],
        "min_ms": 1e3 * ordered[0],
        "max_ms": 1e3 * ordered[-1],
        "n": len(ordered),
    }
