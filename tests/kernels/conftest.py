"""The kernel tests run on Triton's CPU interpreter: set before any kernel module imports
Triton (``@triton.jit`` reads it when a kernel is defined). It stays set for the rest of the
pytest process; nothing else in the suite imports Triton.

Tolerance (``close``): index paths are compared exactly (``torch.equal``); arithmetic paths by
the relative rule of ``moesaic.testing.assert_close_to_ref``: ``err(kernel, ref64) <= 2 *
err(torch reference in the kernel's dtype, ref64) + 4 ulps of fp32`` at the tensor's scale,
``ref64`` the reference in float64 on the same (rounded) inputs. The same rule for bf16: the
kernels accumulate in fp32 and round once, as torch's bf16 matmul does, so no looser bound is
needed (measured worst bf16 error 1.0-1.15x torch's own).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Triton imported earlier without the interpreter keeps its compiled frontend (kernels then fail
# with "Cannot call @triton.jit'd outside of the scope of a kernel"): say so instead.
_TOO_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _interpreter_in_time():
    if _TOO_LATE:
        pytest.skip(
            "Triton was imported before tests/kernels set TRITON_INTERPRET=1: run "
            "TRITON_INTERPRET=1 pytest"
        )


# ``MOESAIC_KERNEL_ERRORS=FILE.json``: every comparison's figures (``testing.ref_errors``) are
# written there at the end of the session, keyed by test and tensor: the worst errors a closing
# note or benchmarks/results/ quotes.
_ERRORS_FILE = os.environ.get("MOESAIC_KERNEL_ERRORS")
_errors: list[dict] = []


def _close(fast: torch.Tensor, ref: torch.Tensor, ref64: torch.Tensor, name: str) -> None:
    from moesaic.testing import assert_close_to_ref, ref_errors

    assert fast.dtype == ref.dtype, f"{name}: {fast.dtype} != {ref.dtype}"
    if _ERRORS_FILE:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        figures = ref_errors(fast, ref, ref64, fast.dtype)
        _errors.append({"test": test, "tensor": name, "dtype": str(fast.dtype), **figures})
    assert_close_to_ref(fast, ref, ref64, name)


def pytest_sessionfinish(session, exitstatus):
    if _ERRORS_FILE and _errors:
        import json

        with open(_ERRORS_FILE, "w") as f:
            json.dump(_errors, f, indent=1)


@pytest.fixture
def close():
    """The relative rule above, as a function ``close(fast, ref_same_dtype, ref64, name)``."""
    return _close
