"""Every rank's trace spans on every rank: the one collective a timeline needs.

Kept out of :mod:`moesaic.trace`, which stays torch- and communication-free (the simulator and the
taskflow drawing use its timelines without a process group).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from moesaic.comm.collectives import EPGroup
from moesaic.trace import Span

__all__ = ["gather_spans"]


def gather_spans(group: EPGroup, spans: Sequence[Span]) -> list[list[Span]]:
    """Every rank's spans, in rank order, on every rank of ``group`` (a collective: every rank
    calls it). The spans travel as JSON bytes in two all-gathers (lengths, then padded bytes)
    under ``group``'s deadline."""
    payload = json.dumps([s.to_dict() for s in spans]).encode()
    if group.size == 1:
        return [list(spans)]
    n = group.control_tensor([len(payload)])
    lengths = group.all_gather_dim0(n, what="all_gather of trace sizes").tolist()
    buf_U = torch.zeros(max(lengths), dtype=torch.uint8)
    buf_U[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    all_PU = group.all_gather_dim0(buf_U.to(group.control_device), "all_gather of trace spans")
    all_PU = all_PU.view(group.size, -1).cpu()
    out = []
    for p, length in enumerate(lengths):
        rows = json.loads(all_PU[p, :length].numpy().tobytes())
        out.append([Span.from_dict(d) for d in rows])
    return out
