"""The grouped GEMM (forward, dx and dw) and the fused SwiGLU GEMM against their torch
references, fp32 and bf16, under Triton's interpreter (tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moesaic.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from moesaic.kernels.swiglu import grouped_swiglu, grouped_swiglu_reference

DTYPES = [torch.float32, torch.bfloat16]

# (rows per group, K, N): the kernels' tiles are 16 rows x 32 columns x 32 deep
GROUPS = [
    ([1], 16, 16),  # one row, one group
    ([5, 0, 17, 3], 20, 36),  # an empty expert between two; odd K and N; a multi-tile group
    ([0, 0, 9], 33, 17),  # leading empty experts; K past one 32-deep step
    ([7, 11, 0], 48, 40),  # a trailing empty expert; N past one 32-column tile
    ([0, 40, 0, 0, 0], 16, 24),  # every row to one expert (E = 5); rows past two tiles
    ([0, 0, 0], 24, 16),  # no rows at all: zero weight gradients, still in the graph
]


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.long).cumsum(0).to(torch.int32)


def _run(fn, ref_fn, inputs, g, dtype):
    """The kernel's output and gradients, and the reference's in ``dtype`` and in fp64."""
    xs = [t.to(dtype).requires_grad_() for t in inputs]
    y = fn(*xs)
    fast = (y, *torch.autograd.grad(y, xs, g.to(dtype)))
    refs = []
    for ref_dtype in (dtype, torch.float64):
        rs = [t.to(dtype).to(ref_dtype).requires_grad_() for t in inputs]  # same rounded inputs
        yr = ref_fn(*rs)
        refs.append((yr, *torch.autograd.grad(yr, rs, g.to(dtype).to(ref_dtype))))
    return fast, refs[0], refs[1]


@pytest.mark.parametrize(("counts", "K", "N"), GROUPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_gemm_matches_reference(counts, K, N, dtype, close):
    gen = torch.Generator().manual_seed(sum(counts) + K + N)
    M, E = sum(counts), len(counts)
    offs_e = _offsets(counts)
    x_MK = torch.randn(M, K, generator=gen)
    w_eKN = torch.randn(E, K, N, generator=gen) / K**0.5
    g_MN = torch.randn(M, N, generator=gen)
    fast, ref, ref64 = _run(
        lambda x, w: grouped_gemm(x, w, offs_e),
        lambda x, w: grouped_gemm_reference(x, w, offs_e),
        (x_MK, w_eKN),
        g_MN,
        dtype,
    )
    for name, f, r, r64 in zip(("y", "x.grad", "w.grad"), fast, ref, ref64):
        close(f, r, r64, name)
    assert not fast[2][[i for i, c in enumerate(counts) if c == 0]].any()  # empty: zero grads


@pytest.mark.parametrize(("counts", "K", "N"), GROUPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_swiglu_matches_reference(counts, K, N, dtype, close):
    gen = torch.Generator().manual_seed(3 * sum(counts) + K + N)
    M, E = sum(counts), len(counts)
    offs_e = _offsets(counts)
    x_MH = torch.randn(M, K, generator=gen)
    w1_eHF = torch.randn(E, K, N, generator=gen) / K**0.5
    w3_eHF = torch.randn(E, K, N, generator=gen) / K**0.5
    g_MF = torch.randn(M, N, generator=gen)
    fast, ref, ref64 = _run(
        lambda x, w1, w3: grouped_swiglu(x, w1, w3, offs_e),
        lambda x, w1, w3: grouped_swiglu_reference(x, w1, w3, offs_e),
        (x_MH, w1_eHF, w3_eHF),
        g_MF,
        dtype,
    )
    for name, f, r, r64 in zip(("h", "x.grad", "w1.grad", "w3.grad"), fast, ref, ref64):
        close(f, r, r64, name)


@pytest.mark.parametrize("fused", [False, True])
def test_no_host_sync(fused):
    """Forward and both backward GEMMs read nothing of the offsets (or anything else) on the
    host: the grid comes from M and e alone."""
    from moesaic.testing import HostSyncCounter

    x_MK = torch.randn(21, 16, requires_grad=True)
    w_eKN = torch.randn(3, 16, 24, requires_grad=True)
    offs_e = _offsets([8, 0, 13])
    with HostSyncCounter(strict_constructors=True) as syncs:
        y = (
            grouped_swiglu(x_MK, w_eKN, w_eKN, offs_e)
            if fused
            else grouped_gemm(x_MK, w_eKN, offs_e)
        )
        y.sum().backward()
    syncs.check(at_most=0, what="grouped GEMM fwd+bwd")


def test_grouped_gemm_is_deterministic():
    x_MK = torch.randn(21, 24)
    w_eKN = torch.randn(3, 24, 20, requires_grad=True)
    offs_e = _offsets([8, 0, 13])
    runs = []
    for _ in range(2):
        y = grouped_gemm(x_MK, w_eKN, offs_e)
        runs.append((y, *torch.autograd.grad(y.square().sum(), w_eKN)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_bad_arguments_raise():
    x_MK = torch.randn(4, 16)
    with pytest.raises(ValueError, match="int32"):
        grouped_gemm(x_MK, torch.randn(2, 16, 8), torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="dtype"):
        grouped_gemm(x_MK, torch.randn(2, 16, 8).bfloat16(), _offsets([2, 2]))
    with pytest.raises(ValueError, match=r"\[M, K\] and \[e, K, N\]"):
        grouped_gemm(x_MK, torch.randn(2, 8, 8), _offsets([2, 2]))
