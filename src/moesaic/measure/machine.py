"""This machine's compute, measured for a profile (``moesaic calibrate``, ``moesaic plan``
without one): the fp32 and bf16 matmul rates, the per-op overhead and the memory bandwidth
(``measure``). On a GPU, ``measure.gpucal`` measures the rest of what the simulator prices there.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from moesaic.checks import check_positive_int
from moesaic.sim.profile import OPS_PER_TASK, Profile

__all__ = ["default_matmul_size", "measure", "profile_here"]


def default_matmul_size(device: str) -> int:
    """``measure``'s matmul size on ``device``: 512 on a CPU, 4096 on a GPU."""
    return 4096 if device.startswith("cuda") else 512


def measure(
    size: int | None = None, *, repeats: int = 7, device: str | None = None
) -> dict[str, Any]:
    """Measures this machine: ``flops_per_s`` and ``half_flops_per_s`` (median ``size^3`` fp32
    and bf16 matmuls), ``task_overhead_s`` (``OPS_PER_TASK`` x the median time of a 1 x 1
    matmul op), ``mem_bytes_per_s`` (a device-to-device copy of 1 GiB on a GPU, 64 MiB on a
    CPU, bytes read plus written) and ``device`` ("cpu" or "cuda").

    ``size`` defaults to 512 on a CPU and 4096 on a GPU, where a 512^3 matmul is bound by its
    launch, not its math (measured on an H100: 7.3 TFLOP/s fp32 at 512). Takes about a second.
    ``device`` defaults to CUDA when available.
    """
    import torch

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = size if size is not None else default_matmul_size(dev)
    check_positive_int("size", size)

    def timed(fn: Any) -> float:
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            if dev == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    a = torch.randn(size, size, device=dev)
    b = torch.randn(size, size, device=dev)
    tiny = torch.randn(1, 1, device=dev)
    if dev.startswith("cuda"):
        # An idle GPU sits at a low clock: a second of matmuls first, so that every figure
        # (and ``measure.gpucal``'s after them) is taken at the clock a training step runs at.
        # (Issue 27's H200 runs: the bf16 4096^3 rate 624-715 TFLOP/s across cold starts.)
        t_end = time.perf_counter() + 1.0
        while time.perf_counter() < t_end:
            for _ in range(10):
                a @ b
            torch.cuda.synchronize()
    flops = 2.0 * size**3 / timed(lambda: a @ b)
    a16, b16 = a.bfloat16(), b.bfloat16()
    half = 2.0 * size**3 / timed(lambda: a16 @ b16)
    op_s = timed(lambda: [tiny @ tiny for _ in range(100)]) / 100
    kind = "cuda" if dev.startswith("cuda") else "cpu"
    n = (2**30 if kind == "cuda" else 2**26) // 4
    src, dst = torch.rand(n, device=dev), torch.empty(n, device=dev)
    mem = 2.0 * 4 * n / timed(lambda: dst.copy_(src))
    return {
        "flops_per_s": flops,
        "half_flops_per_s": half,
        "task_overhead_s": OPS_PER_TASK * op_s,
        "mem_bytes_per_s": mem,
        "device": kind,
    }


def profile_here(source: str) -> Profile:
    """A profile of this machine's :func:`measure` (about a second): what ``moesaic plan``
    prices without ``--profile``; ``source`` says who measured it."""
    rates = measure()
    return Profile(
        flops_per_s=rates["flops_per_s"],
        half_flops_per_s=rates["half_flops_per_s"],
        task_overhead_s=rates["task_overhead_s"],
        mem_bytes_per_s=rates["mem_bytes_per_s"],
        device=rates["device"],
        source=source,
    )
