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

Math as the sequential executor's handlers (``taskflow.runtime.handlers``), in fp32 with one
rounding to the buffers' dtype (fp32, bf16, fp16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moesaic.kernels import task_ops as ops
from moesaic.kernels._jit import cast_out, mma
from moesaic.kernels._launch import check_device, check_float, interpreting, upcast_dot

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


# -- tiles -------------------------------------------------------------------------------------
@triton.jit
def _row_gemm(
    a_ptr,
    lda,
    b_ptr,
    sbk,
    sbn,
    a2_ptr,
    b2_ptr,
    c_ptr,
    ldc,
    row0,
    nrows,
    KD,
    N,
    TWO: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``c[rows, :N] = a[rows, :KD] @ b (+ a2[rows] @ b2 when TWO)``, ``b[k, n]`` at
    ``b_ptr + k * sbk + n * sbn`` (strides: a transposed weight is a view)."""
    for m0 in range(0, nrows, BM):
        r = m0 + tl.arange(0, BM)
        row_ok = r < nrows
        rows = (row0 + r).to(tl.int64)
        for n0 in range(0, N, BN):
            cols = n0 + tl.arange(0, BN)
            col_ok = cols < N
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, KD, BK):
                ks = k0 + tl.arange(0, BK)
                k_ok = ks < KD
                a_idx = rows[:, None] * lda + ks[None, :]
                a_mask = row_ok[:, None] & k_ok[None, :]
                b_idx = ks[:, None] * sbk + cols[None, :] * sbn
                b_mask = k_ok[:, None] & col_ok[None, :]
                x = tl.load(a_ptr + a_idx, mask=a_mask, other=0.0)
                w = tl.load(b_ptr + b_idx, mask=b_mask, other=0.0)
                acc = mma(x, w, acc, UPCAST)
                if TWO:
                    x2 = tl.load(a2_ptr + a_idx, mask=a_mask, other=0.0)
                    w2 = tl.load(b2_ptr + b_idx, mask=b_mask, other=0.0)
                    acc = mma(x2, w2, acc, UPCAST)
            out = c_ptr + rows[:, None] * ldc + cols[None, :]
            mask = row_ok[:, None] & col_ok[None, :]
            tl.store(out, cast_out(acc, c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weight_grad(
    a_ptr,
    lda,
    b_ptr,
    ldb,
    c_ptr,
    ldc,
    count_ptr,
    j,
    P,
    S,
    KD,
    N,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``c[:KD, :N] = sum over the valid rows of expert j's P slots of a[rows]^T b[rows]``
    (zeros for an expert without rows), slot by slot in a fixed order."""
    for k0 in range(0, KD, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < KD
        for n0 in range(0, N, BN):
            cols = n0 + tl.arange(0, BN)
            col_ok = cols < N
            acc = tl.zeros((BK, BN), dtype=tl.float32)
            for s in range(0, P):
                slot = j * P + s
                base = slot.to(tl.int64) * S
                valid = tl.load(count_ptr + slot)
                for m0 in range(0, valid, BM):
                    r = m0 + tl.arange(0, BM)
                    r_ok = r < valid
                    rows = base + r
                    x = tl.load(
                        a_ptr + rows[None, :] * lda + ks[:, None],
                        mask=k_ok[:, None] & r_ok[None, :],
                        other=0.0,
                    )
                    y = tl.load(
                        b_ptr + rows[:, None] * ldb + cols[None, :],
                        mask=r_ok[:, None] & col_ok[None, :],
                        other=0.0,
                    )
                    acc = mma(x, y, acc, UPCAST)
            out = c_ptr + ks[:, None] * ldc + cols[None, :]
            mask = k_ok[:, None] & col_ok[None, :]
            tl.store(out, cast_out(acc, c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_rows(
    src_ptr,
    dst_ptr,
    tok_ptr,
    wt_ptr,
    pos0,
    dst0,
    nrows,
    H,
    WEIGHTED: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """Dispatch: ``dst[dst0 + i] = src[tok[pos0 + i]]`` (times ``wt[pos0 + i]`` if WEIGHTED)."""
    for m0 in range(0, nrows, BM):
        r = m0 + tl.arange(0, BM)
        ok = r < nrows
        tok = tl.load(tok_ptr + pos0 + r, mask=ok, other=0).to(tl.int64)
        if WEIGHTED:
            w = tl.load(wt_ptr + pos0 + r, mask=ok, other=0.0)
        dst_rows = (dst0 + r).to(tl.int64)
        for h0 in range(0, H, BN):
            cols = h0 + tl.arange(0, BN)
            mask = ok[:, None] & (cols < H)[None, :]
            v = tl.load(src_ptr + tok[:, None] * H + cols[None, :], mask=mask, other=0.0)
            if WEIGHTED:
                v = cast_out(v.to(tl.float32) * w[:, None], dst_ptr.dtype.element_ty)
            tl.store(dst_ptr + dst_rows[:, None] * H + cols[None, :], v, mask=mask)


@triton.jit
def _copy_rows(src_ptr, dst_ptr, src0, dst0, nrows, H, BM: tl.constexpr, BN: tl.constexpr):
    """Combine put at EP 1: ``dst[dst0 + i] = src[src0 + i]``."""
    for m0 in range(0, nrows, BM):
        r = m0 + tl.arange(0, BM)
        ok = r < nrows
        src_rows = (src0 + r).to(tl.int64)
        dst_rows = (dst0 + r).to(tl.int64)
        for h0 in range(0, H, BN):
            cols = h0 + tl.arange(0, BN)
            mask = ok[:, None] & (cols < H)[None, :]
            v = tl.load(src_ptr + src_rows[:, None] * H + cols[None, :], mask=mask, other=0.0)
            tl.store(dst_ptr + dst_rows[:, None] * H + cols[None, :], v, mask=mask)


@triton.jit
def _swiglu_rows(h_ptr, a_ptr, row0, nrows, F, BM: tl.constexpr, BN: tl.constexpr):
    """``a = silu(h[:, :F]) * h[:, F:]`` on the tile's rows."""
    for m0 in range(0, nrows, BM):
        r = m0 + tl.arange(0, BM)
        ok = r < nrows
        rows = (row0 + r).to(tl.int64)
        for f0 in range(0, F, BN):
            cols = f0 + tl.arange(0, BN)
            mask = ok[:, None] & (cols < F)[None, :]
            hp = h_ptr + rows[:, None] * (2 * F) + cols[None, :]
            h1 = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
            h3 = tl.load(hp + F, mask=mask, other=0.0).to(tl.float32)
            act = h1 * tl.sigmoid(h1) * h3
            out = a_ptr + rows[:, None] * F + cols[None, :]
            tl.store(out, cast_out(act, a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_grad_rows(da_ptr, h_ptr, dh_ptr, row0, nrows, F, BM: tl.constexpr, BN: tl.constexpr):
    """``dh1 = da * h3 * silu'(h1)``, ``dh3 = da * silu(h1)`` on the tile's rows."""
    for m0 in range(0, nrows, BM):
        r = m0 + tl.arange(0, BM)
        ok = r < nrows
        rows = (row0 + r).to(tl.int64)
        for f0 in range(0, F, BN):
            cols = f0 + tl.arange(0, BN)
            mask = ok[:, None] & (cols < F)[None, :]
            hp = h_ptr + rows[:, None] * (2 * F) + cols[None, :]
            h1 = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
            h3 = tl.load(hp + F, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(da_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0)
            g = g.to(tl.float32)
            sig = tl.sigmoid(h1)
            silu = h1 * sig
            dp = dh_ptr + rows[:, None] * (2 * F) + cols[None, :]
            ty = dh_ptr.dtype.element_ty
            tl.store(dp, cast_out(g * h3 * (sig + silu * (1.0 - sig)), ty), mask=mask)
            tl.store(dp + F, cast_out(g * silu, ty), mask=mask)


@triton.jit
def _topk_rows(
    ret_ptr,
    idx_ptr,
    w_ptr,
    out_ptr,
    t0,
    nt,
    H,
    K,
    WEIGHTED: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """``out[t] = sum_k (w[t, k] *) ret[idx[t, k]]`` in k order; idx -1 (dropped) adds 0."""
    for m0 in range(0, nt, BM):
        r = m0 + tl.arange(0, BM)
        ok = r < nt
        tok = (t0 + r).to(tl.int64)
        for h0 in range(0, H, BN):
            cols = h0 + tl.arange(0, BN)
            col_ok = cols < H
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(0, K):
                row = tl.load(idx_ptr + tok * K + k, mask=ok, other=-1)
                keep = ok & (row >= 0)
                v = tl.load(
                    ret_ptr + row.to(tl.int64)[:, None] * H + cols[None, :],
                    mask=keep[:, None] & col_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                if WEIGHTED:
                    v = v * tl.load(w_ptr + tok * K + k, mask=keep, other=0.0)[:, None]
                acc += v
            out = out_ptr + tok[:, None] * H + cols[None, :]
            mask = ok[:, None] & col_ok[None, :]
            tl.store(out, cast_out(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _topk_grad_rows(
    dy_ptr, ret_ptr, idx_ptr, out_ptr, t0, nt, H, K, BM: tl.constexpr, BN: tl.constexpr
):
    """``out[t, k] = <dy[t], ret[idx[t, k]]>`` (0 where dropped)."""
    for m0 in range(0, nt, BM):
        r = m0 + tl.arange(0, BM)
        ok = r < nt
        tok = (t0 + r).to(tl.int64)
        for k in range(0, K):
            row = tl.load(idx_ptr + tok * K + k, mask=ok, other=-1)
            keep = ok & (row >= 0)
            acc = tl.zeros((BM,), dtype=tl.float32)
            for h0 in range(0, H, BN):
                cols = h0 + tl.arange(0, BN)
                col_ok = cols < H
                dy = tl.load(
                    dy_ptr + tok[:, None] * H + cols[None, :],
                    mask=ok[:, None] & col_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                y = tl.load(
                    ret_ptr + row.to(tl.int64)[:, None] * H + cols[None, :],
                    mask=keep[:, None] & col_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                acc += tl.sum(dy * y, axis=1)
            tl.store(out_ptr + tok * K + k, cast_out(acc, out_ptr.dtype.element_ty), mask=ok)


# -- the persistent kernels ------------------------------------------------------------------
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
                    _gather_rows(x_ptr, xr_ptr, tok_ptr, wt_ptr, row0, dst0, n, H, False, BM, BN)
                elif op == OP_GATE_UP:
                    _row_gemm(
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
                    _row_gemm(
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
                    _swiglu_rows(h_ptr, a_ptr, row0, n, F, BM, BN)
                elif op == OP_DOWN:
                    _row_gemm(
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
                    _copy_rows(yr_ptr, yret_ptr, row0, tl.load(row_ptr + C_DST0), n, H, BM, BN)
                elif op == OP_TOPK:
                    _topk_rows(yret_ptr, ret_ptr, wtk_ptr, y_ptr, row0, n, H, K, True, BM, BN)
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
                    _gather_rows(dy_ptr, g_ptr, tok_ptr, wt_ptr, row0, dst0, n, H, True, BM, BN)
                elif op == OP_ACT_GRAD:  # da = g @ w2[j]^T: b[k=h, n=f] = w2[j][f, h]
                    _row_gemm(
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
                    _weight_grad(
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
                    _swiglu_grad_rows(da_ptr, h_ptr, dh_ptr, row0, n, F, BM, BN)
                elif op == OP_GATE_GRAD:  # dx = dh1 @ w1[j]^T + dh3 @ w3[j]^T
                    _row_gemm(
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
                    _copy_rows(dxr_ptr, dxret_ptr, row0, dst0, n, H, BM, BN)
                elif op == OP_W1_GRAD:  # dw1[j] = x^T dh1, dw3[j] = x^T dh3
                    _weight_grad(
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
                    _weight_grad(
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
                    _topk_rows(dxret_ptr, ret_ptr, wt_ptr, dx_ptr, row0, n, H, K, False, BM, BN)
                elif op == OP_TOPK_GRAD:
                    _topk_grad_rows(dy_ptr, yret_ptr, ret_ptr, dtopk_ptr, row0, n, H, K, BM, BN)
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
