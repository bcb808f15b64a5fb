"""The CUDA primitives of ``moesaic.comm.symmetric`` against the contract of the torch ops they
call, on the CPU: ``_SymmetricMemory.stream_write_value32`` is replaced by a stand-in that makes
the checks of torch's ``symm_mem::stream_write_value32_`` (a flat, contiguous **uint32**
tensor, 0 <= offset < numel, 0 <= val < 2**32) and then writes the word, and the streams by
None (``torch.cuda.stream(None)`` does nothing), so that what :class:`CudaSymmetricMemory`
hands the op is checked without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch._C import _distributed_c10d as c10d

from moesaic.comm.signals import WORD, Arrivals, SignalLayout
from moesaic.comm.symmetric import CudaSymmetricMemory


class _WriteValue32:
    """``_SymmetricMemory`` with the one static method the primitives use."""

    @staticmethod
    def stream_write_value32(input: torch.Tensor, offset: int, val: int) -> torch.Tensor:
        if not (input.dim() == 1 and input.is_contiguous() and input.dtype == torch.uint32):
            raise RuntimeError(
                "symm_mem::stream_write_value32_: input must be a flat, contiguous uint32 tensor."
            )
        if not 0 <= offset < input.numel():
            raise RuntimeError(f"offset ({offset}) exceeded the numel of the input")
        if not 0 <= val < WORD:
            raise RuntimeError("val must be in the range of [0, 4294967295] (uint32_t).")
        input[offset] = val
        return input


@pytest.fixture
def prims(monkeypatch) -> CudaSymmetricMemory:
    monkeypatch.setattr(c10d, "_SymmetricMemory", _WriteValue32)
    p = object.__new__(CudaSymmetricMemory)  # no process group: only write and read are used
    p._streams = {torch.device("cpu"): (None, None)}
    p._handles = []
    return p


def test_signal_words_reach_the_op_as_uint32_and_read_back_as_totals(prims):
    layout = SignalLayout(ranks=2, events=3)
    words = torch.zeros(layout.numel, dtype=torch.int32)  # the channel's signal array
    arrivals = Arrivals(layout)
    # totals past 2**31 (negative as int32) and at the wrap: the receiver counts each increment
    prims.write(words, layout.event_index(1, 2), WORD - 2)
    prims.write(words, layout.puts_index(1), 5)
    assert words.dtype == torch.int32 and int(words[layout.event_index(1, 2)]) == -2
    assert arrivals.absorb(prims.read(words)) == [(2, WORD - 2)]
    prims.write(words, layout.event_index(1, 2), 1)  # 3 more, across the wrap
    assert arrivals.absorb(prims.read(words)) == [(2, 3)]
    assert arrivals.step_puts_P() == [0, 5]
