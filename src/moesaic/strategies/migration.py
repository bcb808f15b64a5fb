"""HybridEP's expert migration (§IV-B): SR-encoded expert all-gathers (the asynchronous
communicator of Fig. 10 that issues them ahead of the forward is
:class:`moesaic.strategies.prefetch.ExpertPrefetcher`).

Shape legend: e local experts, S ranks of the expert domain, X the shape of one expert weight
(H x F or F x H), N = numel(X), k kept residual entries, B bytes of one encoded expert.

Wire format of one weight matrix's ``e`` local experts (what the domain all-gather sends):

* dense (``CR = 1``, or ``k >= N``): the weights themselves ``[e, *X]``, bit-exact;
* sparse: ``[e, B]`` uint8, each row ``k`` residual values (the weight dtype) then their ``k``
  flat positions (int32, ascending), ``B = k * (value bytes + 4)``: the value-index form of
  :mod:`moesaic.placement.compress`, batched over the experts (same kept count, index dtype and
  top-k rule, tested equal to ``sr_encode``/``sr_decode`` per expert).

The shared expert is a mean of experts, all-reduced just before the gather over the groups it is
given (the domain's level groups by default; ``HybridOptions.shared_expert`` chooses): encoder and
decoder must use the same one. The paper keeps one shared expert for all ranks, synchronised every
iteration; a domain's mean is closer to its experts and needs no other group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moesaic.comm.collectives import EPGroup
from moesaic.placement.compress import kept_entries, top_k_positions

__all__ = [
    "PendingGather",
    "decode_experts",
    "encode_experts",
    "pack_rows",
    "start_gather",
    "unpack_rows",
]

Weights = tuple[torch.Tensor | None, ...]
Gathered = tuple[Weights, "PendingGather"]  # decoded experts, and what their gathers sent


def encode_experts(
    w_eX: torch.Tensor, shared_X: torch.Tensor | None, compression_ratio: float
) -> torch.Tensor:
    """The wire form of ``e`` experts of one weight matrix (see the module docstring)."""
    e, N = w_eX.shape[0], w_eX[0].numel()
    k = kept_entries(N, compression_ratio)
    if k >= N or shared_X is None:
        return w_eX.detach().contiguous()
    residual_eN = (w_eX.detach() - shared_X).reshape(e, N)
    idx_ek = top_k_positions(residual_eN.abs(), k)
    values_ek = residual_eN.gather(1, idx_ek)
    value_bytes = values_ek.contiguous().view(torch.uint8).reshape(e, -1)
    index_bytes = idx_ek.to(torch.int32).contiguous().view(torch.uint8).reshape(e, -1)
    return torch.cat([value_bytes, index_bytes], dim=1)


def decode_experts(
    payload: torch.Tensor,
    shared_X: torch.Tensor | None,
    shape_X: Sequence[int],
    dtype: torch.dtype,
    compression_ratio: float,
) -> torch.Tensor:
    """Gathered wire rows ``[S*e, ...]`` -> the experts ``[S*e, *X]`` (shared + residual)."""
    rows, N = payload.shape[0], 1
    for d in shape_X:
        N *= d
    k = kept_entries(N, compression_ratio)
    if k >= N or shared_X is None:
        return payload
    value_len = k * torch.empty((), dtype=dtype).element_size()
    values_rk = payload[:, :value_len].contiguous().view(dtype)
    idx_rk = payload[:, value_len:].contiguous().view(torch.int32).long()
    out_rN = shared_X.reshape(1, N).expand(rows, N).clone()
    out_rN.scatter_add_(1, idx_rk, values_rk)
    return out_rN.reshape(rows, *shape_X)


def _shared_experts(
    weights: Weights, groups: Sequence[EPGroup]
) -> tuple[list[torch.Tensor | None], int]:
    """The mean expert of the domain per weight matrix (the sum all-reduced over each level's
    group in turn covers the domain), and the all-reduce message's bytes."""
    present = [w.detach() for w in weights if w is not None]
    sums = torch.cat([w.sum(dim=0).reshape(-1) for w in present])
    count = present[0].shape[0]
    for g in groups:
        g.all_reduce(sums, what="hybrid shared-expert all_reduce")
        count *= g.size
    out: list[torch.Tensor | None] = []
    offset = 0
    for w in weights:
        if w is None:
            out.append(None)
            continue
        n = w[0].numel()
        out.append((sums[offset : offset + n] / count).reshape(w.shape[1:]).to(w.dtype))
        offset += n
    return out, sums.numel() * sums.element_size()


@dataclass(slots=True)
class PendingGather:
    """Issued all-gathers of one layer's experts; :meth:`result` waits and decodes them.

    Attributes:
        level_bytes: per level group, the bytes this rank sent to each other member (the
            encoded bundle so far, plus the shared experts' all-reduce message when computed).
        collectives: collectives issued (the shared-expert all-reduces and the gathers).
        shared: the shared experts the bundle was encoded against (None entries: dense).
        shared_bytes: the shared experts' all-reduce message (0: reused, given or dense), sent
            to each other member of every group of ``shared_groups`` (in ``level_bytes`` for
            the level groups).
    """

    finish: Callable[[], Weights] | None
    level_bytes: list[int]
    collectives: int
    shared: list[torch.Tensor | None]
    shared_bytes: int = 0

    def result(self) -> Weights:
        """Wait, decode and return the experts (once): the call then lets go of what it
        held (the packed local bundle, the gathered message), which a consumed gather's
        record (kept for its statistics and shared experts) would otherwise keep alive."""
        if self.finish is None:
            raise RuntimeError("PendingGather.result: already taken")
        finish, self.finish = self.finish, None
        return finish()


def start_gather(
    weights: Weights,
    groups: Sequence[EPGroup],
    compression_ratio: float,
    name: str = "experts",
    shared: list[torch.Tensor | None] | None = None,
    dtype: torch.dtype | None = None,
    shared_groups: Sequence[EPGroup] | None = None,
) -> PendingGather:
    """Encode the local experts and gather them over the domain, level by level.

    Level ``l``'s group gathers the bundles its members hold after the outer levels, so the
    slowest (outermost) links carry the smallest bundles (the cost model's rule). Every weight
    matrix's payload travels in one message per level (:func:`pack_rows`: one all-gather per
    level, not one per matrix, as the cost model prices it). The first level's gather is
    issued here; :meth:`PendingGather.result` waits for it, runs the inner levels (each needs
    the previous one's result) and decodes.

    Args:
        weights: the local expert weights ``[e, *X]`` (w1, w3, w2; None where absent).
        groups: one group per level with a domain size above 1, outermost first.
        compression_ratio: SR compression ratio (1: exact).
        name: names the collectives in errors.
        shared: the shared experts to encode against (every member must pass the same); None
            computes them (an all-reduce per level). Unused when not compressed.
        dtype: gather (and decode to) this dtype, the one the experts compute in (every member
            must pass the same); None: the weights' own.
        shared_groups: the groups whose members' experts the computed shared experts average
            (all-reduced over each in turn; together they must cover the ranks averaged over
            once each); None: ``groups``, the domain.
    """
    with torch.no_grad():
        if dtype is not None:
            weights = tuple(None if w is None else w.detach().to(dtype) for w in weights)
        numel = next(w for w in weights if w is not None)[0].numel()
        sparse = kept_entries(numel, compression_ratio) < numel
        shared_bytes = 0
        if not sparse:
            shared = [None] * len(weights)
        elif shared is None:
            shared_groups = groups if shared_groups is None else shared_groups
            shared, shared_bytes = _shared_experts(weights, shared_groups)
        payloads = [
            None if w is None else encode_experts(w, sh, compression_ratio)
            for w, sh in zip(weights, shared)
        ]
        bundle = sum(p.numel() * p.element_size() for p in payloads if p is not None)
        level_bytes, factor = [], 1
        for g in groups:
            level_bytes.append(bundle * factor + shared_bytes)
            factor *= g.size
        present = [p for p in payloads if p is not None]
        first = groups[0].start_all_gather_dim0(pack_rows(present), f"hybrid gather of {name}")

    def finish() -> Weights:
        with torch.no_grad():
            buffer, wait = first
            wait()
            for g in groups[1:]:
                buffer = g.all_gather_dim0(buffer, f"hybrid gather of {name}")
            received = iter(unpack_rows(buffer, present))
            out: list[torch.Tensor | None] = []
            for w, sh, p in zip(weights, shared, payloads):
                if w is None or p is None:
                    out.append(None)
                    continue
                rows = next(received)
                out.append(decode_experts(rows, sh, tuple(w.shape[1:]), w.dtype, compression_ratio))
        return tuple(out)

    all_reduces = len(shared_groups) if shared_bytes and shared_groups is not None else 0
    return PendingGather(finish, level_bytes, len(groups) + all_reduces, shared, shared_bytes)


def pack_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors with the same first dimension ``r`` (any dtypes and trailing shapes) -> one
    ``[r, total bytes]`` uint8 tensor, row ``i`` holding every tensor's row ``i`` in turn: one
    message where the rows are what a collective splits (gathered or sent per member)."""
    rows = tensors[0].shape[0]
    return torch.cat([t.contiguous().view(torch.uint8).reshape(rows, -1) for t in tensors], dim=1)


def unpack_rows(packed: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`pack_rows`' inverse for any number of rows: ``packed[R, total bytes]`` -> one
    tensor per ``like`` entry, ``[R, *like[i].shape[1:]]`` of its dtype (bit-exact)."""
    widths = [t[0].numel() * t.element_size() for t in like]
    return [
        cols.contiguous().view(t.dtype).reshape(packed.shape[0], *t.shape[1:])
        for t, cols in zip(like, packed.split(widths, dim=1))
    ]
