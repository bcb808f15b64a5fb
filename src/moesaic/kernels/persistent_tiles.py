"""The tiles of the persistent taskflow kernel (``kernels.persistent``): what one task row
computes once its wait is over, as ``@triton.jit`` device functions over flat row-major
buffers.

* ``row_gemm``: rows ``row0 .. row0 + n`` of ``a`` times one expert's weight (strided so the
  same function computes ``x @ w`` and ``g @ w^T``), optionally plus a second product (the
  backward's ``dh1 @ w1^T + dh3 @ w3^T``), rounded once to the output's dtype;
* ``weight_grad``: one expert's weight gradient ``a^T g`` over the valid rows of its ``P``
  source slots;
* ``gather_rows`` / ``copy_rows``: the dispatch gather (tokens to slot rows, optionally
  weighted) and the combine's row copy;
* ``swiglu_rows`` / ``swiglu_grad_rows``: ``silu(h1) * h3`` and its gradient;
* ``topk_rows`` / ``topk_grad_rows``: the weighted top-k sum back to tokens and the weights'
  gradient.

Each handles only the ``n`` valid rows it is given (an empty tile does nothing). Math as the
sequential executor's handlers, fp32 accumulation with one rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moesaic.kernels._jit import cast_out, mma

__all__ = [
    "copy_rows",
    "gather_rows",
    "row_gemm",
    "swiglu_grad_rows",
    "swiglu_rows",
    "topk_grad_rows",
    "topk_rows",
    "weight_grad",
]


@triton.jit
def row_gemm(
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
def weight_grad(
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
def gather_rows(
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
def copy_rows(src_ptr, dst_ptr, src0, dst0, nrows, H, BM: tl.constexpr, BN: tl.constexpr):
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
def swiglu_rows(h_ptr, a_ptr, row0, nrows, F, BM: tl.constexpr, BN: tl.constexpr):
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
def swiglu_grad_rows(da_ptr, h_ptr, dh_ptr, row0, nrows, F, BM: tl.constexpr, BN: tl.constexpr):
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
def topk_rows(
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
def topk_grad_rows(
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
