"""The router after its gate GEMM, in one kernel each way: softmax, top-k, combine weights and the
per-forward statistics of the balance and z losses.

Shape legend: T tokens, E experts, K top-k, P programs (blocks of tokens).

From fp32 logits ``[T, E]`` the forward computes, per token, the softmax probabilities, the K
most probable experts (best first) and their weights (the probabilities, normalised to sum to
one when asked, times a scale), and per block of tokens the partial sums of the probabilities,
of the assignments per expert and of the squared log-sum-exp. One torch sum over the P blocks
then gives the mean probability per expert, the counts and the z-loss. The backward recomputes
the probabilities from the logits and each token's saved log-sum-exp and writes the logits'
gradient from the weights', the mean probabilities' and the z-loss's, in one pass.

Plain torch spends about 18 kernels on this forward and 25 on its backward (softmax, topk, a
gather, the normalisation, the counts' scatter-add, the mean, the z-loss and the autograd
nodes of each). A GPU step of a small MoE layer waits on its host there (docs/performance.md,
"On a GPU"). ``route_reference`` is the same in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moesaic.kernels._launch import check_device, kernel_op

# Logits per program: about 4096 fp32 values (16 per thread of 8 warps). Not tuned on a GPU.
_TILE = 4096
_CLAMP = 1e-20  # the torch path's clamp of the top-k sum before normalising


def block_e(E: int) -> int:
    """Columns per program: E rounded up to a power of two, at least 16."""
    return max(16, 1 << max(E - 1, 0).bit_length())


def block_t(E: int) -> int:
    """Tokens per program: ``_TILE`` logits' worth, 16 to 256."""
    return max(16, min(256, _TILE // block_e(E)))


def route_reference(
    logits_TE: torch.Tensor, top_k: int, normalize: bool = True, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch: ``(ids_TK, weights_TK, probs_mean_E, counts_E, z)`` as ``route``."""
    E = logits_TE.shape[1]
    probs_TE = torch.softmax(logits_TE, dim=-1)
    ids_TK = torch.topk(probs_TE, top_k, dim=-1).indices
    weights_TK = probs_TE.gather(1, ids_TK)
    if normalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(_CLAMP)
    weights_TK = weights_TK * scale
    counts_E = torch.zeros(E, dtype=logits_TE.dtype, device=logits_TE.device)
    flat = ids_TK.reshape(-1)
    counts_E.scatter_add_(0, flat, torch.ones_like(flat, dtype=counts_E.dtype))
    z = torch.logsumexp(logits_TE, dim=-1).square().mean()
    return ids_TK, weights_TK, probs_TE.mean(dim=0), counts_E, z


@triton.jit
def _logits_tile(logits_ptr, rows, cols, T, E):
    """The [BT, BE] tile of logits: -inf past E; zeros in rows past T (finite, masked later)."""
    row_ok = rows < T
    ok = row_ok[:, None] & (cols < E)[None, :]
    offs = rows.to(tl.int64)[:, None] * E + cols[None, :]
    lg = tl.load(logits_ptr + offs, mask=ok, other=float("-inf"))
    return tl.where(row_ok[:, None], lg, 0.0)


@triton.jit
def _route_fwd(
    logits_ptr,
    ids_ptr,
    w_ptr,
    lse_ptr,
    part_ptr,
    T,
    E,
    inv_T,
    scale,
    K: tl.constexpr,
    KP: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BT: tl.constexpr,
    BE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    cols = tl.arange(0, BE)
    row_ok = rows < T
    lg = _logits_tile(logits_ptr, rows, cols, T, E)
    m = tl.max(lg, axis=1)
    ex = tl.exp(lg - m[:, None])
    s = tl.sum(ex, axis=1)
    p = ex / s[:, None]
    lse = m + tl.log(s)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    # top-k by repeated argmax (the lowest index of equal values first); the K chosen values
    # collected in a [BT, KP] tile, then normalised and stored together
    ks = tl.arange(0, KP)
    ids = tl.zeros((BT, KP), dtype=tl.int64)
    vals = tl.zeros((BT, KP), dtype=tl.float32)
    counts = tl.zeros((BE,), dtype=tl.float32)
    cur = tl.where((cols < E)[None, :], p, -1.0)
    for k in tl.static_range(K):
        best = tl.argmax(cur, axis=1)
        hit = cols[None, :] == best[:, None]
        v = tl.sum(tl.where(hit, p, 0.0), axis=1)
        ids = tl.where(ks[None, :] == k, best.to(tl.int64)[:, None], ids)
        vals = tl.where(ks[None, :] == k, v[:, None], vals)
        counts += tl.sum((hit & row_ok[:, None]).to(tl.float32), axis=0)
        cur = tl.where(hit, -2.0, cur)
    if NORMALIZE:
        vals = vals / tl.maximum(tl.sum(vals, axis=1), 1e-20)[:, None]
    vals = vals * scale
    out = rows.to(tl.int64)[:, None] * K + ks[None, :]
    ok_k = row_ok[:, None] & (ks < K)[None, :]
    tl.store(ids_ptr + out, ids, mask=ok_k)
    tl.store(w_ptr + out, vals, mask=ok_k)
    # this block's partial sums: mean probability (each over T), counts, mean squared lse
    psum = tl.sum(tl.where(row_ok[:, None], p, 0.0), axis=0) * inv_T
    zsum = tl.sum(tl.where(row_ok, lse * lse, 0.0), axis=0) * inv_T
    base = part_ptr + pid.to(tl.int64) * (2 * E + 1)
    tl.store(base + cols, psum, mask=cols < E)
    tl.store(base + E + cols, counts, mask=cols < E)
    tl.store(base + 2 * E, zsum)


@triton.jit
def _route_bwd(
    logits_ptr,
    lse_ptr,
    ids_ptr,
    dw_ptr,
    dpm_ptr,
    dz_ptr,
    dlogits_ptr,
    T,
    E,
    inv_T,
    scale,
    K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DPM: tl.constexpr,
    HAS_DZ: tl.constexpr,
    BT: tl.constexpr,
    BE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    cols = tl.arange(0, BE)
    row_ok = rows < T
    col_ok = cols < E
    lg = _logits_tile(logits_ptr, rows, cols, T, E)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    p = tl.exp(lg - lse[:, None])
    # gradient of the probabilities: the mean's, then each chosen weight's
    gp = tl.zeros((BT, BE), dtype=tl.float32)
    if HAS_DPM:
        gp += tl.load(dpm_ptr + cols, mask=col_ok, other=0.0)[None, :] * inv_T
    if HAS_DW:
        rows64 = rows.to(tl.int64)
        if NORMALIZE:  # the chosen probabilities' sum S and sum_k dw_k v_k
            vsum = tl.zeros((BT,), dtype=tl.float32)
            dot = tl.zeros((BT,), dtype=tl.float32)
            for k in tl.static_range(K):
                idk = tl.load(ids_ptr + rows64 * K + k, mask=row_ok, other=0)
                dwk = tl.load(dw_ptr + rows64 * K + k, mask=row_ok, other=0.0)
                vk = tl.sum(tl.where(cols[None, :] == idk[:, None], p, 0.0), axis=1)
                vsum += vk
                dot += dwk * vk
            big = vsum > 1e-20
            denom = tl.where(big, vsum, 1e-20)
        for k in tl.static_range(K):
            idk = tl.load(ids_ptr + rows64 * K + k, mask=row_ok, other=0)
            dwk = tl.load(dw_ptr + rows64 * K + k, mask=row_ok, other=0.0)
            if NORMALIZE:
                # w_k = c v_k / S: dv_k = c (dw_k - [S above the clamp] sum_j dw_j v_j / S) / S
                dvk = scale * (dwk - tl.where(big, dot / denom, 0.0)) / denom
            else:
                dvk = scale * dwk
            gp += tl.where(cols[None, :] == idk[:, None], dvk[:, None], 0.0)
    # softmax backward, plus the z-loss's d(lse^2)/dlogits = 2 lse p (over T)
    inner = tl.sum(gp * p, axis=1)
    dl = p * (gp - inner[:, None])
    if HAS_DZ:
        dz = tl.load(dz_ptr)
        dl += p * (2.0 * dz * inv_T * lse)[:, None]
    offs = rows.to(tl.int64)[:, None] * E + cols[None, :]
    tl.store(dlogits_ptr + offs, dl, mask=row_ok[:, None] & col_ok[None, :])


def _launch_fwd(
    logits_TE: torch.Tensor, top_k: int, normalize: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids_TK``, ``weights_TK``, ``lse_T`` (saved for the backward) and the statistics'
    column sums ``[2E + 1]``: the mean probabilities, the counts and z."""
    T, E = logits_TE.shape
    BT, BE = block_t(E), block_e(E)
    P = triton.cdiv(T, BT)
    dev = logits_TE.device
    ids_TK = torch.empty(T, top_k, dtype=torch.long, device=dev)
    weights_TK = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    lse_T = torch.empty(T, dtype=torch.float32, device=dev)
    part_PW = torch.empty(P, 2 * E + 1, dtype=torch.float32, device=dev)
    KP = max(2, 1 << max(top_k - 1, 0).bit_length())
    _route_fwd[(P,)](
        logits_TE,
        ids_TK,
        weights_TK,
        lse_T,
        part_PW,
        T,
        E,
        1.0 / T,
        float(scale),
        K=top_k,
        KP=KP,
        NORMALIZE=normalize,
        BT=BT,
        BE=BE,
    )
    return ids_TK, weights_TK, lse_T, part_PW.sum(dim=0)


def _launch_bwd(
    logits_TE: torch.Tensor,
    lse_T: torch.Tensor,
    ids_TK: torch.Tensor,
    dw_TK: torch.Tensor | None,
    dpm_E: torch.Tensor | None,
    dz: torch.Tensor | None,
    normalize: bool,
    scale: float,
) -> torch.Tensor:
    T, E = logits_TE.shape
    K = ids_TK.shape[1]
    BT, BE = block_t(E), block_e(E)
    dlogits_TE = torch.empty_like(logits_TE)
    dummy = lse_T  # a pointer for the absent gradients (never read)
    dw = dw_TK.float().contiguous() if dw_TK is not None else dummy
    dpm = dpm_E.float().contiguous() if dpm_E is not None else dummy
    dzz = dz.float().reshape(1) if dz is not None else dummy
    _route_bwd[(triton.cdiv(T, BT),)](
        logits_TE,
        lse_T,
        ids_TK,
        dw,
        dpm,
        dzz,
        dlogits_TE,
        T,
        E,
        1.0 / T,
        float(scale),
        K=K,
        NORMALIZE=normalize,
        HAS_DW=dw_TK is not None,
        HAS_DPM=dpm_E is not None,
        HAS_DZ=dz is not None,
        BT=BT,
        BE=BE,
    )
    return dlogits_TE


def _statistics(sums_W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``probs_mean_E``, ``counts_E`` and the 0-d ``z`` out of ``_launch_fwd``'s ``[2E + 1]``
    sums (views of it)."""
    E = (sums_W.shape[0] - 1) // 2
    probs_mean_E, counts_E, z = sums_W.split([E, E, 1])
    return probs_mean_E, counts_E, z.view(())


class _Route(torch.autograd.Function):
    """The eager path; under torch.compile the custom ops below (kernels/__init__.py)."""

    @staticmethod
    def forward(ctx, logits_TE, top_k, normalize, scale):
        ids_TK, weights_TK, lse_T, sums_W = _launch_fwd(logits_TE, top_k, normalize, scale)
        probs_mean_E, counts_E, z = _statistics(sums_W)
        ctx.save_for_backward(logits_TE, lse_T, ids_TK)
        ctx.normalize, ctx.scale = normalize, float(scale)
        ctx.mark_non_differentiable(ids_TK, counts_E)
        # An output nothing differentiates reaches the backward as None, not as zeros that
        # autograd makes (two kernels a step, and work for the kernel's HAS_* branches).
        ctx.set_materialize_grads(False)
        return ids_TK, weights_TK, probs_mean_E, counts_E, z

    @staticmethod
    def backward(ctx, _dids, dw_TK, dpm_E, _dcounts, dz):
        logits_TE, lse_T, ids_TK = ctx.saved_tensors
        dlogits_TE = _launch_bwd(
            logits_TE, lse_T, ids_TK, dw_TK, dpm_E, dz, ctx.normalize, ctx.scale
        )
        return dlogits_TE, None, None, None


# Under torch.compile: the same launchers as custom ops (kernels/__init__.py). The statistics
# come out as one [2E + 1] tensor, split by the caller (a custom op's outputs may not alias
# each other); its gradient carries the mean probabilities' and z's (the counts' part is never
# read).
def _route_fake(logits_TE, top_k, normalize, scale):
    T, E = logits_TE.shape
    f32 = torch.float32
    return (
        logits_TE.new_empty(T, top_k, dtype=torch.long),
        logits_TE.new_empty(T, top_k, dtype=f32),
        logits_TE.new_empty(T, dtype=f32),
        logits_TE.new_empty(2 * E + 1, dtype=f32),
    )


_route_bwd_op = kernel_op(
    "route_bwd",
    "(Tensor logits_TE, Tensor lse_T, Tensor ids_TK, Tensor? dw_TK, Tensor? dpm_E, "
    "Tensor? dz, bool normalize, float scale) -> Tensor",
    _launch_bwd,
    lambda logits_TE, *_: torch.empty_like(logits_TE),
)


def _route_op_setup(ctx, inputs, output):
    logits_TE, _top_k, normalize, scale = inputs
    ids_TK, _weights_TK, lse_T, _sums_W = output
    ctx.save_for_backward(logits_TE, lse_T, ids_TK)
    ctx.normalize, ctx.scale = normalize, float(scale)


def _route_op_backward(ctx, _dids, dw_TK, _dlse, dsums_W):
    logits_TE, lse_T, ids_TK = ctx.saved_tensors
    E = logits_TE.shape[1]
    dpm_E = dz = None
    if dsums_W is not None:
        dpm_E, dz = dsums_W[:E], dsums_W[2 * E :]
    dlogits_TE = _route_bwd_op(logits_TE, lse_T, ids_TK, dw_TK, dpm_E, dz, ctx.normalize, ctx.scale)
    return dlogits_TE, None, None, None


_route_op = kernel_op(
    "route",
    "(Tensor logits_TE, int top_k, bool normalize, float scale) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    _launch_fwd,
    _route_fake,
    _route_op_backward,
    _route_op_setup,
)


def route(
    logits_TE: torch.Tensor, top_k: int, normalize: bool = True, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax top-k routing and its loss statistics from fp32 logits, differentiable in them.

    Args:
        logits_TE: the gate's fp32 logits (T >= 1).
        top_k: K, 1 to E.
        normalize: rescale the K chosen probabilities to sum to one.
        scale: multiplies the weights after any normalisation.

    Returns:
        ``ids_TK`` (int64, most probable first), ``weights_TK`` (fp32), ``probs_mean_E`` (the
        mean probability per expert), ``counts_E`` (fp32 assignments per expert, exact below
        2**24 per expert) and ``z`` (the mean squared log-sum-exp, 0-d); the counts and ids
        carry no gradient.
    """
    check_device("logits_TE", logits_TE)
    if logits_TE.dim() != 2 or logits_TE.dtype != torch.float32:
        raise ValueError(
            f"logits_TE must be an fp32 [T, E] tensor, got {logits_TE.dtype} "
            f"{tuple(logits_TE.shape)}"
        )
    T, E = logits_TE.shape
    if T == 0:
        raise ValueError("logits_TE has no tokens: route needs T >= 1 (the torch path takes 0)")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k ({top_k}) must be between 1 and E ({E})")
    if not torch.compiler.is_compiling():
        return _Route.apply(logits_TE.contiguous(), top_k, normalize, scale)
    ids_TK, weights_TK, _lse_T, sums_W = _route_op(logits_TE.contiguous(), top_k, normalize, scale)
    probs_mean_E, counts_E, z = _statistics(sums_W)
    return ids_TK, weights_TK, probs_mean_E, counts_E.detach(), z
