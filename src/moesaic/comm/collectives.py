"""Collectives with a deadline, and the autograd all-to-all(v) the dispatchers are built from.

Every call is issued asynchronously and waited on with ``collective_timeout_s``: a peer that died
(gloo: connection reset, seen immediately) or never arrives (timeout) becomes a
``CollectiveError`` naming the operation, the rank and the deadline, instead of a hang.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer died, hung, or took another code path."""


@dataclass(slots=True)
class Traffic:
    """Bytes this process handed to collectives per destination rank, and how many it issued.

    Counted where the collectives are issued (from the tensors and splits actually passed), so it
    is an independent check of every strategy's own ``CommStats`` accounting. An all-reduce or
    all-gather counts its whole input once per peer (the size of the message, not of a
    particular algorithm's traffic).
    """

    peer_bytes_P: list[int] = field(default_factory=list)
    collectives: int = 0

    def snapshot(self) -> tuple[tuple[int, ...], int]:
        return tuple(self.peer_bytes_P), self.collectives


def wait_work(work: Any, failed: str, timeout_s: float) -> None:
    """``work.wait`` under the deadline; a failure or timeout is a ``CollectiveError``.

    Args:
        work: an async collective's handle (None: nothing to wait for).
        failed: the start of the error message, naming the operation and the rank
            ("dispatch counts failed on rank 0/2 of the expert-parallel group").
        timeout_s: the deadline in force, named in the message.
    """
    if work is None:
        return
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # gloo/NCCL report both timeouts and dead peers as this
        raise CollectiveError(
            f"{failed} (collective_timeout_s={timeout_s:g}): a peer died, hung, or skipped "
            f"this collective. Cause: {str(exc).splitlines()[0][:300]}"
        ) from exc


class EPGroup:
    """An expert-parallel process group (or the trivial group of one process) with a deadline.

    Args:
        group: a torch.distributed group; None means the default world when torch.distributed
            is initialised, else a single process.
        timeout_s: deadline of every collective issued through this object.
    """

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.active = dist.is_available() and dist.is_initialized()
        if not self.active and group is not None:
            raise ValueError("group was given, but torch.distributed is not initialised")
        self.group = group if self.active else None
        self.size = dist.get_world_size(self.group) if self.active else 1
        self.rank = dist.get_rank(self.group) if self.active else 0
        self.traffic = Traffic([0] * self.size)
        self._parent: tuple[EPGroup, list[int]] | None = None

    @classmethod
    def solo(cls, timeout_s: float) -> EPGroup:
        """The trivial group of this process alone (even when torch.distributed is running)."""
        out = cls.__new__(cls)
        out.timeout_s, out.active, out.group, out.size, out.rank = timeout_s, False, None, 1, 0
        out.traffic = Traffic([0])
        out._parent = None
        return out

    def subgroup(self, ranks: list[int]) -> EPGroup:
        """A new group of ``ranks`` (ranks of this group, ascending, this rank among them).

        Only the members call it (``use_local_synchronization``), in the same order; one
        member alone gives :meth:`solo`. Every call makes a new group (a clone when the ranks
        repeat), so collectives issued from two threads can each have their own.
        """
        if self.rank not in ranks or sorted(set(ranks)) != list(ranks):
            raise ValueError(f"ranks ({ranks}) must be ascending, unique and include {self.rank}")
        if len(ranks) == 1:
            return EPGroup.solo(self.timeout_s)
        members = dist.get_process_group_ranks(self.group) if self.group is not None else None
        global_ranks = [members[r] for r in ranks] if members is not None else list(ranks)
        group = dist.new_group(
            global_ranks,
            timeout=datetime.timedelta(seconds=self.timeout_s),
            use_local_synchronization=True,
        )
        child = EPGroup(group, self.timeout_s)
        child._parent = (self, list(ranks))
        return child

    def _count(self, bytes_P: list[int]) -> None:
        self.traffic.collectives += 1
        for p, b in enumerate(bytes_P):
            if p != self.rank:
                self.traffic.peer_bytes_P[p] += b
        if self._parent is not None:  # a subgroup's traffic also counts in its parent's ranks
            parent, ranks = self._parent
            parent._count(
                [0 if r not in ranks else bytes_P[ranks.index(r)] for r in range(parent.size)]
            )

    def count_sent(self, peer: int, nbytes: int) -> None:
        """Count one point-to-point message of ``nbytes`` to ``peer``, sent outside this
        class's collectives (the taskflow runtime's one-sided puts), as one collective."""
        bytes_P = [0] * self.size
        bytes_P[peer] = nbytes
        self._count(bytes_P)

    def _wait(self, work: dist.Work | None, what: str) -> None:
        wait_work(
            work,
            f"{what} failed on rank {self.rank}/{self.size} of the expert-parallel group",
            self.timeout_s,
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
        what: str = "all_to_all",
    ) -> torch.Tensor:
        """``dist.all_to_all_single`` under the deadline; rows split per rank along dim 0."""
        if self.size == 1:
            output.copy_(input)
            return output
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        rows_P = input_splits or [input.shape[0] // self.size] * self.size
        self._count([rows * row_bytes for rows in rows_P])
        work = dist.all_to_all_single(
            output, input, output_splits, input_splits, group=self.group, async_op=True
        )
        self._wait(work, what)
        return output

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, what: str = ""
    ) -> torch.Tensor:
        if self.size > 1:
            self._count([tensor.numel() * tensor.element_size()] * self.size)
            work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
            self._wait(work, what or "all_reduce")
        return tensor

    def all_gather_dim0(self, tensor: torch.Tensor, what: str = "all_gather") -> torch.Tensor:
        """Concatenate equal-shaped tensors of all ranks along dim 0, in rank order."""
        out, finish = self.start_all_gather_dim0(tensor, what)
        finish()
        return out

    def start_all_gather_dim0(
        self, tensor: torch.Tensor, what: str = "all_gather"
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """Issue :meth:`all_gather_dim0` without waiting: ``(out, finish)``; ``out`` is valid
        once ``finish()`` (the wait under the deadline) has returned."""
        if self.size == 1:
            return tensor.clone(), lambda: None
        self._count([tensor.numel() * tensor.element_size()] * self.size)
        out = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]))
        # all_gather_single replaces all_gather_into_tensor in newer torch; both exist in 2.4+.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(out, tensor.contiguous(), group=self.group, async_op=True)
        return out, lambda: self._wait(work, what)


class _AllToAllV(torch.autograd.Function):
    """Rows to ranks with the given splits; the backward sends gradients the reverse way."""

    @staticmethod
    def forward(ctx, x_MH, group: EPGroup, in_splits, out_splits, what):
        ctx.group, ctx.in_splits, ctx.out_splits, ctx.what = group, in_splits, out_splits, what
        out = x_MH.new_empty((sum(out_splits), *x_MH.shape[1:]))
        return group.all_to_all_single(out, x_MH.contiguous(), out_splits, in_splits, what)

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()
        grad_in = grad_out.new_empty((sum(ctx.in_splits), *grad_out.shape[1:]))
        ctx.group.all_to_all_single(
            grad_in, grad_out, ctx.in_splits, ctx.out_splits, f"{ctx.what} (backward)"
        )
        return grad_in, None, None, None, None


def all_to_all_v(
    x_MH: torch.Tensor,
    group: EPGroup,
    in_splits: list[int],
    out_splits: list[int],
    what: str = "all_to_all_v",
) -> torch.Tensor:
    """Autograd all-to-all-v: ``in_splits[p]`` rows go to rank p, ``out_splits[p]`` come back."""
    if group.size == 1:
        return x_MH
    return _AllToAllV.apply(x_MH, group, list(in_splits), list(out_splits), what)
