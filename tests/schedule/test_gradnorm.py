"""``square_norm``: the float64 sum of squares every schedule's clipping norm uses, without a
float64 copy; equal to the copy's result to float64 rounding for every dtype a gradient has."""

from __future__ import annotations

import pytest
import torch

from moesaic.gradnorm import CPU_SLICE, square_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_square_norm_is_the_float64_sum_of_squares(dtype):
    g = (torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 7).to(dtype)
    got = square_norm(g.t())  # non-contiguous too
    want = g.double().square().sum()
    assert got.dtype == torch.float64 and got.dim() == 0
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    # large values whose squares overflow float32 stay finite in float64
    big = torch.full((4,), 3e20, dtype=torch.float32)
    assert square_norm(big).item() == pytest.approx(4 * 9e40, rel=1e-6)
    assert square_norm(torch.empty(0)).item() == 0.0


def test_square_norm_of_a_tensor_cut_into_slices():
    """Above ``CPU_SLICE`` elements the CPU path sums slices (the last one shorter): the same
    sum to float64 rounding, for a contiguous and a transposed gradient."""
    n = 2 * CPU_SLICE + 123
    g = torch.randn(n, 3, generator=torch.Generator().manual_seed(1)).mul_(1e3)
    for t in (g, g.t()):
        assert square_norm(t).item() == pytest.approx(t.double().square().sum().item(), rel=1e-12)


def test_square_norm_does_not_track_gradients():
    p = torch.ones(5, requires_grad=True)
    assert not square_norm(p * 2).requires_grad
