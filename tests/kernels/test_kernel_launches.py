"""The kernels a fused dropless layer step issues, counted on CPU: aten operators that launch
device work (views and bare allocations do not) plus Triton launches (the interpreter's grid
calls, their own inner torch calls not counted). On a GPU that layer is host-bound at small
shapes (docs/performance.md), and each kernel costs host time to issue, so the count is held
to a budget: a change that adds kernels to the step must raise it here, on purpose.

The CPU count differs from a GPU's in one place: the gate's bf16 GEMM with fp32 output is one
``mm(out_dtype=float32)`` on CUDA and two casts plus an fp32 ``mm`` here
(``router_gate._mm_f32``), in the forward and again in the weight gradient.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import moesaic.experts
from moesaic import MoEConfig, MoELayer, aux_loss

# Operators that launch nothing: views, metadata, and allocations without a fill.
_NO_KERNEL = {
    "view", "_unsafe_view", "t", "transpose", "slice", "select", "expand", "detach", "alias",
    "split_with_sizes", "split", "as_strided", "unsqueeze", "squeeze", "permute", "reshape",
    "empty", "new_empty", "empty_like", "empty_strided",
}  # fmt: skip


class _Kernels(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _step_kernels(monkeypatch, layer, x):
    """(forward, backward) kernel counts of one step, each a Counter by name."""
    import triton.runtime.interpreter as interpreter

    launch = interpreter.GridExecutor.__call__
    counting: list[_Kernels] = []

    def counted(self, *args, **kwargs):
        counting[-1].ops["triton:" + self.fn.__name__] += 1
        with _disable_current_modes():  # the interpreter's own tensor work is not the step's
            return launch(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)
    layer.zero_grad(set_to_none=True)  # no accumulation into earlier gradients
    xi = x.clone().requires_grad_()
    with _Kernels() as fwd:
        counting.append(fwd)
        y = layer(xi)
    loss = (y.float() * torch.linspace(-1, 1, x.shape[1])).sum() + aux_loss(layer)
    with _Kernels() as bwd:
        counting.append(bwd)
        loss.backward()
    return fwd.ops, bwd.ops


def test_a_fused_layer_step_issues_its_budget_of_kernels(monkeypatch):
    # bf16 experts as on a GPU (this CPU would cast them to fp32 around each GEMM)
    monkeypatch.setitem(moesaic.experts._CPU_NATIVE_MATMUL, torch.bfloat16, True)
    cfg = MoEConfig(hidden_size=32, ffn_hidden_size=64, num_experts=4, top_k=2, kernels="fused")
    torch.manual_seed(0)
    layer = MoELayer(cfg).to(torch.bfloat16)
    x = torch.randn(32, 32).to(torch.bfloat16)
    _step_kernels(monkeypatch, layer, x)  # the first step probes and caches
    fwd, bwd = _step_kernels(monkeypatch, layer, x)
    # one launch of each Triton kernel each way
    for ops, kernels in ((fwd, ("_route_fwd", "_permute_fwd", "_swiglu_act_fwd", "_combine_fwd")),
                         (bwd, ("_route_bwd", "_permute_bwd", "_swiglu_bwd_kernel", "_combine_bwd"))):  # fmt: skip
        assert all(ops["triton:" + k] == 1 for k in kernels), ops
    # the route backward gets no zero-filled gradients for its ids and counts
    assert bwd["zeros"] == 0 and bwd["zero_"] == 0, bwd
    # Forward, 19: the gate (2 casts and a GEMM here, one GEMM on CUDA), the router kernel and
    # the sum of its blocks' statistics, the counts' int64 copy, the kept mask, the sort (its
    # keys narrowed first), the slot map (arange, index_put), the permute, the group offsets,
    # 3 grouped GEMMs, SwiGLU, the combine, the statistics' running sum. Backward, 30, the
    # loss's own few included: was 32 before the route's unused gradients stopped being
    # zero-filled, and the forward 20 before the slot map of a dropless step lost its fill.
    assert sum(fwd.values()) <= 19, fwd
    assert sum(bwd.values()) <= 30, bwd
