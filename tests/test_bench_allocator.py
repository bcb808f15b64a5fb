"""moesaic.bench.allocator: freed memory stays in the process (no fresh page faults per step)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Training steps of the layer at the bench shape (the workload the module docstring measured):
# minor page faults per step after one warm-up step (the median of 5 steps: a step that happens
# to grow the heap faults in its new pages once, retained or not).
PROBE = """
import resource, sys, torch
from moesaic.bench import layer as bl
from moesaic.bench.allocator import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
torch.set_num_threads(1)
bench = bl.LayerBench()
x, g = bl._inputs(bench, "uniform", 0)
layer = bl._layer(bench, "dropless", "uniform")
bl._train_step(layer, x, g)
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bl._train_step(layer, x, g)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults)[2])
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_retained_memory_is_not_faulted_in_again():
    if not _glibc():
        pytest.skip("no glibc mallopt")
    default, retained = _faults("default"), _faults("retain")
    # Measured ~3,000-5,500 faults per step by default, ~0-150 with the memory retained.
    assert retained * 5 < default, (retained, default)


def _glibc() -> bool:
    import ctypes.util

    name = ctypes.util.find_library("c")
    return name is not None and "libc.so" in name
