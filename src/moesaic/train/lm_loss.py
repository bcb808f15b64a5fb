"""The training loss: mean next-token cross-entropy, computed in fp32 a chunk of rows at a time.

Shape legend: N rows (tokens), V vocabulary.

``F.cross_entropy(logits.float(), y)`` materialises the vocabulary-wide tensors of the whole
batch in fp32: the upcast logits, the log-softmax it saves (4 V bytes a token), and in the
backward the log-softmax's and the logits' gradients (8 V more). With a large vocabulary they
dominate a step's memory: 16k tokens of Qwen3's 151936-word vocabulary are 10 GB each, most of
the 80.6 GiB peak of a bf16 step on an H200 (``benchmarks/results/gpu_train_step_h200.json``).

``lm_loss`` keeps the logits as they come (the head's output, in the compute dtype) and one fp32
log-sum-exp a row; the forward and the backward upcast ``loss_chunk.LOSS_CHUNK_ELEMENTS``
logits at a time, and the backward writes the logits' gradient, ``(softmax - onehot) / n`` in
the logits' dtype, chunk by chunk: 2 V bytes a token saved and 2 V of gradient in bf16 (4 and 4 in fp32),
one chunk's fp32 temporaries besides. The arithmetic is ``F.cross_entropy``'s on the upcast
logits (tests/train/test_lm_loss.py compares values and gradients), no host sync, rows with
``IGNORE_INDEX`` targets left out of the mean as ``F.cross_entropy`` leaves them.

On a GPU with Triton (``kernels`` "auto", as the layer's option resolves) the rows' reductions
are ``kernels.cross_entropy``'s: one read of the logits forward, one read and one write
backward, instead of the chunks' dozen passes, and no chunk temporaries.
"""

from __future__ import annotations

import torch

from moesaic import kernels as kernel_choice
from moesaic import loss_chunk

__all__ = ["IGNORE_INDEX", "lm_loss"]

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index


def _rows_per_chunk(V: int) -> int:
    return max(1, loss_chunk.LOSS_CHUNK_ELEMENTS // max(1, V))


def _rows_chunked(
    logits_NV: torch.Tensor, safe_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, fp32: log-sum-exp and the target's logit, ``_rows_per_chunk`` rows at a time."""
    N, V = logits_NV.shape
    rows = _rows_per_chunk(V)
    lse_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    picked_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    for s in range(0, N, rows):
        z = logits_NV[s : s + rows].float()
        lse_N[s : s + rows] = torch.logsumexp(z, dim=-1)
        picked_N[s : s + rows] = z.gather(1, safe_N[s : s + rows, None]).squeeze(1)
    return lse_N, picked_N


def _grad_chunked(
    logits_NV: torch.Tensor, safe_N: torch.Tensor, scale_N: torch.Tensor
) -> torch.Tensor:
    """``(softmax - onehot) * scale`` per row in the logits' dtype, chunk by chunk."""
    N, V = logits_NV.shape
    rows = _rows_per_chunk(V)
    grad_NV = torch.empty_like(logits_NV)
    for s in range(0, N, rows):
        scale = scale_N[s : s + rows, None]
        # softmax makes a new tensor (``float()`` of fp32 logits is the saved one itself)
        p = torch.softmax(logits_NV[s : s + rows].float(), dim=-1).mul_(scale)
        p.scatter_add_(1, safe_N[s : s + rows, None], -scale)  # (softmax - onehot) * scale
        grad_NV[s : s + rows].copy_(p)
    return grad_NV


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, y_N: torch.Tensor, rows_kernel: bool):
        valid_N = y_N != IGNORE_INDEX
        safe_N = torch.where(valid_N, y_N, torch.zeros_like(y_N))
        if rows_kernel:
            from moesaic.kernels.cross_entropy import ce_rows

            lse_N, picked_N = ce_rows(logits_NV, safe_N, IGNORE_INDEX)
        else:
            lse_N, picked_N = _rows_chunked(logits_NV, safe_N)
        n = valid_N.sum().to(torch.float32)
        loss = torch.where(valid_N, lse_N - picked_N, torch.zeros_like(lse_N)).sum() / n
        ctx.rows_kernel = rows_kernel
        ctx.save_for_backward(logits_NV, safe_N, valid_N, lse_N, n)
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        logits_NV, safe_N, valid_N, lse_N, n = ctx.saved_tensors
        scale_N = torch.where(valid_N, g.float() / n, torch.zeros_like(lse_N))
        if ctx.rows_kernel:
            from moesaic.kernels.cross_entropy import ce_rows_grad

            return ce_rows_grad(logits_NV, safe_N, lse_N, scale_N), None, None
        return _grad_chunked(logits_NV, safe_N, scale_N), None, None


def lm_loss(logits_BTV: torch.Tensor, y_BT: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """Mean next-token cross-entropy over the batch's tokens (in fp32; module docstring);
    ``F.cross_entropy(logits.float(), y)`` up to fp32 summation order.

    Args:
        kernels: the rows' reductions, as ``MoEConfig.kernels`` resolves (``kernels.resolve``):
            "torch" chunks, "triton" or "fused" the Triton kernels, "auto" the kernels on a
            GPU with Triton installed.
    """
    V = logits_BTV.shape[-1]
    logits_NV = logits_BTV.reshape(-1, V)
    choice = kernel_choice.resolve(kernels, logits_NV.device)
    if kernels == "auto" and logits_NV.dtype == torch.float64:
        choice = "torch"  # the kernels take fp32 and half logits; "auto" never refuses
    if choice != "torch":
        kernel_choice.require_triton()
        logits_NV = logits_NV.contiguous()
    return _CrossEntropy.apply(logits_NV, y_BT.reshape(-1), choice != "torch")
