"""The gradient layout of the communication pool (``schedule/pool.py``): where each gradient is
staged for its all-reduce, in which chunk, and when that chunk is complete.

Shape legend: N parameters, P ranks, X = 2N + 1 (a rank's hook counts, the sequence numbers of
its last hook calls, the sequence number at which its tail opened).

* **Buckets.** Parameters are grouped by (reduction rank set, dtype) and laid out, in the ready
  order, in one flat staging buffer per group. A rank set of one rank (expert shards without
  replicas) gets no buffer: its gradients are not reduced, only divided (unless
  ``reduce_singletons``: the single-rank shortcuts are off).
* **Chunks.** Each buffer is cut into chunks of ``chunk_bytes`` (Sp); the chunks of all buckets
  form one sequence, sorted by the place of their last parameter in the ready order, which every
  rank issues in the same order. A chunk is complete when every parameter it covers is.
  **The tail** is the exception: the parameters whose gradients completed, in rank 0's first
  step, after the step's last all-to-all had been waited (``open_tail``: nothing is left for
  the chunks to hide behind; the pool issues them at once) form one chunk per bucket, not one
  per Sp: each call costs a collective's latency and its ranks' handshake, and cut into Sp
  chunks they went as that many calls (``seeds_flowmoe_chunkcost.json``: 12 of 16 chunks at
  1 Gbit/s, +11% on the step). Decided here, when the chunks are cut, from the agreement's
  row, so that every rank issues the same calls whatever its own threads' timing.
* **The ready order**, learned in the first step (which reduces everything at ``finish``): every
  rank gathers every rank's hook counts and the sequence number of each parameter's last hook
  call, and the sequence number at which its tail opened (:meth:`GradLayout.hook_row`), and
  :meth:`GradLayout.learn` keeps rank 0's order and tail and, for
  each parameter whose count is the same on every rank, that count: from the next step on such a
  gradient is complete, and its chunks can go, once its hook count reaches it.
* **Per step**, :meth:`GradLayout.record` counts a parameter's hook calls and
  :meth:`GradLayout.complete` counts its chunks down; :meth:`GradLayout.stage` copies a chunk's
  gradients (zeros where none arrived, so every rank reduces the same chunks) into its buffer
  slice, and :meth:`GradLayout.write_back` writes ``sum / divisor`` back to ``p.grad``.

The layout issues nothing and takes no lock: the pool calls it with its own lock held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Bucket", "Chunk", "GradLayout"]


@dataclass(kw_only=True, slots=True)
class Bucket:
    """Parameters of one reduction rank set and dtype, laid out in one flat buffer."""

    ranks: tuple[int, ...]
    dtype: torch.dtype
    params: list[int]  # indices into GradLayout.params, in layout order
    offsets: list[int]  # element offset of each param in the buffer
    numel: int
    staging: torch.Tensor | None = None


@dataclass(kw_only=True, slots=True)
class Chunk:
    """Elements [lo, hi) of one bucket; ready when every covered parameter is complete."""

    index: int
    bucket: int
    lo: int
    hi: int
    segments: list[tuple[int, int, int, int]]  # (param index, param lo, param hi, buffer lo)
    nbytes: int
    missing: int = 0  # covered params not yet complete this step
    issued: bool = False


class GradLayout:
    """Buckets, chunks and the ready order of the pool's parameters (see the module docstring).

    Args:
        params: the parameters the pool reduces (same structure and order on every rank).
        ranks_N: each parameter's reduction rank set (global ranks; ``(0,)`` without a world).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        ranks_N: Sequence[tuple[int, ...]],
        *,
        reduce_singletons: bool = False,
    ) -> None:
        self.params = list(params)
        self.ranks_N = list(ranks_N)
        # a rank set of one still staged and all-reduced (MOESAIC_NO_SHORTCUTS: the pool's
        # one-rank groups are process groups then, see comm.collectives.shortcuts_allowed)
        self.reduce_singletons = reduce_singletons
        N = len(self.params)
        self.order: list[int] = list(reversed(range(N)))  # until learned: reverse registration
        self.expected_N: list[int] = [0] * N  # 0: reduce at finish only
        self.buckets: list[Bucket] = []
        self.chunks: list[Chunk] = []
        self.chunks_of_N: list[list[int]] = [[] for _ in range(N)]
        self.chunk_bytes = -1  # the Sp the chunks were cut for (-1: not built yet)
        self.counts_N = [0] * N
        self.last_N = [-1] * N  # hook sequence number of the latest call
        self.seq = 0
        self.tail_seq = -1  # this step's seq when its tail opened (-1: not yet)
        self.tail_from = N  # the ready order's first tail parameter (learned; N: no tail)
        self.late: list[int] = []

    # -- layout -----------------------------------------------------------------------------
    def build(self, chunk_bytes: int) -> None:
        """Buckets in the ready order, cut into ``chunk_bytes`` chunks, one global sequence;
        a bucket's staging buffer is kept while its size does not change."""
        keyed: dict[tuple[tuple[int, ...], torch.dtype], list[int]] = {}
        for i in self.order:
            keyed.setdefault((self.ranks_N[i], self.params[i].dtype), []).append(i)
        position = {i: k for k, i in enumerate(self.order)}
        old = {(b.ranks, b.dtype): b.staging for b in self.buckets}
        self.buckets, chunks = [], []
        self.chunks_of_N = [[] for _ in self.params]
        for (ranks, dtype), members in keyed.items():
            tail = next(
                (k for k, i in enumerate(members) if position[i] >= self.tail_from), len(members)
            )
            offsets = [0]
            for i in members:
                offsets.append(offsets[-1] + self.params[i].numel())
            b = Bucket(
                ranks=ranks, dtype=dtype, params=members, offsets=offsets[:-1], numel=offsets[-1]
            )
            self.buckets.append(b)
            if len(ranks) == 1 and not self.reduce_singletons:
                continue  # no replicas: divided at finish, never reduced
            staging = old.get((ranks, dtype))
            if staging is None or staging.numel() != b.numel:
                staging = torch.empty(b.numel, dtype=dtype, device=self.params[members[0]].device)
            b.staging = staging
            esize = staging.element_size()
            step = max(1, chunk_bytes // esize)
            tail_lo = offsets[tail]  # the bucket's tail: one chunk
            cuts = [(lo, min(lo + step, tail_lo)) for lo in range(0, tail_lo, step)]
            cuts += [(tail_lo, b.numel)] if tail_lo < b.numel else []
            for lo, hi in cuts:
                segs = []
                for i, off in zip(members, b.offsets):
                    n = self.params[i].numel()
                    a, z = max(lo, off), min(hi, off + n)
                    if a < z:
                        segs.append((i, a - off, z - off, a))
                last = max(position[s[0]] for s in segs)
                chunks.append((last, len(self.buckets) - 1, lo, hi, segs, esize))
        chunks.sort(key=lambda c: (c[0], c[1], c[2]))
        self.chunks = []
        for k, (_, bi, lo, hi, segs, esize) in enumerate(chunks):
            self.chunks.append(
                Chunk(index=k, bucket=bi, lo=lo, hi=hi, segments=segs, nbytes=(hi - lo) * esize)
            )
            for i in {s[0] for s in segs}:
                self.chunks_of_N[i].append(k)
        self.chunk_bytes = chunk_bytes

    def hook_row(self) -> list[int]:
        """This rank's row of the first step's agreement (X = 2N + 1 values): the hook counts,
        the sequence number of each parameter's last hook call (-1: none), and the sequence
        number at which the step's tail opened (-1: it did not)."""
        return self.counts_N + self.last_N + [self.tail_seq]

    def open_tail(self) -> None:
        """The step's last all-to-all has been waited: hook calls from here on are its tail
        (the first call this step counts)."""
        if self.tail_seq < 0:
            self.tail_seq = self.seq

    def learn(self, all_PX: torch.Tensor) -> None:
        """Keep rank 0's ready order and the hook counts every rank agrees on, from every
        rank's :meth:`hook_row` (rows in rank order); :meth:`build` applies them."""
        N = len(self.params)
        counts_PN, last_N = all_PX[:, :N].cpu(), all_PX[0, N : 2 * N].tolist()
        tail_seq = int(all_PX[0, 2 * N])
        same_N = (counts_PN == counts_PN[:1]).all(dim=0).tolist()
        self.expected_N = [int(counts_PN[0, i]) if same_N[i] else 0 for i in range(N)]
        seen = sorted((last, i) for i, last in enumerate(last_N) if last >= 0)
        rest = [i for i in reversed(range(N)) if last_N[i] < 0]
        self.order = [i for _, i in seen] + rest
        # (parameters no hook reached go last, with the tail when there is one)
        self.tail_from = N if tail_seq < 0 else sum(last < tail_seq for last, _ in seen)

    # -- one step ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Forget the last step's hook calls; every chunk misses all its parameters again."""
        self.counts_N = [0] * len(self.params)
        self.last_N = [-1] * len(self.params)
        self.seq, self.tail_seq, self.late = 0, -1, []
        for c in self.chunks:
            c.missing = len({s[0] for s in c.segments})
            c.issued = False

    def record(self, i: int) -> None:
        """One hook call of parameter ``i``: its count and its place in this step's order."""
        self.counts_N[i] += 1
        self.last_N[i] = self.seq
        self.seq += 1

    def complete(self, i: int) -> bool:
        """After :meth:`record`: whether that call completed ``i``'s gradient (each of its
        chunks then misses one parameter less). A call past the learned count once one of
        ``i``'s chunks was issued is remembered in ``late`` (its sum missed that part)."""
        expected = self.expected_N[i]
        if expected == 0:
            return False
        if self.counts_N[i] > expected:
            if any(self.chunks[c].issued for c in self.chunks_of_N[i]):
                self.late.append(i)
        elif self.counts_N[i] == expected:
            for c in self.chunks_of_N[i]:
                self.chunks[c].missing -= 1
            return True
        return False

    def stage(self, chunk: Chunk) -> torch.Tensor:
        """Copy the chunk's gradients (zeros where none) into its buffer slice; returns it."""
        bucket = self.buckets[chunk.bucket]
        assert bucket.staging is not None  # internal: size-1 buckets have no chunks
        for i, plo, phi, blo in chunk.segments:
            dst = bucket.staging[blo : blo + phi - plo]
            grad = self.params[i].grad
            if grad is None:
                dst.zero_()
            else:
                dst.copy_(grad.reshape(-1)[plo:phi])
        return bucket.staging[chunk.lo : chunk.hi]

    def write_back(self, divisor: int) -> None:
        """``p.grad = staged sum / divisor`` (a rank set of one: ``p.grad / divisor``, zeros
        where no gradient arrived)."""
        for b in self.buckets:
            for i, off in zip(b.params, b.offsets):
                p = self.params[i]
                if b.staging is None:  # no replicas: divide only
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.div_(divisor)
                    continue
                avg = b.staging[off : off + p.numel()].view_as(p).div_(divisor)
                if p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)

    def reduction_sets(self) -> list[tuple[tuple[int, ...], list[nn.Parameter]]]:
        """The parameters by reduction rank set (a set of one rank: not reduced, only divided
        by the divisor at ``finish``)."""
        by_ranks: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for i, p in enumerate(self.params):
            by_ranks.setdefault(self.ranks_N[i], []).append(p)
        return list(by_ranks.items())
