"""How library functions behave inside a ``torch.compile``'d region, declared without importing
``torch._dynamo`` (nor torch: ``moesaic.kernels`` and the config import this) when the library
is imported.

``torch.compiler.disable`` imports Dynamo, which imports Triton: about a second of every
``import moesaic``, and, in the test suite, Triton imported before ``tests/kernels`` can set
``TRITON_INTERPRET=1`` (which then skipped every kernel test). Nothing is compiled before Dynamo
is imported, so ``eager_under_compile``'s wrapper calls the function plainly until then and its
disabled form after (a graph break around it). It is used where tracing costs more than it
gives: the layer's host bookkeeping (``MoELayer._account`` and ``_record``: its aux list and
int counters, which a compiled forward would guard on and recompile for every step).

``constant_under_compile`` marks a function whose result a compiled caller may take as a
constant (``torch.compiler.assume_constant_result``'s mark, set without Dynamo): Dynamo runs
it when it traces the call, for real and without a graph break, and keeps its result (the
grouped GEMM's fast-path probe, the kernel choice).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["constant_under_compile", "eager_under_compile"]

_F = TypeVar("_F", bound=Callable[..., Any])


def eager_under_compile(fn: _F) -> _F:
    """``fn`` wrapped: plain until ``torch._dynamo`` is imported, then
    ``torch.compiler.disable(fn)`` (made once, at the first call after that import).

    The wrapper is never traced either. Marked as disabled (the attribute Dynamo reads, set
    without importing it), a compiled caller breaks its graph at the call instead of inlining
    the wrapper; and its code (one code object for every wrapped function) is skipped when the
    caller's eager remainder calls it (``_skip_frames_of``, at its first call). Otherwise
    Dynamo compiled the wrapper's frame once per wrapped function, all on that one code
    object: the layer's Triton entry points alone passed its recompile limit (8) on an H200."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:  # nothing compiles without Dynamo
            return fn(*args, **kwargs)
        if not disabled:
            import torch  # loaded by then (Dynamo is); this module stays torch-free to import

            disabled.append(torch.compiler.disable(fn))
            _skip_frames_of(wrapper)
        return disabled[0](*args, **kwargs)

    wrapper._torchdynamo_disable = True  # type: ignore[attr-defined]
    return cast(_F, wrapper)


def _skip_frames_of(wrapper: Callable[..., Any]) -> None:
    """Dynamo skips ``wrapper``'s code when a frame of it starts (``torch._dynamo``'s ``skip``,
    which has no public name; without it, what Dynamo does by itself: a compile per wrapped
    function)."""
    try:
        from torch._dynamo.decorators import skip
    except ImportError:
        return
    skip(wrapper)


def constant_under_compile(fn: _F) -> _F:
    """``fn``, marked for ``torch.compile`` as returning a constant (a Python value, not a
    tensor) for its arguments: run when traced, its result kept in the graph with no guard on
    it, so it must not change for the process (a probe, a resolved choice)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn
