"""One persistent Triton kernel per direction that runs a lowered taskflow plan.

Shape legend: T tokens, K top-k, H hidden, F expert hidden, e local experts, P ranks, S slot
rows, n device tasks.

A program takes the rows ``starts[p] .. starts[p + 1]`` of a task table (``kernels.task_ops``,
written by ``taskflow.lower``) and, for each, in order:

1. **waits**: spins on an atomic read of the event counter in device memory until it reaches
   the row's threshold (at most ``spin`` re-reads; past them the program records the row in
   ``status`` and stops, so a wrong table is an error, not a hang);
2. **runs the tile** by opcode: GEMM tiles with ``tl.dot`` (gate/up ``x @ w1[j]`` and
   ``x @ w3[j]`` into ``h``, down ``a @ w2[j]``, and the backward's ``g @ w2[j]^T``,
   ``dh1 @ w1[j]^T + dh3 @ w3[j]^T`` and the weight gradients ``a^T g``, ``x^T dh``), vector
   tiles for the dispatch gather, SwiGLU and its gradient, the combine copy and the top-k
   reductions; only the slot's valid rows (``count[SLOT] - VOFF``), so an empty tile skips its
   body;
3. **bumps** its triggers with atomic adds, after a barrier so every thread's stores are done.

``single_program``: one program over the table in the lowering's single-program order, in
which no wait can block: the mode for Triton's interpreter (which runs programs one after
another) and a correct, serial mode on a GPU. ``concurrent``: one program per queue (matrix,
vector) spinning on each other's counters: the GPU mode; it needs every program resident at
once (two here), which a GPU grants. It has **not run on a GPU**: under the interpreter a wait
on another program's bump could never end, so the launcher refuses it there.

The tiles' bodies are ``kernels.persistent_tiles``; this module is the task loop (wait, run,
bump), the two kernels and the launcher. Math as the sequential executor's handlers (``taskflow.runtime.handlers``), in fp32 with one
rounding to the buffers' dtype (fp32, bf16, fp16).
"""

from __future__ import annotations

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

__all__ = ["BACKWARD_BUFFERS", "FORWARD_BUFFERS", "run_tables"]

# Tile sizes: 16 is tl.dot's smallest; small so the interpreter's tests stay fast. Not tuned
# on a GPU (nothing here has run on one yet).
BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32
# Re-reads of a wait before a program gives up (the concurrent mode on a GPU). Not measured: at
# an L2 atomic's ~0.1-1 us a re-read, 2**30 of them are minutes, not the run's timeout_s.
GPU_SPIN = 1 << 30

FORWARD_BUFFERS = ("x_TH", "w1", "w3", "w2", "x_recv", "h", "a", "y_rows", "y_ret", "y_TH")
BACKWARD_BUFFERS = (
    *("dy_TH", "w1", "w3", "w2", "x_recv", "h", "a", "y_ret"),
    *("g_recv", "da", "dh", "dx_rows", "dx_ret", "dx_TH", "dtopk_TK", "dw1", "dw3", "dw2"),
)

_C = {name: tl.constexpr(i) for i, name in enumerate(ops.COLUMNS)}
C_OP, C_UID, C_WAIT, C_THRESH = _C["OP"], _C["UID"], _C["WAIT"], _C["THRESH"]
C_TRIG0, C_NTRIG, C_EXPERT, C_SLOT = _C["TRIG0"], _C["NTRIG"], _C["EXPERT"], _C["SLOT"]
C_VOFF, C_ROW0, C_DST0, C_ROWS = _C["VOFF"], _C["ROW0"], _C["DST0"], _C["ROWS"]
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


# -- the task loop's parts ----------------------------------------------------------------------
@triton.jit
def _wait(cnt_ptr, row_ptr, spin):
    """Spin until the row's event reaches its threshold; returns whether it did."""
    ev = tl.load(row_ptr + C_WAIT)
    ready = ev < 0
    if ev >= 0:
        thr = tl.load(row_ptr + C_THRESH)
        seen = tl.atomic_add(cnt_ptr + ev, 0, sem="acquire")
        spins = ev * 0
        while (seen < thr) & (spins < spin):
            seen = tl.atomic_add(cnt_ptr + ev, 0, sem="acquire")
            spins += 1
        ready = seen >= thr
    tl.debug_barrier()  # every thread's loads of the tile after the acquiring read
    return ready


@triton.jit
def _bump(cnt_ptr, trig_ptr, row_ptr, trace_ptr, i, TRACE: tl.constexpr):
    """Bump the row's triggers (after every thread's stores of the tile); with TRACE append
    the row index ``i`` to the trace (``trace[0]`` counts the rows written after it)."""
    tl.debug_barrier()
    t0 = tl.load(row_ptr + C_TRIG0)
    for k in range(t0, t0 + tl.load(row_ptr + C_NTRIG)):
        tl.atomic_add(cnt_ptr + tl.load(trig_ptr + k), 1, sem="release")
    if TRACE:
        at = tl.atomic_add(trace_ptr, 1)
        tl.store(trace_ptr + 1 + at, i)


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
def _forward_kernel(
    tasks_ptr,
    starts_ptr,
    trig_ptr,
    cnt_ptr,
    status_ptr,
    trace_ptr,
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
    H,
    F,
    K,
    P,
    S,
    spin,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
    TRACE: tl.constexpr,
):
    pid = tl.program_id(0)
    lo = tl.load(starts_ptr + pid)
    hi = tl.load(starts_ptr + pid + 1)
    failed = lo * 0
    for i in range(lo, hi):
        if failed == 0:
            row_ptr = tasks_ptr + i * NCOL  # n * NCOL < 2^31: the table is int32
            if _wait(cnt_ptr, row_ptr, spin):
                op = tl.load(row_ptr + C_OP)
                row0 = tl.load(row_ptr + C_ROW0)
                n = _valid(count_ptr, row_ptr)
                jw = tl.maximum(tl.load(row_ptr + C_EXPERT), 0).to(tl.int64) * H * F
                if op == OP_DISPATCH:
                    dst0 = tl.load(row_ptr + C_DST0)
                    gather_rows(x_ptr, xr_ptr, tok_ptr, wt_ptr, row0, dst0, n, H, False, BM, BN)
                elif op == OP_GATE_UP:
                    row_gemm(
                        xr_ptr,
                        H,
                        w1_ptr + jw,
                        F,
                        1,
                        xr_ptr,
                        w1_ptr,
                        h_ptr,
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
                        xr_ptr,
                        H,
                        w3_ptr + jw,
                        F,
                        1,
                        xr_ptr,
                        w3_ptr,
                        h_ptr + F,
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
                    swiglu_rows(h_ptr, a_ptr, row0, n, F, BM, BN)
                elif op == OP_DOWN:
                    row_gemm(
                        a_ptr,
                        F,
                        w2_ptr + jw,
                        H,
                        1,
                        a_ptr,
                        w2_ptr,
                        yr_ptr,
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
                    copy_rows(yr_ptr, yret_ptr, row0, tl.load(row_ptr + C_DST0), n, H, BM, BN)
                elif op == OP_TOPK:
                    topk_rows(yret_ptr, ret_ptr, wtk_ptr, y_ptr, row0, n, H, K, True, BM, BN)
                _bump(cnt_ptr, trig_ptr, row_ptr, trace_ptr, i, TRACE)
            else:
                failed = i + 1
    tl.store(status_ptr + pid, failed)


@triton.jit
def _backward_kernel(
    tasks_ptr,
    starts_ptr,
    trig_ptr,
    cnt_ptr,
    status_ptr,
    trace_ptr,
    count_ptr,
    tok_ptr,
    wt_ptr,
    ret_ptr,
    dy_ptr,
    w1_ptr,
    w3_ptr,
    w2_ptr,
    xr_ptr,
    h_ptr,
    a_ptr,
    yret_ptr,
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
    H,
    F,
    K,
    P,
    S,
    spin,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
    TRACE: tl.constexpr,
):
    pid = tl.program_id(0)
    lo = tl.load(starts_ptr + pid)
    hi = tl.load(starts_ptr + pid + 1)
    failed = lo * 0
    for i in range(lo, hi):
        if failed == 0:
            row_ptr = tasks_ptr + i * NCOL  # n * NCOL < 2^31: the table is int32
            if _wait(cnt_ptr, row_ptr, spin):
                op = tl.load(row_ptr + C_OP)
                row0 = tl.load(row_ptr + C_ROW0)
                n = _valid(count_ptr, row_ptr)
                j = tl.maximum(tl.load(row_ptr + C_EXPERT), 0)
                jw = j.to(tl.int64) * H * F
                if op == OP_DISPATCH_GRAD:
                    dst0 = tl.load(row_ptr + C_DST0)
                    gather_rows(dy_ptr, g_ptr, tok_ptr, wt_ptr, row0, dst0, n, H, True, BM, BN)
                elif op == OP_ACT_GRAD:  # da = g @ w2[j]^T: b[k=h, n=f] = w2[j][f, h]
                    row_gemm(
                        g_ptr,
                        H,
                        w2_ptr + jw,
                        1,
                        H,
                        g_ptr,
                        w2_ptr,
                        da_ptr,
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
                        a_ptr,
                        F,
                        g_ptr,
                        H,
                        dw2_ptr + jw,
                        H,
                        count_ptr,
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
                    swiglu_grad_rows(da_ptr, h_ptr, dh_ptr, row0, n, F, BM, BN)
                elif op == OP_GATE_GRAD:  # dx = dh1 @ w1[j]^T + dh3 @ w3[j]^T
                    row_gemm(
                        dh_ptr,
                        2 * F,
                        w1_ptr + jw,
                        1,
                        F,
                        dh_ptr + F,
                        w3_ptr + jw,
                        dxr_ptr,
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
                elif op == OP_COMBINE:
                    dst0 = tl.load(row_ptr + C_DST0)
                    copy_rows(dxr_ptr, dxret_ptr, row0, dst0, n, H, BM, BN)
                elif op == OP_W1_GRAD:  # dw1[j] = x^T dh1, dw3[j] = x^T dh3
                    weight_grad(
                        xr_ptr,
                        H,
                        dh_ptr,
                        2 * F,
                        dw1_ptr + jw,
                        F,
                        count_ptr,
                        j,
                        P,
                        S,
                        H,
                        F,
                        BM,
                        BN,
                        BK,
                        UPCAST,
                    )
                    weight_grad(
                        xr_ptr,
                        H,
                        dh_ptr + F,
                        2 * F,
                        dw3_ptr + jw,
                        F,
                        count_ptr,
                        j,
                        P,
                        S,
                        H,
                        F,
                        BM,
                        BN,
                        BK,
                        UPCAST,
                    )
                elif op == OP_SUM:
                    topk_rows(dxret_ptr, ret_ptr, wt_ptr, dx_ptr, row0, n, H, K, False, BM, BN)
                elif op == OP_TOPK_GRAD:
                    topk_grad_rows(dy_ptr, yret_ptr, ret_ptr, dtopk_ptr, row0, n, H, K, BM, BN)
                _bump(cnt_ptr, trig_ptr, row_ptr, trace_ptr, i, TRACE)
            else:
                failed = i + 1
    tl.store(status_ptr + pid, failed)


# -- launcher ----------------------------------------------------------------------------------
def _check_ints(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype != torch.int32 or t.dim() != dim or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous int32 tensor of {dim} dims, got "
            f"{t.dtype} {tuple(t.shape)}"
        )


def run_tables(
    direction: str,
    tasks: torch.Tensor,
    starts: torch.Tensor,
    triggers: torch.Tensor,
    counters: torch.Tensor,
    step: dict[str, torch.Tensor],
    bufs: dict[str, torch.Tensor],
    *,
    hidden: int,
    ffn: int,
    top_k: int,
    ep_size: int,
    slot_rows: int,
    spin: int | None = None,
    trace: bool = False,
) -> list[int] | None:
    """Launch the ``direction`` kernel: ``starts.numel() - 1`` programs over ``tasks``.

    Args:
        direction: "forward" or "backward".
        tasks, starts: a task table and its cuts (``DeviceTables.program_tables``).
        triggers: int32 trigger event ids.
        counters: int32 event counters (zero; bumped in place).
        step: the step's routing tables (``count``, ``tok``, ``wt``, ``ret``, ``wtk``).
        bufs: the plan's buffers by name (``FORWARD_BUFFERS`` / ``BACKWARD_BUFFERS``), 2-D,
            contiguous, one float dtype.
        hidden, ffn, top_k, ep_size, slot_rows: the bucket's shape.
        spin: re-reads of a counter before a wait gives up (default: 0 with one program, where
            no wait may block; ``GPU_SPIN`` with several).
        trace: record the rows in the order they completed (one atomic per task) and return
            them (row indices of ``tasks``); None without it.

    Raises:
        ValueError: bad arguments, or several programs under the interpreter.
        RuntimeError: a program gave up on a wait (names the task row and its event).
    """
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction ({direction!r}) must be 'forward' or 'backward'")
    names = FORWARD_BUFFERS if direction == "forward" else BACKWARD_BUFFERS
    missing = [n for n in names if n not in bufs]
    if missing:
        raise ValueError(f"bufs lacks {missing} for the {direction} kernel")
    dtype = bufs[names[0]].dtype
    for name in names:
        b = bufs[name]
        check_float(name, b)
        check_device(name, b)
        if b.dtype != dtype or b.dim() != 2 or not b.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous 2-D {dtype} tensor, got {b.dtype} {tuple(b.shape)}"
            )
    for name, t, dim in (
        ("tasks", tasks, 2),
        ("starts", starts, 1),
        ("triggers", triggers, 1),
        ("counters", counters, 1),
    ):
        _check_ints(name, t, dim)
    if tasks.shape[1] != ops.NCOL:
        raise ValueError(f"tasks must have {ops.NCOL} columns, got {tasks.shape[1]}")
    programs = starts.numel() - 1
    if programs < 1:
        raise ValueError("starts must cut at least one program")
    if programs > 1 and interpreting():
        raise ValueError(
            f"{programs} concurrent programs cannot run under Triton's interpreter: it runs "
            "programs one after another, so a wait on another program's bump would never end; "
            "use mode 'single_program'"
        )
    if spin is None:
        spin = 0 if programs == 1 else GPU_SPIN
    status = torch.zeros(programs, dtype=torch.int32, device=tasks.device)
    done = torch.zeros(1 + tasks.shape[0] if trace else 1, dtype=torch.int32, device=tasks.device)
    if tasks.shape[0] == 0:
        return [] if trace else None
    head = (
        tasks,
        starts,
        triggers,
        counters,
        status,
        done,
        step["count"],
        step["tok"],
        step["wt"],
        step["ret"],
    )
    dims = (hidden, ffn, top_k, ep_size, slot_rows, spin)
    meta = dict(BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, UPCAST=upcast_dot(), TRACE=trace)
    if direction == "forward":
        _forward_kernel[(programs,)](*head, step["wtk"], *(bufs[n] for n in names), *dims, **meta)
    else:
        _backward_kernel[(programs,)](*head, *(bufs[n] for n in names), *dims, **meta)
    bad = status.nonzero().flatten().tolist()
    if bad:
        p = bad[0]
        i = int(status[p]) - 1
        row = tasks[i].tolist()
        ev = row[ops.WAIT]
        raise RuntimeError(
            f"persistent {direction} kernel: program {p} gave up at task row {i} (plan uid "
            f"{row[ops.UID]}, opcode {row[ops.OP]}) waiting on event {ev} at "
            f"{int(counters[ev])}/{row[ops.THRESH]} after {spin} re-reads"
        )
    return done[1 : 1 + int(done[0])].tolist() if trace else None
