"""What every launcher shares: the interpreter switch, input checks and the custom op made of
a launcher for torch.compile."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Triton's CPU interpreter (``TRITON_INTERPRET=1``, read when the kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def upcast_dot() -> bool:
    """Whether GEMM tiles go to ``tl.dot`` as fp32.

    Under the interpreter (Triton 3.9) ``tl.dot`` of bf16 tiles returns garbage (errors of
    2e10 on a 16x16 product of N(0, 1) values), so there the tiles are cast to fp32 first:
    bf16 x bf16 products are exact in fp32, so this is the same math as a bf16 ``tl.dot`` with
    fp32 accumulation up to the summation order. On a GPU half tiles go to ``tl.dot`` as is.
    """
    return interpreting()


def block_h(H: int) -> int:
    """Columns per program of the row kernels (permute, combine): H rounded up to a power of
    two, 16 to 1024. At 1024 a program of 4 warps moves 8 bf16 (16 bytes) per thread per
    row; the 64 these kernels had before moved 128 bytes per program."""
    return max(16, min(1024, 1 << max(H - 1, 0).bit_length()))


def check_device(name: str, t: torch.Tensor) -> None:
    """Kernels run on a GPU, or on CPU under the interpreter."""
    if t.device.type == "cpu" and not interpreting():
        raise ValueError(
            f"{name} is on the CPU: Triton kernels need a GPU tensor, or TRITON_INTERPRET=1 "
            "set before Triton is imported (the interpreter, for tests)"
        )


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be fp32, bf16 or fp16, got {t.dtype}")


def check_slots(slot_TK: torch.Tensor, num_tokens: int | None = None) -> None:
    if slot_TK.dim() != 2 or slot_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_TK must be an int32/int64 [T, K] tensor, got {slot_TK.dtype} "
            f"{tuple(slot_TK.shape)}"
        )
    if num_tokens is not None and slot_TK.shape[0] != num_tokens:
        raise ValueError(f"slot_TK has {slot_TK.shape[0]} tokens, expected {num_tokens}")


def kernel_op(
    name: str,
    schema: str,
    launch: Callable[..., Any],
    fake: Callable[..., Any],
    backward: Callable[..., Any] | None = None,
    setup_context: Callable[..., None] | None = None,
) -> Any:
    """``launch`` as the custom op ``moesaic::<name>`` that a kernel's entry point calls under
    ``torch.compile`` (kernels/__init__.py): ``schema`` its signature, ``fake`` its outputs'
    shapes for tracing, ``backward`` (calling the backward's own op) and ``setup_context`` its
    autograd."""
    op = torch.library.custom_op(f"moesaic::{name}", launch, mutates_args=(), schema=schema)
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    return op
