"""Triton helpers the kernels share."""

from __future__ import annotations

import triton
import triton.language as tl

from moesaic.kernels._launch import interpreting

# The interpreter (Triton 3.9) casts fp32 to bf16 by truncation, also when asked for
# ``fp_downcast_rounding="rtne"`` (501 of 1024 N(0, 1) values differed from torch's cast); a
# GPU rounds to nearest even. Under the interpreter ``cast_out`` rounds by hand, so the tests
# see the rounding a GPU does.
_ROUND_BY_HAND = tl.constexpr(interpreting())


@triton.jit
def cast_out(x, ty: tl.constexpr):
    """fp32 ``x`` to ``ty``, rounding to nearest even."""
    if _ROUND_BY_HAND and ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)  # then truncation is round-to-nearest-even
        # zero and subnormals as they are (the interpreter's own conversion special-cases them)
        normal = (bits & 0x7F800000) != 0
        x = tl.where(normal, rounded, bits).to(tl.float32, bitcast=True)
    return x.to(ty)


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32: fp32 tiles in IEEE fp32 (no TF32, so results match torch's fp32
    matmul), half tiles on the tensor cores; ``UPCAST`` (``_launch.upcast_dot``, under the
    interpreter) casts half tiles to fp32 first."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc
