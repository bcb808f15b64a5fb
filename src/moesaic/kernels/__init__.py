"""Triton kernels of the expert path, each beside the plain-torch reference it must equal.

Shape legend: T tokens, K top-k, H hidden, F expert hidden, e local experts, M and R rows
(expert-grouped), N output columns of a grouped GEMM.

``MoEConfig.kernels`` picks the implementation (``resolve``):

* "torch": plain torch (``RoutingPlan.permute`` / ``unpermute``, ``experts.grouped_mm``);
* "triton": every kernel of the expert path from here, the grouped GEMMs too;
* "fused": the data plane from here (permute, combine, SwiGLU's elementwise part:
  ``swiglu_act``) around the library's grouped GEMMs (``torch._grouped_mm``, CUTLASS on a
  Hopper GPU, far faster than the Triton GEMMs here: 5.4 ms against 36 ms for a Mixtral-like
  bf16 step on an H200, issue 27);
* "auto" (the default): "fused" on a CUDA device when Triton is installed, else "torch".

This module imports no Triton: the kernel modules do, and only ``load()`` (or an explicit import
of one) reaches them, so the torch path never needs Triton installed (it is in the ``test``
extra, not a dependency).

Kernels (one file each: the ``@triton.jit`` kernels, a launcher, the ``autograd.Function`` and
an ``*_reference`` in plain torch):

* ``permute``: tokens to rows by a slot map ``slot_TK`` (row of assignment (t, k), -1 when
  dropped), any row layout: expert-contiguous (``RoutingPlan.slot_TK``) or the symmetric
  window's padded cells (``window.window_slots``, torch only). Backward: each token sums its
  K rows' gradients (a gather, deterministic).
* ``grouped_gemm``: rows of group i times ``w[i]`` with device-side end offsets (no host sync),
  and both backward GEMMs (``dx = dy @ w[i]^T`` and ``dw[i] = x_i^T @ dy_i``); fp32 and bf16
  with fp32 accumulation.
* ``combine``: the weighted top-k sum of rows back to tokens (the unpermute), and its backward
  (row gradients and the weights' gradients).
* ``swiglu``: the first expert GEMM with SwiGLU fused into its epilogue:
  ``silu(x @ w1[i]) * (x @ w3[i])`` from one pass over ``x``.
* ``swiglu_act``: SwiGLU's elementwise part alone, ``silu(a) * b`` from the two GEMMs'
  outputs, and its backward, one pass each (the "fused" path's activation).
* ``cross_entropy``: the training loss's rows (``train.lm_loss`` on a GPU): an online
  log-sum-exp and the target's logit in one read, the logits' gradient in one read and one
  write (no ``*_reference``: the loss's chunked torch path is its reference).
* ``persistent``: one persistent kernel that runs a lowered taskflow plan, one launch per
  direction (``taskflow.lower``; its table vocabulary is ``task_ops``, which imports no
  Triton): one program per SM taking tile tasks by ticket, puts into peers' memory with
  release signals (EP > 1: virtual ranks on one device, or peers on one node); the
  ``taskflow`` dispatcher's path on CUDA (``kernels="auto"`` or ``"triton"``).

Under ``torch.compile`` every entry point above but the persistent kernel's (``route``,
``permute``, ``grouped_gemm``, ``grouped_swiglu``, ``swiglu_act``, ``combine``) calls its
launchers as custom ops (``torch.library.custom_op``, ``moesaic::*``, each with a fake kernel
and a backward that is a custom op too): opaque to Inductor, which cannot fuse a hand-written
Triton kernel anyway, and traced through by Dynamo and AOTAutograd, so a compiled dropless
layer is one graph each way on the "fused" and "triton" paths (``tests/test_compile.py``;
with a graph break around each kernel, and its bookkeeping traced, it was 18 graphs and on an
H200 slower than eager). Eagerly they run their ``autograd.Function``s: a custom op's
dispatch costs ~35 us of host time a call more (measured on CPU), and the layer on a GPU is
host-bound at small shapes. (Tracing the ``autograd.Function``s themselves failed on an H200,
torch 2.11: AOTAutograd's joint graph refused the router's non-differentiable counts.)

Tested against the references under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU in
tests/kernels. On a GPU (one H200, issue 27, benchmarks/gpu_layer.py) a Mixtral-like bf16 step
with the Triton GEMMs took 36 ms against 5.4 ms with torch's: hence "fused". Two interpreter
defects (Triton 3.9) are worked around only under it: bf16 ``tl.dot`` (tiles cast to fp32
first, ``_launch.upcast_dot``) and fp32-to-bf16 casts that truncate (rounded by hand,
``_jit.cast_out``).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import TYPE_CHECKING

from moesaic.eager import constant_under_compile

if TYPE_CHECKING:
    import torch

KERNELS = ("torch", "triton", "fused", "auto")

INSTALL_HINT = 'pip install "triton>=3.0" (or pip install -e ".[test]")'


def triton_available() -> bool:
    """Whether Triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def require_triton() -> None:
    """Raise a clear error when ``kernels="triton"`` is asked for without Triton installed."""
    if not triton_available():
        raise ModuleNotFoundError(
            f'kernels="triton" needs Triton, which is not installed: {INSTALL_HINT}; '
            'or use kernels="torch"'
        )


def resolve(kernels: str, device: torch.device) -> str:
    """The implementation ``kernels`` means for tensors on ``device``: "torch", "triton" or
    "fused" ("auto": "fused" on CUDA with Triton installed, else "torch")."""
    if kernels != "auto":
        return kernels
    return "fused" if device.type == "cuda" and triton_available() else "torch"


@constant_under_compile
def _resolved(kernels: str, device: torch.device) -> str:
    """``resolve``, with the Triton path loaded when chosen. A constant under ``torch.compile``
    (run when traced, not traced: it imports), so a compiled forward reaches ``load()`` with
    the module already kept and breaks no graph there."""
    choice = resolve(kernels, device)
    if choice in ("triton", "fused"):
        load()
    return choice


class KernelChoice:
    """``MoEConfig.kernels`` resolved (:func:`resolve`) once per device type, not per forward.

    ``Router`` and ``GroupedExperts`` build one from their config and resolve it for their
    parameters' device then; each forward asks for the rows' device, which costs a comparison
    and resolves again only on another device type (a layer built on the CPU and moved to a GPU:
    its first forward there). The choice is what the forward passes down (``RoutingPlan.kernels``,
    ``expert_ffn(kernels=...)``).
    """

    __slots__ = ("_choice", "_device_type", "option")

    def __init__(self, option: str, device: torch.device) -> None:
        self.option = option
        self._device_type = device.type
        self._choice = _resolved(option, device)

    def for_device(self, device: torch.device) -> str:
        """ "torch", "triton" or "fused" for tensors on ``device``."""
        if device.type != self._device_type:
            self._choice = _resolved(self.option, device)
            self._device_type = device.type
        return self._choice


def load() -> ModuleType:
    """The Triton expert path (``moesaic.kernels.ffn``), importing Triton on first use (kept:
    a ``KernelChoice`` that resolves to it loads it, outside any compiled graph)."""
    if not _LOADED:
        require_triton()
        _LOADED.append(importlib.import_module("moesaic.kernels.ffn"))
    return _LOADED[0]


_LOADED: list[ModuleType] = []
