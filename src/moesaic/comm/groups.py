"""One process group per distinct (rank set, lane) of a world, created once and shared.

NCCL spends hundreds of MB of device memory per communicator, so a group per layer (32 layers x
the groups of one layer) would not fit. Every group moesaic uses comes from here instead:
keyed by its global ranks and a *lane*, created the first time any layer asks for it and
shared by every later layer and thread. The lanes are a fixed, small set:

* ``main``: collectives the schedule's thread issues in program order (dispatch and combine,
  control-plane agreements, hybrid's gathers). An EP group of the whole world is a group of
  its own here, not the default group, which keeps the world's own collectives (health flags,
  checkpoints) apart from the rows: with the rows on the default group, a rank that failed took
  long enough to exit (its teardown of the default group with a peer's all-to-all pending)
  that the elastic agent stopped it before it reported its cause (measured: the root-cause
  line named the peer in about half of the runs of the full-disk test, never with a group of
  its own);
* ``rows``: the pipelined schedules' row all-to-alls, so that a strategy's small synchronous
  exchanges on ``main`` (the dispatch counts) never queue behind rows in flight;
* ``grad``: the gradient all-reduce chunks of the communication pool;
* ``prefetch``: HybridEP's expert gathers issued ahead of the forward;
* ``puts``: the taskflow runtime's one-sided puts;
* ``ckpt``: asynchronous checkpoint saves (``train.checkpoint.Checkpointer``), whose writer
  thread runs DCP's collectives while the training thread runs its own; created only by a run
  that asks for them.

So a world holds at most ``len(LANES)`` groups per distinct rank set, whatever the number of
layers. Creating a group is a collective of the *whole world* (``dist.new_group`` without
local synchronisation): torch names a locally synchronised group by a hash of its ranks and the
number of groups the creating process already holds, which differs between ranks that belong
to different numbers of groups, and a mismatched name hangs the store rendezvous. So every rank
creates every missing group, in one sorted order (``GroupRegistry.create``); callers that only
know their own rank sets gather everyone's first (``EPGroup.subgroups``).

The registry lives as long as its world: it is keyed by the default process group, like
torch's own group table, so a destroyed and re-initialised world starts empty.
"""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

__all__ = ["LANES", "GroupRegistry", "registry"]

LANES = ("main", "rows", "grad", "prefetch", "puts", "ckpt")


class GroupRegistry:
    """The process groups of one world by (global ranks, lane); see the module docstring."""

    def __init__(self) -> None:
        self._groups: dict[tuple[tuple[int, ...], str], Any] = {}
        self.created = 0  # process groups created through this registry (new communicators)
        self.log: list[tuple[Any, ...]] | None = None  # see collectives.record_collectives

    def lookup(self, ranks: Iterable[int], lane: str = "main") -> Any:
        """The group of ``ranks`` in ``lane``; KeyError if absent."""
        return self._groups[self._key(ranks, lane)]

    def has(self, ranks: Iterable[int], lane: str = "main") -> bool:
        return self._key(ranks, lane) in self._groups

    def create(
        self,
        rank_sets: Iterable[Iterable[int]],
        lane: str,
        timeout_s: float,
        *,
        singletons: bool = False,
    ) -> int:
        """Create the missing groups of ``rank_sets`` in ``lane``; returns how many were new.

        A collective of the whole world: every rank must pass the same sets (in any order, with
        repeats), including sets it is not a member of. Sets of one rank are skipped (nothing
        to communicate: ``EPGroup.solo``) unless ``singletons`` (a model that insists on a
        process group of its own rank, e.g. an EP size of 1 beside data parallelism).
        """
        least = 1 if singletons else 2
        missing = sorted(
            {k[0] for k in (self._key(r, lane) for r in rank_sets) if len(k[0]) >= least}
            - {ranks for ranks, ln in self._groups if ln == lane}
        )
        timeout = datetime.timedelta(seconds=timeout_s)
        me = dist.get_rank()
        for ranks in missing:
            pg = dist.new_group(list(ranks), timeout=timeout)
            self.created += 1
            self._groups[(ranks, lane)] = pg if me in ranks else dist.GroupMember.NON_GROUP_MEMBER
        return len(missing)

    @staticmethod
    def _key(ranks: Iterable[int], lane: str) -> tuple[tuple[int, ...], str]:
        if lane not in LANES:
            raise ValueError(f"lane ({lane!r}) must be one of {LANES}")
        out = tuple(sorted(set(int(r) for r in ranks)))
        if not out or out[0] < 0 or out[-1] >= dist.get_world_size():
            raise ValueError(f"ranks ({list(out)}) must be global ranks of this world")
        return out, lane


_REGISTRIES: weakref.WeakKeyDictionary[Any, GroupRegistry] = weakref.WeakKeyDictionary()


def registry() -> GroupRegistry:
    """This world's registry (torch.distributed must be initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("moesaic process groups need an initialised torch.distributed world")
    world = dist.group.WORLD
    found = _REGISTRIES.get(world)
    if found is None:
        found = _REGISTRIES[world] = GroupRegistry()
    return found
