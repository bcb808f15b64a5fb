"""The price of one MoE layer's direction in taskflow's persistent kernel (``kernels.persistent``:
what the ``taskflow`` strategy runs on CUDA for a SwiGLU layer), on a GPU profile.

The kernel runs the lowered plan (``taskflow.lower_rows.device_rows``: one row per tile task, in
the world's topological order) in **one launch**, its programs pulling rows by ticket; so:

* **launch**: the profile's ``launch_s`` once (no host time per tile: the host queues one
  kernel; ``KernelPrice.cpu_s`` is that launch);
* **tiles** (per rank, every rank its own GPU): each GEMM row's rows padded to the kernel's
  GEMM tile (``KERNEL_BM`` rows: a tile with 1 valid row costs a 64-row ``tl.dot``), weight
  gradients slot by slot, at the profile's matmul rate for the model's dtype times its grouped-
  GEMM efficiency at the layer's rows per expert; the memory-bound rows (dispatch gather, SwiGLU
  and its gradient, combine copies, top-k sums) at their valid rows' bytes read and written over
  ``mem_bytes_per_s``;
* **puts** to another rank: the rows' bytes on the pair's link (``collectives.p2p_s``; a
  rank's puts share its link: their bytes in one message), overlapped with the tiles;
* **the chain**: the longest path through the world's events (a task starts when the event it
  waits on is complete, every tile at the whole device's rate, a put at its link time): the
  dependency floor, a lower bound since the profile has no SM count to price one tile on one SM;
* the step is the busiest rank's ``launch + max(tiles, puts, chain)``, plus (forward) the copies
  of its receive windows the backward reads, bytes over ``mem_bytes_per_s``.

Valid rows come from the simulator's routing (``sim.taskflow.SlotLoads``: ``rows_E[x]`` rows
from every rank to expert ``x``), the count rule of the kernel (``valid = clamp(count[SLOT] -
VOFF, 0, ROWS)``). Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from moesaic.kernels import task_ops as ops
from moesaic.sim.collectives import LinkModel, p2p_s
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import Profile
from moesaic.trace import Span

if TYPE_CHECKING:
    from moesaic.taskflow.plan import Plan

__all__ = ["KERNEL_BM", "KernelPrice", "kernel_price", "kernel_priced"]

# Rows of the kernel's GEMM tile on CUDA (``kernels.persistent.device_tiles``' BM, named here
# without importing Triton; tested equal).
KERNEL_BM = 64

_OP = {code: name for name, code in ops.OPCODES.items()}
_PUTS = frozenset(("put_dispatch", "put_dispatch_grad", "put_combine"))


def kernel_priced(model: ModelSpec, profile: Profile) -> bool:
    """Whether taskflow's layer is priced as the persistent kernel: a GPU profile and SwiGLU
    experts (``kernels.persistent_steps``' default on CUDA); else the host runtime's pricing
    (``sim.taskflow``)."""
    return profile.device == "cuda" and model.activation == "swiglu"


class KernelPrice(NamedTuple):
    """One direction's price (seconds) and what it is made of: the busiest rank's tiles
    (``compute_s``), puts (``wire_s``), the dependency chain (``chain_s``), the launch and the
    forward's window copies; ``flops``/``nbytes`` of the busiest rank's tiles (padded GEMM
    FLOPs, memory-bound bytes), its ``tiles`` (device rows) and rank 0's spans."""

    makespan: float
    compute_s: float
    wire_s: float
    chain_s: float
    launch_s: float
    copy_s: float
    flops: float
    nbytes: float
    tiles: int
    spans: list[Span]

    @property
    def cpu_s(self) -> float:
        """The host's seconds: the launch (no host step per tile)."""
        return self.launch_s


def _pad(n: float) -> float:
    return math.ceil(n / KERNEL_BM - 1e-9) * KERNEL_BM if n > 0 else 0.0


def kernel_price(
    plans: Sequence[Plan],
    model: ModelSpec,
    link: LinkModel,
    profile: Profile,
    rows_E: Sequence[float],
    copy_elements: int = 0,
) -> KernelPrice:
    """The price of ``plans`` (one direction, every rank's, rank r at index r) in one launch of
    the persistent kernel, each rank sending ``rows_E[x]`` rows to expert ``x``;
    ``copy_elements``: the forward's window copies per rank (``sim.taskflow.
    saved_window_elements``)."""
    from moesaic.taskflow.lower_rows import device_rows, world_order

    b = plans[0].bucket
    P, e = b.ep_size, b.local_experts
    H, F, K = b.hidden, b.ffn, b.top_k
    prof = profile.for_model(model.act_bytes)
    per_expert = P * math.fsum(rows_E) / max(1, len(rows_E))
    rate = prof.flops_per_s * prof.gemm_efficiency_at(per_expert)
    mem = prof.mem_bytes_per_s
    act = model.act_bytes

    def have(rank: int, slot: int) -> float:
        """Rows of count entry ``slot`` on ``rank`` (receive slot j * P + s, or sent to g)."""
        if slot >= e * P:
            return rows_E[slot - e * P]
        return rows_E[rank * e + slot // P]

    def valid(rank: int, row: list[int]) -> float:
        n = row[ops.ROWS]
        if row[ops.SLOT] < 0:
            return float(n)
        return min(max(have(rank, row[ops.SLOT]) - row[ops.VOFF], 0.0), float(n))

    def row_work(rank: int, row: list[int]) -> tuple[float, float, float, int]:
        """(FLOPs, local bytes, remote bytes, peer) of one device row."""
        name, n = _OP[row[ops.OP]], valid(rank, row)
        if name in ("gmm_w2_grad", "gmm_w1_grad"):
            j = row[ops.EXPERT]
            rows = math.fsum(_pad(have(rank, j * P + s)) for s in range(P))
            return (2 if name == "gmm_w1_grad" else 1) * 2.0 * rows * H * F, 0.0, 0.0, rank
        if name.startswith("gmm_"):
            two = name in ("gmm_gate_up", "gmm_gate_grad")
            return (2 if two else 1) * 2.0 * _pad(n) * H * F, 0.0, 0.0, rank
        if name in _PUTS:
            peer = row[ops.PEER]
            nbytes = n * H * act
            if peer != rank:
                return 0.0, nbytes, nbytes, peer  # read here, stored into the peer
            return 0.0, 2 * nbytes, 0.0, rank
        width = {
            "swiglu": 3 * F,
            "swiglu_grad": 5 * F,
            "topk_combine": (K + 1) * H,
            "sum_combine": (K + 1) * H,
            "topk_weight_grad": (K + 1) * H,
        }[name]
        return 0.0, n * width * act, 0.0, rank

    def seconds(flops: float, nbytes: float) -> float:
        return flops / rate + (nbytes / mem if mem > 0 else 0.0)

    flops_r, bytes_r, wire_r, tiles_r = [0.0] * P, [0.0] * P, [0.0] * P, [0] * P
    cost: dict[tuple[int, int], float] = {}
    for r, plan in enumerate(plans):
        sent: dict[int, float] = {}
        for t in plan.tasks:
            c = 0.0
            for row in device_rows(plan, t):
                f, nb, remote, peer = row_work(r, row)
                flops_r[r] += f
                bytes_r[r] += nb
                tiles_r[r] += 1
                c += seconds(f, nb)
                if remote:
                    sent[peer] = sent.get(peer, 0.0) + remote
                    c += p2p_s(link, r, peer, remote)
            cost[(r, t.uid)] = c
        if sent:
            far = min(sent, key=lambda q: link.spec.path(r, q).bandwidth_gbps)
            wire_r[r] = p2p_s(link, r, far, math.fsum(sent.values()))

    # the chain: a task starts when its event is complete (every producer ended)
    ready: dict[tuple[int, int], float] = {}
    start: dict[tuple[int, int], float] = {}
    end: dict[tuple[int, int], float] = {}
    for r, uid in world_order(plans):
        t = plans[r].tasks[uid]
        s0 = ready.get((r, t.dependent_event), 0.0) if t.dependent_event >= 0 else 0.0
        start[(r, uid)], end[(r, uid)] = s0, s0 + cost[(r, uid)]
        for ref in t.trigger_events:
            k = (ref.rank, ref.event)
            ready[k] = max(ready.get(k, 0.0), end[(r, uid)])
    chain = max(end.values(), default=0.0)

    compute = [seconds(flops_r[r], bytes_r[r]) for r in range(P)]
    busiest = max(range(P), key=lambda r: max(compute[r], wire_r[r]))
    launch = prof.launch_s
    copy_s = 2.0 * copy_elements * act / mem if mem > 0 else 0.0
    body = max(compute[busiest], wire_r[busiest], chain)
    spans = [
        Span(
            rank=0,
            resource="a2a" if t.task_type in _PUTS else "compute",
            name=t.op,
            start=launch + start[(0, t.uid)],
            end=launch + end[(0, t.uid)],
            args={"tile": t.task_index},
        )
        for t in plans[0].tasks
    ]
    return KernelPrice(
        makespan=launch + body + copy_s,
        compute_s=compute[busiest],
        wire_s=wire_r[busiest],
        chain_s=chain,
        launch_s=launch,
        copy_s=copy_s,
        flops=flops_r[busiest],
        nbytes=bytes_r[busiest],
        tiles=tiles_r[busiest],
        spans=spans,
    )
