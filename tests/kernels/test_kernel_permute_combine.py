"""permute and combine (the unpermute) against their torch references, forward and backward,
under Triton's interpreter (tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moesaic.kernels.combine import combine, combine_reference
from moesaic.kernels.permute import permute, permute_reference

DTYPES = [torch.float32, torch.bfloat16]


def _slots(T: int, K: int, rows: int, drop: float, seed: int) -> torch.Tensor:
    """A random slot map: distinct rows among ``rows``, a ``drop`` fraction of -1."""
    gen = torch.Generator().manual_seed(seed)
    slot = torch.randperm(rows, generator=gen)[: T * K]
    dropped = torch.rand(T * K, generator=gen) < drop
    return torch.where(dropped, -1, slot).view(T, K)


SHAPES = [
    (1, 1, 16, 1, 0.0),  # T = 1, K = 1
    (7, 2, 37, 14, 0.0),  # odd H, every row filled (the dropless layout)
    (11, 3, 48, 40, 0.3),  # capacity drops, padding rows left zero (the window's cells)
    (5, 4, 70, 20, 1.0),  # every assignment dropped; H past one 64-column block
    (0, 2, 16, 3, 0.0),  # no tokens
]


@pytest.mark.parametrize(("T", "K", "H", "R", "drop"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_matches_reference(T, K, H, R, drop, dtype, close):
    slot_TK = _slots(T, K, max(R, T * K), drop, seed=T + K)
    R = max(R, T * K)
    # payload encodes its origin: token t, column h holds t + h / 64 (exact in bf16 for t < 2)
    x_TH = (torch.arange(T)[:, None] + torch.arange(H)[None, :] / 64).to(dtype)
    x_TH.requires_grad_()
    out = permute(x_TH, slot_TK, R)
    assert torch.equal(out, permute_reference(x_TH.detach(), slot_TK, R))
    g_RH = torch.randn(R, H).to(dtype)
    (dx,) = torch.autograd.grad(out, x_TH, g_RH)
    x64 = x_TH.detach().double().requires_grad_()
    (dx64,) = torch.autograd.grad(permute_reference(x64, slot_TK, R), x64, g_RH.double())
    x_ref = x_TH.detach().clone().requires_grad_()
    (dx_ref,) = torch.autograd.grad(permute_reference(x_ref, slot_TK, R), x_ref, g_RH)
    close(dx, dx_ref, dx64, "x.grad")  # a sum over the K rows: fp32 in the kernel


@pytest.mark.parametrize(("T", "K", "H", "R", "drop"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_matches_reference(T, K, H, R, drop, dtype, close):
    R = max(R, T * K)
    slot_TK = _slots(T, K, R, drop, seed=2 * T + K)
    gen = torch.Generator().manual_seed(T * 100 + K)
    rows_RH = torch.randn(R, H, generator=gen).to(dtype).requires_grad_()
    w_TK = torch.rand(T, K, generator=gen).requires_grad_()  # fp32 weights, as the router's
    g_TH = torch.randn(T, H, generator=gen).to(dtype)
    y = combine(rows_RH, slot_TK, w_TK)
    grads = torch.autograd.grad(y, (rows_RH, w_TK), g_TH)
    refs = {}
    for ref_dtype in (dtype, torch.float64):
        rows = rows_RH.detach().to(ref_dtype).requires_grad_()
        w = w_TK.detach().to(torch.float64 if ref_dtype == torch.float64 else torch.float32)
        w.requires_grad_()
        yr = combine_reference(rows, slot_TK, w)
        refs[ref_dtype] = (yr, *torch.autograd.grad(yr, (rows, w), g_TH.to(ref_dtype)))
    names = ("y", "rows.grad", "w.grad")
    for name, fast, ref, ref64 in zip(names, (y, *grads), refs[dtype], refs[torch.float64]):
        close(fast, ref.to(fast.dtype), ref64, name)
    if drop == 1.0:  # nothing kept: zero output, zero gradients
        assert not y.any() and not grads[0].any() and not grads[1].any()


def test_combine_is_deterministic():
    slot_TK = _slots(9, 3, 30, 0.2, seed=1)
    rows_RH = torch.randn(30, 24)
    w_TK = torch.rand(9, 3)
    assert torch.equal(combine(rows_RH, slot_TK, w_TK), combine(rows_RH, slot_TK, w_TK))


def test_bad_arguments_raise():
    slot_TK = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="slot_TK has 2 tokens"):
        permute(torch.zeros(3, 16), slot_TK, 4)
    with pytest.raises(ValueError, match="w_TK"):
        combine(torch.zeros(4, 16), slot_TK, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        permute(torch.zeros(2, 16, dtype=torch.long), slot_TK, 4)


def test_without_zero_fill_every_row_is_still_written(monkeypatch):
    """``zero_fill=False`` (the dropless layout: R = T*K, no -1) skips the zeroing; the buffers
    are then uninitialised memory, here NaN-filled, so a row left unwritten shows."""
    T, K, H = 7, 3, 1100  # H past one 1024-column block
    slot_TK = torch.randperm(T * K).view(T, K)
    x_TH = torch.randn(T, H, requires_grad=True)
    new_empty, empty_like = torch.Tensor.new_empty, torch.empty_like

    def nan(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *a, **k: nan(new_empty(t, *a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda t, **k: nan(empty_like(t, **k)))
    rows = permute(x_TH, slot_TK, T * K, zero_fill=False)
    y = combine(rows, slot_TK, torch.rand(T, K), zero_fill=False)
    (dx,) = torch.autograd.grad(y.sum(), x_TH)
    assert torch.equal(rows, permute_reference(x_TH.detach(), slot_TK, T * K))
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
