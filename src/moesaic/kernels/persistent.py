"""The persistent Triton kernel that runs lowered taskflow plans: one launch per direction,
one resident program per SM pulling tile tasks from a device queue (FlashDMoE's processors).

Shape legend: T tokens (per rank), K top-k, H hidden, F expert hidden, e local experts, P
ranks, E = e * P experts, S slot rows, n device tasks, V ranks in one launch.

**The queue.** The launch's task rows (``kernels.task_ops``, written by ``taskflow.lower``) are
in the world's topological order: a row's producers come before it. A program takes the next
row by an atomic ticket (``ticket[0]``, FlashDMoE's scheduler reduced to one counter) and:

1. **waits**: spins on an acquire read of the row's event counter until it reaches the
   launch's ``epoch`` times the row's threshold (at most ``spin`` re-reads; then the row and
   the count it saw go to ``err`` and every program stops taking rows: a wrong table or a
   stale count is an error naming the row, never a hang);
2. **runs the tile** by opcode (``kernels.persistent_tiles``): GEMM tiles with ``tl.dot``,
   the dispatch gather, SwiGLU and its gradient, the combine copy, the top-k reductions and the
   weight gradients, each on the slot's valid rows only (an empty tile skips its body);
3. **bumps** its triggers with release atomics, after a barrier so every thread's stores are
   done; a trigger on another rank is that rank's counter.

Since tickets are taken in topological order, a waiting row's producers hold earlier tickets,
taken by running programs: the queue cannot deadlock whatever the grid (one program, or one
per SM) and however programs interleave. Triton's interpreter runs a grid's programs one after
another: the first takes every row and never waits (the order is topological), the others
find the queue empty.

**Ranks and puts.** Each row names the launch slot of the rank that runs it (``HOME``) and, for
a put, the rank it writes to (``PEER``). Every buffer a row touches is the pointer argument
plus the HOME rank's offset (its share of a ``[V, ...]`` allocation; 0 when a launch holds one
rank); a put's destination (the peer's receive slot of the symmetric layout, or its return
rows) is the local pointer plus ``pdata[HOME * P + PEER]``, and a trigger of rank r bumps
``counters + psig[HOME * P + r] + event``. The two tables of element offsets are the only thing
that differs between **virtual ranks** (V ranks' buffers in one allocation, offsets
``(r - HOME) * stride``: one launch on one device, or the interpreter) and **real peers**
(``torch.distributed._symmetric_memory`` buffers, offsets ``(address(peer) - address(self)) /
itemsize``): the same kernel code stores the tile into the peer, then (barrier, release atomic
at ``SCOPE``: "gpu" for one device, "sys" across devices) signals it; the peer's expert tile
starts after its acquire read saw the threshold. No host step per tile.

**Epochs.** Counters are never zeroed between launches. Every event is bumped exactly its
threshold times per launch and waited on (``taskflow.lower.check_world_tables``), so after a
launch that used a counter set for the e-th time each of its counters holds ``e * threshold``,
and the next launch on that set (``epoch = e + 1``) waits for ``(e + 1) * threshold``: no
zeroing, no host sync. The comparison is on the wrapping int32 difference, so a counter that
passes 2**31 keeps working. Which set a launch uses, and why two sets alternate between ranks
that may be one launch apart, is ``taskflow.runtime.epochs``.

Math as the sequential executor's handlers (``taskflow.runtime.handlers``), in fp32 with one
rounding to the buffers' dtype (fp32, bf16, fp16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moesaic.kernels import task_ops as ops
from moesaic.kernels._launch import check_device, check_float, interpreting, upcast_dot
from moesaic.kernels.persistent_tiles import (
    copy_rows,
    gather_rows,
    row_gemm,
    swiglu_grad_rows,
    swiglu_rows,
    topk_grad_rows,
    topk_rows,
    weight_grad,
)

__all__ = [
    "BUFFERS",
    "DIRECTION_BUFFERS",
    "GPU_SPIN",
    "INTERPRETER_SPIN",
    "Launch",
    "Started",
    "TaskError",
    "device_programs",
    "device_tiles",
    "run_tables",
    "start_tables",
]

# Re-reads of a wait before a program gives up. Under the interpreter a wait that is not met at
# once never will be (the order is topological and programs run in turn): a few re-reads. On a
# GPU a wait may outlast a peer's late launch (its first launch compiles the kernel: tens of
# seconds for this one); not measured: at an L2 atomic's ~0.1-1 us a re-read, 2**30 of them
# are minutes.
INTERPRETER_SPIN = 8
GPU_SPIN = 1 << 30

# The buffers of each direction, by the plan's names; the kernel takes all of them (a direction
# passes a placeholder for the other's).
DIRECTION_BUFFERS = {
    "forward": ("x_TH", "w1", "w3", "w2", "x_recv", "h", "a", "y_rows", "y_ret", "y_TH"),
    "backward": (
        *("dy_TH", "w1", "w3", "w2", "x_recv", "h", "a", "y_ret"),
        *("g_recv", "da", "dh", "dx_rows", "dx_ret", "dx_TH", "dtopk_TK", "dw1", "dw3", "dw2"),
    ),
}
BUFFERS = tuple(dict.fromkeys(DIRECTION_BUFFERS["forward"] + DIRECTION_BUFFERS["backward"]))
# Buffers other ranks write (a put's destination): their rank offsets come from ``pdata``.
PUT_TARGETS = ("x_recv", "y_ret", "g_recv", "dx_ret")

_C = {name: tl.constexpr(i) for i, name in enumerate(ops.COLUMNS)}
C_OP, C_UID, C_WAIT, C_THRESH = _C["OP"], _C["UID"], _C["WAIT"], _C["THRESH"]
C_TRIG0, C_NTRIG, C_EXPERT, C_SLOT = _C["TRIG0"], _C["NTRIG"], _C["EXPERT"], _C["SLOT"]
C_VOFF, C_ROW0, C_DST0, C_ROWS = _C["VOFF"], _C["ROW0"], _C["DST0"], _C["ROWS"]
C_PEER, C_HOME = _C["PEER"], _C["HOME"]
NCOL = tl.constexpr(ops.NCOL)
OP_DISPATCH = tl.constexpr(ops.OPCODES["put_dispatch"])
OP_GATE_UP = tl.constexpr(ops.OPCODES["gmm_gate_up"])
OP_SWIGLU = tl.constexpr(ops.OPCODES["swiglu"])
OP_DOWN = tl.constexpr(ops.OPCODES["gmm_down"])
OP_COMBINE = tl.constexpr(ops.OPCODES["put_combine"])
OP_TOPK = tl.constexpr(ops.OPCODES["topk_combine"])
OP_DISPATCH_GRAD = tl.constexpr(ops.OPCODES["put_dispatch_grad"])
OP_ACT_GRAD = tl.constexpr(ops.OPCODES["gmm_act_grad"])
OP_W2_GRAD = tl.constexpr(ops.OPCODES["gmm_w2_grad"])
OP_SWIGLU_GRAD = tl.constexpr(ops.OPCODES["swiglu_grad"])
OP_GATE_GRAD = tl.constexpr(ops.OPCODES["gmm_gate_grad"])
OP_W1_GRAD = tl.constexpr(ops.OPCODES["gmm_w1_grad"])
OP_SUM = tl.constexpr(ops.OPCODES["sum_combine"])
OP_TOPK_GRAD = tl.constexpr(ops.OPCODES["topk_weight_grad"])


class TaskError(RuntimeError):
    """A program gave up on a wait: ``row`` (of the launch's table) never reached its
    threshold."""

    def __init__(self, message: str, row: int) -> None:
        super().__init__(message)
        self.row = row


# -- the task loop's parts ----------------------------------------------------------------------
@triton.jit
def _wait(cnt_ptr, err_ptr, row_ptr, spin, epoch, SCOPE: tl.constexpr):
    """Spin until the row's event reaches ``epoch * THRESH``, or ``spin`` re-reads, or
    another program's error; returns (whether it did, the count last seen). The comparison
    is of the int32 difference (wrapping arithmetic), so counters that wrapped past 2**31
    compare right: a counter is never more than one epoch's threshold from its target."""
    ev = tl.load(row_ptr + C_WAIT)
    target = epoch * tl.load(row_ptr + C_THRESH)
    seen = target
    if ev >= 0:
        seen = tl.atomic_add(cnt_ptr + ev, 0, sem="acquire", scope=SCOPE)
        spins = ev * 0
        while ((seen - target) < 0) & (spins < spin):
            seen = tl.atomic_add(cnt_ptr + ev, 0, sem="acquire", scope=SCOPE)
            spins += 1
            if tl.atomic_add(err_ptr, 0) != 0:
                spins = spin
    tl.debug_barrier()  # every thread's loads of the tile after the acquiring read
    return (seen - target) >= 0, seen


@triton.jit
def _bump(cnt_ptr, trig_ptr, trank_ptr, psig_ptr, row_ptr, me, P, SCOPE: tl.constexpr):
    """Bump the row's triggers (after every thread's stores of the tile): event ``ev`` of rank
    ``r`` is ``cnt_ptr + psig[me * P + r] + ev``."""
    tl.debug_barrier()
    t0 = tl.load(row_ptr + C_TRIG0)
    for k in range(t0, t0 + tl.load(row_ptr + C_NTRIG)):
        to = tl.load(psig_ptr + me * P + tl.load(trank_ptr + k))
        tl.atomic_add(cnt_ptr + to + tl.load(trig_ptr + k), 1, sem="release", scope=SCOPE)


@triton.jit
def _valid(count_ptr, row_ptr):
    """Rows of the tile that are valid this step: ``clamp(count[SLOT] - VOFF, 0, ROWS)``."""
    n = tl.load(row_ptr + C_ROWS)
    slot = tl.load(row_ptr + C_SLOT)
    if slot >= 0:
        have = tl.load(count_ptr + slot) - tl.load(row_ptr + C_VOFF)
        n = tl.minimum(tl.maximum(have, 0), n)
    return n


@triton.jit
def _kernel(
    tasks_ptr,
    n_rows,
    ticket_ptr,
    err_ptr,
    trace_ptr,
    trig_ptr,
    trank_ptr,
    cnt_ptr,
    n_ev,
    psig_ptr,
    pdata_ptr,
    count_ptr,
    tok_ptr,
    wt_ptr,
    ret_ptr,
    wtk_ptr,
    x_ptr,
    w1_ptr,
    w3_ptr,
    w2_ptr,
    xr_ptr,
    h_ptr,
    a_ptr,
    yr_ptr,
    yret_ptr,
    y_ptr,
    dy_ptr,
    g_ptr,
    da_ptr,
    dh_ptr,
    dxr_ptr,
    dxret_ptr,
    dx_ptr,
    dtopk_ptr,
    dw1_ptr,
    dw3_ptr,
    dw2_ptr,
    T,
    H,
    F,
    K,
    e,
    P,
    S,
    spin,
    epoch,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
    TRACE: tl.constexpr,
    SCOPE: tl.constexpr,
    FORWARD: tl.constexpr,
):
    t = tl.atomic_add(ticket_ptr, 1)
    stop = tl.atomic_add(err_ptr, 0)
    while (t < n_rows) & (stop == 0):
        row_ptr = tasks_ptr + t.to(tl.int64) * NCOL
        me = tl.load(row_ptr + C_HOME)
        cnt = cnt_ptr + me.to(tl.int64) * n_ev
        ready, seen = _wait(cnt, err_ptr, row_ptr, spin, epoch, SCOPE)
        if ready:
            # this rank's share of every buffer (0 when the launch holds one rank)
            tb = me.to(tl.int64) * T  # token rows
            sb = me.to(tl.int64) * e * P * S  # slot rows
            wb = me.to(tl.int64) * e * H * F  # expert weight elements
            cb = me.to(tl.int64) * 2 * e * P  # count entries
            op = tl.load(row_ptr + C_OP)
            row0 = tl.load(row_ptr + C_ROW0)
            dst0 = tl.load(row_ptr + C_DST0)
            count = count_ptr + cb
            n = _valid(count, row_ptr)
            j = tl.maximum(tl.load(row_ptr + C_EXPERT), 0)
            jw = wb + j.to(tl.int64) * H * F
            put = tl.load(pdata_ptr + me * P + tl.load(row_ptr + C_PEER))  # 0: no put
            tok, wt = tok_ptr + sb, wt_ptr + sb  # E * S = e * P * S entries a rank
            if op == OP_DISPATCH:
                gather_rows(
                    x_ptr + tb * H, xr_ptr + sb * H + put, tok, wt, row0, dst0, n, H, False, BM, BN
                )
            elif op == OP_DISPATCH_GRAD:
                gather_rows(
                    dy_ptr + tb * H, g_ptr + sb * H + put, tok, wt, row0, dst0, n, H, True, BM, BN
                )
            elif op == OP_GATE_UP:  # h[:, :F] = x @ w1[j], h[:, F:] = x @ w3[j]
                xr, hh = xr_ptr + sb * H, h_ptr + sb * 2 * F
                row_gemm(
                    xr,
                    H,
                    w1_ptr + jw,
                    F,
                    1,
                    xr,
                    w1_ptr,
                    hh,
                    2 * F,
                    row0,
                    n,
                    H,
                    F,
                    False,
                    BM,
                    BN,
                    BK,
                    UPCAST,
                )
                row_gemm(
                    xr,
                    H,
                    w3_ptr + jw,
                    F,
                    1,
                    xr,
                    w3_ptr,
                    hh + F,
                    2 * F,
                    row0,
                    n,
                    H,
                    F,
                    False,
                    BM,
                    BN,
                    BK,
                    UPCAST,
                )
            elif op == OP_SWIGLU:
                swiglu_rows(h_ptr + sb * 2 * F, a_ptr + sb * F, row0, n, F, BM, BN)
            elif op == OP_DOWN:  # y = a @ w2[j]
                ar = a_ptr + sb * F
                row_gemm(
                    ar,
                    F,
                    w2_ptr + jw,
                    H,
                    1,
                    ar,
                    w2_ptr,
                    yr_ptr + sb * H,
                    H,
                    row0,
                    n,
                    F,
                    H,
                    False,
                    BM,
                    BN,
                    BK,
                    UPCAST,
                )
            elif op == OP_COMBINE:
                if FORWARD:
                    copy_rows(yr_ptr + sb * H, yret_ptr + sb * H + put, row0, dst0, n, H, BM, BN)
                else:
                    copy_rows(dxr_ptr + sb * H, dxret_ptr + sb * H + put, row0, dst0, n, H, BM, BN)
            elif op == OP_TOPK:
                topk_rows(
                    yret_ptr + sb * H,
                    ret_ptr + tb * K,
                    wtk_ptr + tb * K,
                    y_ptr + tb * H,
                    row0,
                    n,
                    H,
                    K,
                    True,
                    BM,
                    BN,
                )
            elif op == OP_ACT_GRAD:  # da = g @ w2[j]^T: b[k=h, n=f] = w2[j][f, h]
                gr = g_ptr + sb * H
                row_gemm(
                    gr,
                    H,
                    w2_ptr + jw,
                    1,
                    H,
                    gr,
                    w2_ptr,
                    da_ptr + sb * F,
                    F,
                    row0,
                    n,
                    H,
                    F,
                    False,
                    BM,
                    BN,
                    BK,
                    UPCAST,
                )
            elif op == OP_W2_GRAD:  # dw2[j] = a^T g
                weight_grad(
                    a_ptr + sb * F,
                    F,
                    g_ptr + sb * H,
                    H,
                    dw2_ptr + jw,
                    H,
                    count,
                    j,
                    P,
                    S,
                    F,
                    H,
                    BM,
                    BN,
                    BK,
                    UPCAST,
                )
            elif op == OP_SWIGLU_GRAD:
                swiglu_grad_rows(
                    da_ptr + sb * F, h_ptr + sb * 2 * F, dh_ptr + sb * 2 * F, row0, n, F, BM, BN
                )
            elif op == OP_GATE_GRAD:  # dx = dh1 @ w1[j]^T + dh3 @ w3[j]^T
                dhr = dh_ptr + sb * 2 * F
                row_gemm(
                    dhr,
                    2 * F,
                    w1_ptr + jw,
                    1,
                    F,
                    dhr + F,
                    w3_ptr + jw,
                    dxr_ptr + sb * H,
                    H,
                    row0,
                    n,
                    F,
                    H,
                    True,
                    BM,
                    BN,
                    BK,
                    UPCAST,
                )
            elif op == OP_W1_GRAD:  # dw1[j] = x^T dh1, dw3[j] = x^T dh3
                xr, dhr = xr_ptr + sb * H, dh_ptr + sb * 2 * F
                weight_grad(
                    xr, H, dhr, 2 * F, dw1_ptr + jw, F, count, j, P, S, H, F, BM, BN, BK, UPCAST
                )
                weight_grad(
                    xr, H, dhr + F, 2 * F, dw3_ptr + jw, F, count, j, P, S, H, F, BM, BN, BK, UPCAST
                )
            elif op == OP_SUM:
                topk_rows(
                    dxret_ptr + sb * H,
                    ret_ptr + tb * K,
                    wt_ptr,
                    dx_ptr + tb * H,
                    row0,
                    n,
                    H,
                    K,
                    False,
                    BM,
                    BN,
                )
            elif op == OP_TOPK_GRAD:
                topk_grad_rows(
                    dy_ptr + tb * H,
                    yret_ptr + sb * H,
                    ret_ptr + tb * K,
                    dtopk_ptr + tb * K,
                    row0,
                    n,
                    H,
                    K,
                    BM,
                    BN,
                )
            _bump(cnt, trig_ptr, trank_ptr, psig_ptr, row_ptr, me, P, SCOPE)
            if TRACE:
                at = tl.atomic_add(trace_ptr, 1)
                tl.store(trace_ptr + 1 + at, t)
        else:
            if tl.atomic_cas(err_ptr, 0, t + 1) == 0:  # the first program to give up
                tl.store(err_ptr + 1, seen)
                tl.store(err_ptr + 2, tl.program_id(0))
        t = tl.atomic_add(ticket_ptr, 1)
        stop = tl.atomic_add(err_ptr, 0)


# -- sizing to the device ---------------------------------------------------------------------
def device_programs(device: torch.device) -> int:
    """Programs of one launch: one resident program per SM on CUDA (a program of 4 warps
    holds one SM's share of registers at these tiles; the queue needs no more, and more would
    only contend for tickets); 2 under the interpreter (the second finds the queue drained:
    the multi-program path runs, programs executing in turn)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def device_tiles(device: torch.device) -> tuple[int, int, int]:
    """``(BM, BN, BK)`` of the GEMM and row tiles. Interpreter: 16 x 32 x 32 (16 is
    ``tl.dot``'s smallest; small keeps the tests fast). CUDA: 64 x 64 x 32 (FlashDMoE's
    ``bN = 64``; its ``bM = 128`` halved for the few rows a slot holds at small loads). Not
    tuned on a GPU: Triton's autotuner times configs by running the kernel again, which would
    bump the peers' counters and put tiles into them a second time, so a tuned table per
    device is what a GPU session has to measure."""
    if device.type == "cuda":
        return 64, 64, 32
    return 16, 32, 32


# -- launcher ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Launch:
    """One launch's tables (``taskflow.runtime.persistent`` builds them for one rank or for V
    virtual ranks).

    Attributes:
        direction: "forward" or "backward".
        tasks: int32 ``[n, NCOL]`` in topological order (``HOME`` numbers the launch's ranks).
        triggers, trigger_ranks: int32 ``[m]``: the rows' trigger events and their ranks.
        counters: int32 ``[V * n_ev]``: event counters, ``n_ev`` per rank, each holding
            ``(epoch - 1) * threshold`` (zeros at epoch 1; never reset between launches).
        psig, pdata: int64 ``[V * P]``: element offsets from a rank's own counters / put
            targets to rank r's (entry ``HOME * P + r``).
        step: the step's routing tables (``count``, ``tok``, ``wt``, ``ret``, ``wtk``), each
            ``[V * ...]``.
        bufs: the plan's buffers by name (``DIRECTION_BUFFERS``), each ``[V * rows, cols]``.
        tokens, hidden, ffn, top_k, local_experts, ep_size, slot_rows: the bucket's shape.
        scope: the release atomics' scope: "gpu" (one device) or "sys" (peers on others).
        epoch: how many launches, this one included, have used ``counters`` (>= 1): a wait
            is met at ``epoch * threshold``.
    """

    direction: str
    tasks: torch.Tensor
    triggers: torch.Tensor
    trigger_ranks: torch.Tensor
    counters: torch.Tensor
    psig: torch.Tensor
    pdata: torch.Tensor
    step: dict[str, torch.Tensor]
    bufs: dict[str, torch.Tensor]
    tokens: int
    hidden: int
    ffn: int
    top_k: int
    local_experts: int
    ep_size: int
    slot_rows: int
    scope: str = "gpu"
    epoch: int = 1

    @property
    def ranks(self) -> int:
        return self.psig.numel() // self.ep_size


def _check_ints(name: str, t: torch.Tensor, dim: int, dtype: torch.dtype = torch.int32) -> None:
    if t.dtype != dtype or t.dim() != dim or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {dtype} tensor of {dim} dims, got "
            f"{t.dtype} {tuple(t.shape)}"
        )


def _check(launch: Launch) -> list[torch.Tensor]:
    """The buffers in kernel order (a placeholder for the other direction's); one line per
    bad argument."""
    if launch.direction not in DIRECTION_BUFFERS:
        raise ValueError(f"direction ({launch.direction!r}) must be 'forward' or 'backward'")
    if not isinstance(launch.epoch, int) or launch.epoch < 1:
        raise ValueError(f"epoch ({launch.epoch!r}) must be an int >= 1")
    if launch.scope not in ("gpu", "sys"):
        raise ValueError(f"scope ({launch.scope!r}) must be 'gpu' or 'sys'")
    names = DIRECTION_BUFFERS[launch.direction]
    missing = [n for n in names if n not in launch.bufs]
    if missing:
        raise ValueError(f"bufs lacks {missing} for the {launch.direction} kernel")
    first = launch.bufs[names[0]]
    for name in names:
        b = launch.bufs[name]
        check_float(name, b)
        check_device(name, b)
        if b.dtype != first.dtype or b.dim() != 2 or not b.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous 2-D {first.dtype} tensor, got {b.dtype} "
                f"{tuple(b.shape)}"
            )
    for name, t, dim in (
        ("tasks", launch.tasks, 2),
        ("triggers", launch.triggers, 1),
        ("trigger_ranks", launch.trigger_ranks, 1),
        ("counters", launch.counters, 1),
    ):
        _check_ints(name, t, dim)
    _check_ints("psig", launch.psig, 1, torch.int64)
    _check_ints("pdata", launch.pdata, 1, torch.int64)
    tables = {
        "tasks": launch.tasks,
        "triggers": launch.triggers,
        "trigger_ranks": launch.trigger_ranks,
        "counters": launch.counters,
        "psig": launch.psig,
        "pdata": launch.pdata,
        **{f"step[{k!r}]": v for k, v in launch.step.items()},
    }
    for name, t in tables.items():
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device}; the buffers are on {first.device}")
    if launch.tasks.shape[1] != ops.NCOL:
        raise ValueError(f"tasks must have {ops.NCOL} columns, got {launch.tasks.shape[1]}")
    if launch.psig.numel() != launch.pdata.numel() or launch.psig.numel() % launch.ep_size:
        raise ValueError(
            f"psig and pdata must hold V * P = V * {launch.ep_size} offsets, got "
            f"{launch.psig.numel()} and {launch.pdata.numel()}"
        )
    if launch.counters.numel() % launch.ranks:
        raise ValueError(f"counters ({launch.counters.numel()}) must split over the V ranks")
    return [launch.bufs.get(name, first) for name in BUFFERS]


def _int32(v: int) -> int:
    """``v`` modulo 2**32 as a signed int32 (the kernel's wrapping counter arithmetic)."""
    return (v + 2**31) % 2**32 - 2**31


@dataclass(frozen=True, slots=True)
class Started:
    """A launch on its way: ``result()`` waits for it and raises its ``TaskError``, if any.

    On CUDA the error word is copied to pinned host memory behind the kernel (no host sync at
    the launch): ``result()`` waits for that copy only, so a caller may check a launch one
    launch later (``taskflow.runtime.persistent`` does) and the host never waits for the
    launch it just queued."""

    launch: Launch
    err: torch.Tensor  # int32 [3] on the device: failed row + 1, the count seen, the program
    done: torch.Tensor  # int32 [1 + n]: the trace (rows in completion order), if recorded
    host: torch.Tensor | None  # pinned copy of err (CUDA), else None
    event: torch.cuda.Event | None
    spin: int
    trace: bool

    def result(self) -> list[int] | None:
        """The rows in the order they completed (with ``trace``), else None.

        Raises:
            TaskError: a program gave up on a wait (names the row, its rank, plan uid, opcode
                and event, the count it saw against ``epoch * threshold``).
        """
        if self.event is not None and self.host is not None:
            self.event.synchronize()
            failed, seen, pid = self.host.tolist()
        else:
            failed, seen, pid = self.err.tolist()
        launch = self.launch
        if failed:
            i = failed - 1
            row = launch.tasks[i].tolist()
            ev, thr = row[ops.WAIT], row[ops.THRESH]
            raise TaskError(
                f"persistent {launch.direction} kernel: program {pid} gave up at task row {i} "
                f"(rank slot {row[ops.HOME]}, plan uid {row[ops.UID]}, opcode {row[ops.OP]}) "
                f"waiting on event {ev} at {seen}/{_int32(launch.epoch * thr)} (epoch "
                f"{launch.epoch} x threshold {thr}) after {self.spin} re-reads",
                i,
            )
        return self.done[1 : 1 + int(self.done[0])].tolist() if self.trace else None


def run_tables(
    launch: Launch, *, programs: int | None = None, spin: int | None = None, trace: bool = False
) -> list[int] | None:
    """Run ``launch`` and wait for it: ``start_tables(...).result()``."""
    return start_tables(launch, programs=programs, spin=spin, trace=trace).result()


def start_tables(
    launch: Launch, *, programs: int | None = None, spin: int | None = None, trace: bool = False
) -> Started:
    """Launch ``launch``: ``programs`` programs (default ``device_programs``) take its rows by
    ticket; nothing waits for it (``Started.result()`` does).

    Args:
        launch: the tables, routing and buffers (see ``Launch``).
        programs: the grid (any number: the queue is topological).
        spin: re-reads of a counter before a wait gives up (default ``INTERPRETER_SPIN`` under
            Triton's interpreter, ``GPU_SPIN`` on a GPU).
        trace: record the rows in the order they completed (one atomic per task); ``result()``
            returns them (row indices of ``launch.tasks``).

    Raises:
        ValueError: bad arguments (one line naming the argument and the rule).
    """
    bufs = _check(launch)
    tasks = launch.tasks
    device = tasks.device
    if programs is None:
        programs = device_programs(device)
    if programs < 1:
        raise ValueError(f"programs ({programs}) must be >= 1")
    if spin is None:
        spin = INTERPRETER_SPIN if interpreting() else GPU_SPIN
    n = tasks.shape[0]
    done = torch.zeros(1 + n if trace else 1, dtype=torch.int32, device=device)
    err = torch.zeros(3, dtype=torch.int32, device=device)
    if n == 0:
        return Started(launch, err, done, None, None, spin, trace)
    ticket = torch.zeros(1, dtype=torch.int32, device=device)
    st = launch.step
    BM, BN, BK = device_tiles(device)
    _kernel[(programs,)](
        tasks,
        n,
        ticket,
        err,
        done,
        launch.triggers,
        launch.trigger_ranks,
        launch.counters,
        launch.counters.numel() // launch.ranks,
        launch.psig,
        launch.pdata,
        st["count"],
        st["tok"],
        st["wt"],
        st["ret"],
        st["wtk"],
        *bufs,
        launch.tokens,
        launch.hidden,
        launch.ffn,
        launch.top_k,
        launch.local_experts,
        launch.ep_size,
        launch.slot_rows,
        spin,
        _int32(launch.epoch),
        BM=BM,
        BN=BN,
        BK=BK,
        UPCAST=upcast_dot(),
        TRACE=trace,
        SCOPE=launch.scope,
        FORWARD=launch.direction == "forward",
    )
    if device.type != "cuda":
        return Started(launch, err, done, None, None, spin, trace)
    host = torch.empty(3, dtype=torch.int32, pin_memory=True)
    host.copy_(err, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return Started(launch, err, done, host, event, spin, trace)
