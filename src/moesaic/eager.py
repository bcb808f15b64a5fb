"""``eager_under_compile``: a function that runs eagerly inside a ``torch.compile``'d region (a
graph break around it), without importing ``torch._dynamo`` when the library is imported.

``torch.compiler.disable`` imports Dynamo, which imports Triton: about a second of every
``import moesaic``, and, in the test suite, Triton imported before ``tests/kernels`` can set
``TRITON_INTERPRET=1`` (which then skipped every kernel test). Nothing is compiled before Dynamo
is imported, so the wrapper calls the function plainly until then and its disabled form after.

Used where tracing fails or costs more than it gives: the Triton kernels' entry points
(``kernels/__init__.py``), the layer's host statistics (``MoELayer._record``) and the grouped
GEMM's one-time probe (``experts``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["eager_under_compile"]

_F = TypeVar("_F", bound=Callable[..., Any])


def eager_under_compile(fn: _F) -> _F:
    """``fn`` wrapped: plain until ``torch._dynamo`` is imported, then
    ``torch.compiler.disable(fn)`` (made once, at the first call after that import)."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:  # nothing compiles without Dynamo
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return cast(_F, wrapper)
