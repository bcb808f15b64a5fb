"""Ranks agree on a configuration before they run collectives built from it.

A rank built with another ``num_experts`` or dtype than its peers would issue all-to-alls of
other sizes: gloo then aborts the process ("terminate called", sizes of 8.9e18). Another
``ffn_hidden_size`` or learning rate would even run, silently wrong. ``check_ranks_agree``
exchanges one 63-bit digest per field (two small all-gathers under the group's deadline) and
raises ``RankMismatchError`` naming the first field that differs and which ranks hold which
value digest, before any collective depends on the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

from moesaic.comm.collectives import EPGroup


class RankMismatchError(ValueError):
    """Ranks of one group were given different values of a field that must be the same."""


def digest(value: object) -> int:
    """A stable 63-bit digest of ``repr(value)`` (the same in every process, unlike ``hash``)."""
    raw = hashlib.sha256(repr(value).encode()).digest()
    return int.from_bytes(raw[:8], "little") >> 1


def check_ranks_agree(
    fields: Mapping[str, object],
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = 300.0,
    what: str = "configuration",
) -> None:
    """Raise unless every rank of ``group`` passed equal ``fields`` (compared by ``repr``).

    A collective: every rank of the group must call it with the same field names. Nothing is
    exchanged outside torch.distributed; a single process (or no initialised group) returns at
    once.

    Args:
        fields: name -> value; values are compared through ``repr`` (dataclasses, numbers,
            strings, dtypes and tuples of them have stable reprs).
        group: the process group (None: the default world).
        timeout_s: deadline of each of the two all-gathers.
        what: what is being compared, for the message ("MoE layer 3", "training config").

    Raises:
        RankMismatchError: names the first differing field and the ranks on each side.
        moesaic.CollectiveError: a peer died or did not call this within ``timeout_s``.
    """
    ep = EPGroup(group, timeout_s)
    if ep.size == 1:
        return
    names = list(fields)
    # First the set of names (so the per-field tensors have one length everywhere), then values.
    head = ep.control_tensor([digest(names), len(names)])
    heads = ep.all_gather_dim0(head.view(1, 2), f"{what}: rank agreement (field names)")
    differ = [r for r in range(ep.size) if not torch.equal(heads[r], heads[ep.rank])]
    if differ:
        raise RankMismatchError(
            f"{what}: rank {ep.rank} and rank(s) {differ} were given different sets of "
            f"fields (rank {ep.rank} has {names}); every rank must build the same thing"
        )
    mine = ep.control_tensor([digest(fields[n]) for n in names])
    all_PF = ep.all_gather_dim0(mine.view(1, -1), f"{what}: rank agreement (values)")
    for i, name in enumerate(names):
        column = all_PF[:, i]
        if bool((column != column[0]).any()):
            groups: dict[int, list[int]] = {}
            for r, d in enumerate(column.tolist()):
                groups.setdefault(d, []).append(r)
            sides = " vs ".join(f"ranks {ranks}" for ranks in groups.values())
            raise RankMismatchError(
                f"{what}: field {name!r} differs between ranks ({sides}); this rank "
                f"({ep.rank}) has {fields[name]!r}. Every rank must be given the same value"
            )
