"""``moesaic calibrate``'s GPU figures (``moesaic.measure.gpucal``) are measurements in a physical
range: grouped GEMMs below about the dense rate and faster per FLOP with more rows per expert,
a small kernel in microseconds, a layer step of tens to hundreds of kernels, issued in
milliseconds by the host.

The dense rate is measured before and after the grouped GEMMs and the higher one kept: under
``gpu_check``'s parallel workers the GPU is shared, and a dense rate timed while another test ran
on it once came out at half, which put the grouped points at 1.6-2.0x "the dense rate" (H200,
2026-11-27)."""

from __future__ import annotations

from _gpu_helpers import NEEDS_CUDA

from moesaic.measure import gpucal
from moesaic.measure.machine import measure

pytestmark = NEEDS_CUDA


def test_gpu_calibration_figures_are_physical():
    before = measure()["half_flops_per_s"]
    # against a rate of 1 FLOP/s each point is the grouped GEMMs' achieved FLOP/s
    points = gpucal.grouped_gemm_efficiency(1.0, repeats=3)
    half = max(before, measure()["half_flops_per_s"])
    points = tuple((rows, flops / half) for rows, flops in points)
    assert [r for r, _ in points] == [float(m) for m in gpucal.GEMM_ROWS]
    assert all(0.02 < e < 1.5 for _, e in points), points
    assert points[-1][1] > points[0][1], points
    assert 1e-7 < gpucal.launch_seconds(repeats=3) < 1e-4
    kernels, host_s = gpucal.layer_step_figures(stream=5)
    assert 20 <= kernels <= 2000 and 1e-5 < host_s < 1.0
