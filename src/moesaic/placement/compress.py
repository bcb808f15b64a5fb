"""SR expert compression (HybridEP §IV-B): shared expert + top-k residual in value-index form.

Shape legend: E experts, X... the shape of one expert weight (e.g. H x F), N = numel of it,
k kept residual entries.

The shared expert is a mean of experts (one per weight matrix); encoder and decoder hold the same
one (``hybrid`` all-reduces it before a gather; ``HybridOptions.shared_expert`` says over which
experts, or none: zeros, the top-k of the weight itself). An expert is sent as its residual
``w - shared`` reduced to its ``k = ceil(N / CR)`` largest-magnitude entries, in value-index
form; the receiver adds the decoded residual back to its shared expert.

``CR`` (compression ratio) is the element ratio ``N / k``, as in the paper (CR = 50 keeps 2%).
When every entry is kept (``CR = 1``) the weight itself goes dense, without indices or the
shared expert (``shared + (w - shared)`` would round), so decoding is bit-exact and the bytes
equal the uncompressed expert's. Otherwise the bytes are ``k * (value bytes + index bytes)``: int32 indices while
``N < 2^31``.

Error bound: top-k by magnitude drops the ``N - k`` smallest entries of the residual ``r``, so
``||r - topk(r)||^2 <= (N - k) / N * ||r||^2``; the reported relative error is
``||w - decode|| / ||w||`` and its bound ``sqrt((N - k) / N) * ||r|| / ||w||``.

Selection (:func:`top_k_positions`, the one top-k rule of the encoders here and in
``moesaic.strategies.migration``): an exact top-k by magnitude, computed on a candidate subset.
A strided sample of ``|r|`` gives a per-row threshold whose count of entries at or above it is
about ``CANDIDATE_MARGIN * k``; when at least ``k`` entries reach it, every entry of the true
top-k does (the k-th largest value is at least the threshold), so the top-k of the candidates
is the top-k of the row. When fewer reach it (a sample unlike its row) the row's full top-k
runs instead. A full ``torch.topk`` over ``N`` entries with ``k = N / CR`` dominated the encode
on a CPU (benchmarks/results/seeds_hybridep_codec.json).

``compressed_nbytes`` is torch-free (the cost model imports it); torch is imported lazily.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moesaic.checks import check_int, check_number

if TYPE_CHECKING:
    import torch

__all__ = [
    "CompressedExpert",
    "SRStats",
    "compressed_nbytes",
    "index_nbytes",
    "kept_entries",
    "shared_expert",
    "sr_decode",
    "sr_encode",
    "sr_roundtrip",
    "top_k_positions",
]

INT32_LIMIT = 2**31 - 1
# top_k_positions: the threshold aims at this many candidates per kept entry, from a strided
# sample of about SAMPLE_ENTRIES entries per row
CANDIDATE_MARGIN = 1.25
SAMPLE_ENTRIES = 1 << 15


def kept_entries(numel: int, compression_ratio: float) -> int:
    """``k = ceil(N / CR)``, at least 1: residual entries an expert weight keeps."""
    check_int("numel", numel, 1)
    check_number("compression_ratio", compression_ratio, 1.0)
    return max(1, math.ceil(numel / compression_ratio))


def index_nbytes(numel: int) -> int:
    """Bytes of one index: 4 (int32) while every index fits, else 8."""
    return 4 if numel <= INT32_LIMIT else 8


def compressed_nbytes(numel: int, compression_ratio: float, value_bytes: int) -> int:
    """Bytes the all-gather sends for one compressed weight of ``numel`` entries.

    ``numel * value_bytes`` when every entry is kept (dense residual, no indices), else
    ``k * (value_bytes + index_bytes)``.
    """
    check_int("value_bytes", value_bytes, 1)
    k = kept_entries(numel, compression_ratio)
    if k >= numel:
        return numel * value_bytes
    return k * (value_bytes + index_nbytes(numel))


@dataclass(kw_only=True, slots=True, frozen=True)
class CompressedExpert:
    """One expert weight in value-index form.

    Attributes:
        values_k: The kept residual entries (``k`` of them), or, when dense (``k == N``), the
            flattened weight itself.
        indices_k: Their flat positions (int32/int64), or None when dense.
        shape: The weight's shape.
        compression_ratio: CR it was encoded with.
    """

    values_k: torch.Tensor
    indices_k: torch.Tensor | None
    shape: tuple[int, ...]
    compression_ratio: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: values plus indices."""
        n = self.values_k.numel() * self.values_k.element_size()
        if self.indices_k is not None:
            n += self.indices_k.numel() * self.indices_k.element_size()
        return n


@dataclass(kw_only=True, slots=True, frozen=True)
class SRStats:
    """What :func:`sr_roundtrip` measured.

    Attributes:
        rel_error: ``||w - decode(encode(w))|| / ||w||``.
        rel_error_bound: ``sqrt((N - k) / N) * ||w - shared|| / ||w||``.
        nbytes: Compressed bytes.
        dense_nbytes: Bytes of the uncompressed weight.
    """

    rel_error: float
    rel_error_bound: float
    nbytes: int
    dense_nbytes: int

    @property
    def byte_ratio(self) -> float:
        """Uncompressed over compressed bytes (CR x value/(value + index) bytes when sparse)."""
        return self.dense_nbytes / self.nbytes


def shared_expert(w_EX: torch.Tensor) -> torch.Tensor:
    """The shared expert: the mean over the leading expert dimension (``X``-shaped)."""
    if w_EX.dim() < 1 or w_EX.shape[0] < 1:
        raise ValueError(f"w_EX (shape {tuple(w_EX.shape)}) must stack at least one expert")
    return w_EX.mean(dim=0)


def top_k_positions(abs_rN: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of the ``k`` largest entries of each row of ``abs_rN`` (``[rows, N]``,
    non-negative), ascending per row (``[rows, k]``, int64): see the module docstring. Ties at
    the k-th value are broken by torch's order, deterministic on one device."""
    import torch

    n = abs_rN.shape[1]
    check_int("k", k, 1)
    if k > n:
        raise ValueError(f"k ({k}) must be at most the row length {n}")
    stride = max(1, n // SAMPLE_ENTRIES)
    sample_rm = abs_rN[:, ::stride]
    m = sample_rm.shape[1]
    want = int(CANDIDATE_MARGIN * k * m / n) + 8
    if want >= m or stride == 1:  # no smaller candidate set to gain
        idx_rk = torch.topk(abs_rN, k, dim=1, sorted=False).indices
        return torch.sort(idx_rk, dim=1).values
    thr_r1 = torch.topk(sample_rm, want, dim=1, sorted=True).values[:, -1:]
    out = []
    for row_N, thr in zip(abs_rN, thr_r1):
        cand_c = torch.nonzero(row_N >= thr).squeeze(1)
        if cand_c.numel() >= k:
            idx_k = cand_c[torch.topk(row_N[cand_c], k, sorted=False).indices]
        else:
            idx_k = torch.topk(row_N, k, sorted=False).indices
        out.append(torch.sort(idx_k).values)
    return torch.stack(out)


def sr_encode(
    w_X: torch.Tensor, shared_X: torch.Tensor, compression_ratio: float
) -> CompressedExpert:
    """Encodes one expert weight against the shared expert (residual, top-k, value-index)."""
    import torch

    if w_X.shape != shared_X.shape:
        raise ValueError(
            f"shared_X (shape {tuple(shared_X.shape)}) must have the shape of w_X "
            f"({tuple(w_X.shape)})"
        )
    numel = w_X.numel()
    k = kept_entries(numel, compression_ratio)
    if k >= numel:
        return CompressedExpert(
            values_k=w_X.reshape(-1).clone(),
            indices_k=None,
            shape=tuple(w_X.shape),
            compression_ratio=float(compression_ratio),
        )
    residual_N = (w_X - shared_X).reshape(-1)
    # ascending positions: deterministic bytes, cache-friendly scatter
    idx_k = top_k_positions(residual_N.abs().reshape(1, -1), k)[0]
    idx_dtype = torch.int32 if index_nbytes(numel) == 4 else torch.int64
    return CompressedExpert(
        values_k=residual_N[idx_k].clone(),
        indices_k=idx_k.to(idx_dtype),
        shape=tuple(w_X.shape),
        compression_ratio=float(compression_ratio),
    )


def sr_decode(compressed: CompressedExpert, shared_X: torch.Tensor) -> torch.Tensor:
    """``shared + residual``: the restored expert weight (recover and add fused in one pass).

    A dense encoding (every entry kept) carries the weight itself and is returned as is.
    """
    if tuple(shared_X.shape) != compressed.shape:
        raise ValueError(
            f"shared_X (shape {tuple(shared_X.shape)}) must have the encoded shape "
            f"{compressed.shape}"
        )
    values = compressed.values_k.to(shared_X.dtype)
    if compressed.indices_k is None:
        return values.reshape(compressed.shape).clone()
    out_N = shared_X.reshape(-1).clone()
    out_N.index_add_(0, compressed.indices_k.long(), values)
    return out_N.reshape(compressed.shape)


def sr_roundtrip(
    w_X: torch.Tensor, shared_X: torch.Tensor, compression_ratio: float
) -> tuple[torch.Tensor, SRStats]:
    """Encodes and decodes ``w_X``; returns the restored weight and the error and byte sizes."""
    compressed = sr_encode(w_X, shared_X, compression_ratio)
    restored_X = sr_decode(compressed, shared_X)
    w64 = w_X.double()
    norm = float(w64.norm())
    numel = w_X.numel()
    k = kept_entries(numel, compression_ratio)
    res_norm = float((w64 - shared_X.double()).norm())
    err = float((w64 - restored_X.double()).norm())
    stats = SRStats(
        rel_error=err / norm if norm else err,
        rel_error_bound=math.sqrt((numel - k) / numel) * (res_norm / norm if norm else res_norm),
        nbytes=compressed.nbytes,
        dense_nbytes=numel * w_X.element_size(),
    )
    return restored_X, stats
