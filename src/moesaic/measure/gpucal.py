"""What ``moesaic calibrate`` measures on a GPU beyond the matmul rates and the copy bandwidth
(``machine.measure``), for the simulator's GPU pricing (``Profile.expert_gemm_s``,
``Profile.layer_launch_s``):

* ``gemm_efficiency``: the experts' grouped GEMMs against the dense rate, by rows per group.
  A grouped GEMM of few rows per expert runs below one dense GEMM of the same FLOPs (tile
  quantisation, a weight read per group, the weight gradient's short reduction): the first H200
  run (issue 27) measured 0.94 of the dense rate at 2,048 rows per expert and 0.73 at 512.
  Measured here with ``moesaic.experts.grouped_mm`` (what the layer runs), forward and backward
  (input and weight gradients: the three GEMMs of a grouped linear), bf16, at a fixed shape chosen
  before any layer step was compared with it: ``GEMM_TOTAL_ROWS`` rows in groups of ``M`` rows
  for ``M`` in ``GEMM_ROWS``, each group ``M x GEMM_DIM @ GEMM_DIM x GEMM_DIM``; the efficiency
  is the dense FLOPs at ``half_flops_per_s`` over the measured time.
* ``launch_s``: the GPU's time per small kernel when the host has queued them ahead (a stretch
  of a step's routing, aux-loss and bookkeeping kernels behind a long GEMM): a kernel's minimum
  run plus the gap to the next. Timed behind ``torch.cuda._sleep``, so the host's launch cost
  is not in it.
* ``layer_kernels``: kernels (and memsets, device copies) of one forward + backward of a
  dropless MoE layer at EP 1, counted by the profiler on a small bf16 layer of the default
  configuration: what the simulator multiplies by ``launch_s`` per MoE layer.
* ``layer_host_s``: the host's seconds to issue that forward + backward (Python, autograd,
  launches), the floor of a layer step whose kernels take less: the simulator's layer step
  is at least this (added after the second H200 run of issue 27 found its fine-grained top-2
  step host-bound: the host took 3.9 ms a step, the GPU's kernels 3.2 ms).
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

GEMM_ROWS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
GEMM_TOTAL_ROWS = 16384
GEMM_DIM = 2048
LAUNCH_KERNELS = 400


def _elapsed_s(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn()`` on the current CUDA stream (CUDA events)."""
    import torch

    out = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(out)


def grouped_gemm_efficiency(
    half_flops_per_s: float, *, repeats: int = 5
) -> tuple[tuple[float, float], ...]:
    """``(rows_per_group, efficiency)`` points of the grouped GEMMs (module docstring)."""
    import torch

    from moesaic.experts import group_offsets

    points = []
    D = GEMM_DIM
    for M in GEMM_ROWS:
        G = max(1, GEMM_TOTAL_ROWS // M)
        x = torch.randn(G * M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(G, D, D, device="cuda", dtype=torch.bfloat16) * D**-0.5
        w.requires_grad_()
        g = torch.randn(G * M, D, device="cuda", dtype=torch.bfloat16)
        counts = [M] * G
        step = functools.partial(_grouped_step, x, w, g, counts, group_offsets(counts, x.device))
        step()  # warm-up (and the fast path's one-time self-check)
        seconds = _elapsed_s(step, repeats)
        points.append((float(M), 3 * 2.0 * G * M * D * D / (seconds * half_flops_per_s)))
    return tuple(points)


def _grouped_step(x: Any, w: Any, g: Any, counts: list[int], offs: Any) -> None:
    """One grouped linear forward + backward: the three GEMMs."""
    from moesaic.experts import grouped_mm

    x.grad = w.grad = None
    grouped_mm(x, w, counts, offs_e=offs).backward(g)


def launch_seconds(kernels: int = LAUNCH_KERNELS, repeats: int = 5) -> float:
    """Device seconds per small kernel queued ahead of the GPU (module docstring)."""
    import torch

    t = torch.zeros(256, device="cuda")
    out = []
    for _ in range(repeats):
        torch.cuda._sleep(50_000_000)  # tens of ms: the host queues the kernels meanwhile
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(kernels):
            t.add_(1.0)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e-3 / kernels)
    return statistics.median(out)


def layer_step_figures(stream: int = 20) -> tuple[float, float]:
    """``(kernels, host_s)`` of one forward + backward of a small bf16 dropless layer (EP 1):
    its device activities (kernels, memsets, device copies), counted by the profiler, and the
    host's seconds to issue it (``stream`` steps back to back, timed before the one sync: the
    layer is small, so the host is the bound)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moesaic import MoEConfig, MoELayer, aux_loss

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=8, top_k=2)
    layer = MoELayer(cfg).to("cuda", torch.bfloat16)
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        xx = x.detach().requires_grad_()
        torch.autograd.backward([layer(xx), aux_loss(layer)], [g, None])
        layer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(stream):
        step()
    host_s = (time.perf_counter() - t0) / stream
    torch.cuda.synchronize()
    steps = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    count = sum(
        1
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    return count / steps, host_s


def measure_gpu(half_flops_per_s: float) -> dict[str, Any]:
    """The figures of the module docstring, on the current CUDA device."""
    kernels, host_s = layer_step_figures()
    return {
        "gemm_efficiency": grouped_gemm_efficiency(half_flops_per_s),
        "launch_s": launch_seconds(),
        "layer_kernels": kernels,
        "layer_host_s": host_s,
    }
