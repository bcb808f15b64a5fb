"""moesaic.placement.compress: SR expert compression round trip, CR = 1 exactness, byte sizes."""

from __future__ import annotations

import math

import pytest
import torch

from moesaic.placement import compress
from moesaic.placement.compress import (
    compressed_nbytes,
    kept_entries,
    shared_expert,
    sr_decode,
    sr_encode,
    sr_roundtrip,
    top_k_positions,
)
from moesaic.strategies.hybrid_options import HybridOptions


def _experts(E: int = 4, shape: tuple[int, ...] = (16, 24), dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # experts = a common part + a small expert-specific part, the redundancy SR exploits
    common = torch.randn(shape, generator=g, dtype=dtype)
    return common + 0.1 * torch.randn((E, *shape), generator=g, dtype=dtype)


def test_shared_expert_is_the_mean() -> None:
    w_EX = _experts()
    assert torch.equal(shared_expert(w_EX), w_EX.mean(dim=0))
    with pytest.raises(ValueError, match="w_EX"):
        shared_expert(torch.empty(0, 3))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cr_1_is_exact_and_dense(dtype: torch.dtype) -> None:
    w_EX = _experts(dtype=dtype)
    shared = shared_expert(w_EX)
    for w in w_EX:
        c = sr_encode(w, shared, 1.0)
        assert c.indices_k is None  # dense residual: no index bytes
        assert c.nbytes == w.numel() * w.element_size()
        assert torch.equal(sr_decode(c, shared), w)  # bit-exact, whatever the dtype
        _, stats = sr_roundtrip(w, shared, 1.0)
        assert stats.rel_error == 0.0 and stats.byte_ratio == 1.0


def test_a_cr_that_keeps_every_entry_is_dense_and_exact() -> None:
    # a CR just above 1 still keeps every entry: dense, exact, whatever the shared expert
    w = _experts(shape=(7,))[0]
    shared = torch.zeros(7, dtype=w.dtype)
    c = sr_encode(w, shared, 1.0 + 1e-9)
    assert kept_entries(7, 1.0 + 1e-9) == 7 and c.indices_k is None
    assert torch.equal(sr_decode(c, torch.ones(7, dtype=w.dtype)), w)


@pytest.mark.parametrize("cr", [2.0, 5.0, 50.0, 384.0])
def test_round_trip_keeps_the_top_k_residual_and_bounds_the_error(cr: float) -> None:
    w_EX = _experts()
    shared = shared_expert(w_EX)
    w = w_EX[1]
    restored, stats = sr_roundtrip(w, shared, cr)
    k = kept_entries(w.numel(), cr)
    residual = (w - shared).reshape(-1)
    kept = (restored - shared).reshape(-1)
    top = torch.topk(residual.abs(), k).indices
    # exactly the k largest-magnitude residual entries survive, with their exact values
    assert torch.equal(kept[top], residual[top])
    assert int((kept != 0).sum()) == k
    assert 0 < stats.rel_error <= stats.rel_error_bound + 1e-15
    assert stats.rel_error == pytest.approx(float((w - restored).norm() / w.norm()), rel=1e-12)
    assert stats.nbytes == k * (8 + 4)  # fp64 values + int32 indices
    assert stats.nbytes == compressed_nbytes(w.numel(), cr, 8)
    assert stats.dense_nbytes == w.numel() * 8


def test_shared_expert_beats_direct_top_k() -> None:
    # the paper's w/ S vs w/o S: against the shared expert the residual is small, so top-k of it
    # loses far less than top-k of the raw weight
    w_EX = _experts()
    shared = shared_expert(w_EX)
    _, with_s = sr_roundtrip(w_EX[2], shared, 10.0)
    _, without_s = sr_roundtrip(w_EX[2], torch.zeros_like(shared), 10.0)
    assert with_s.rel_error < without_s.rel_error / 5


def test_values_and_indices_are_the_wire_format() -> None:
    w = torch.tensor([0.0, 5.0, -7.0, 1.0, 0.5, 3.0], dtype=torch.float32)
    c = sr_encode(w, torch.zeros(6), 3.0)  # k = 2
    assert c.indices_k is not None and c.indices_k.dtype == torch.int32
    assert c.indices_k.tolist() == [1, 2]  # ascending positions of |r| top-2
    assert c.values_k.tolist() == [5.0, -7.0]
    assert c.nbytes == 2 * 4 + 2 * 4
    assert sr_decode(c, torch.ones(6)).tolist() == [1.0, 6.0, -6.0, 1.0, 1.0, 1.0]


def test_deterministic() -> None:
    w_EX = _experts()
    shared = shared_expert(w_EX)
    a, b = sr_encode(w_EX[0], shared, 7.0), sr_encode(w_EX[0], shared, 7.0)
    assert c_equal(a, b)


def c_equal(a, b) -> bool:
    return torch.equal(a.values_k, b.values_k) and torch.equal(a.indices_k, b.indices_k)


@pytest.mark.parametrize(
    ("numel", "cr", "value_bytes", "expected"),
    [
        (100, 1.0, 2, 200),  # dense
        (100, 4.0, 2, 25 * 6),  # 25 kept, 2 + 4 bytes each
        (100, 3.0, 4, 34 * 8),  # ceil(100 / 3) = 34
        (10, 1000.0, 2, 6),  # at least one entry
        (2**31, 2.0, 2, 2**30 * (2 + 8)),  # int64 indices past int32
    ],
)
def test_compressed_nbytes(numel: int, cr: float, value_bytes: int, expected: int) -> None:
    assert compressed_nbytes(numel, cr, value_bytes) == expected


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: kept_entries(10, 0.5), "compression_ratio"),
        (lambda: kept_entries(0, 2.0), "numel"),
        (lambda: compressed_nbytes(10, math.inf, 2), "compression_ratio"),
        (lambda: sr_encode(torch.zeros(3), torch.zeros(4), 2.0), "shared_X"),
    ],
)
def test_invalid_arguments_name_the_field(call, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        call()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shared_expert": "global"}, r"^shared_expert \('global'\) must be one of"),
        ({"shared_expert": "all"}, r"^shared_expert \('all'\) applies to compressed gathers"),
        (
            {"shared_expert": "none", "compression_ratio": 10.0, "shared_expert_every": 4},
            r"^shared_expert_every \(4\) must be 1 with shared_expert 'none'",
        ),
    ],
)
def test_shared_expert_option_is_refused_where_it_does_not_apply(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        HybridOptions(**options)
    ok = HybridOptions(compression_ratio=10.0, shared_expert="all", shared_expert_every=4)
    assert ok.shared_expert == "all"


@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        (2, 200_000, 20_000),  # CR 10 on a sample-sized row: the candidate path
        (3, 100_003, 2_001),  # CR 50, a length the stride does not divide
        (1, 50_000, 40_000),  # the threshold would keep everything: the full top-k
        (2, 1_000, 7),  # a row shorter than the sample: the full top-k
    ],
)
def test_top_k_positions_is_the_exact_top_k(rows: int, n: int, k: int) -> None:
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(n)).abs()
    got = top_k_positions(x, k)
    want = torch.sort(torch.topk(x, k, dim=1).indices, dim=1).values
    assert torch.equal(got, want)  # continuous values: no ties, one top-k


def test_top_k_positions_falls_back_when_the_sample_misleads() -> None:
    # the strided sample sees only large entries: its threshold is above the row's k-th value,
    # too few entries reach it, and the row's full top-k runs
    n, k = 200_000, 5_000
    x = torch.rand(1, n, generator=torch.Generator().manual_seed(1))
    stride = n // compress.SAMPLE_ENTRIES
    x[0, ::stride] += 10.0
    sample = x[0, ::stride]
    want_c = int(compress.CANDIDATE_MARGIN * k * sample.numel() / n) + 8
    thr = torch.topk(sample, want_c).values[-1]
    assert int((x >= thr).sum()) < k  # the case this test is about
    got = top_k_positions(x, k)
    want = torch.sort(torch.topk(x, k, dim=1).indices, dim=1).values
    assert torch.equal(got, want)
    # ties at the k-th value: any k of them, the larger entries all kept, ascending
    t = torch.ones(1, n)
    t[0, :100] = 2.0
    got = top_k_positions(t, k)[0]
    assert got.numel() == k and bool((got[:-1] < got[1:]).all())
    assert set(range(100)) <= set(got.tolist())
