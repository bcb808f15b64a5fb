"""A one-GPU NCCL world with the single-rank shortcuts off: every strategy's every collective
runs for real (``MOESAIC_NO_SHORTCUTS=1``), and one layer step matches the reference.

Worlds: the world moesaic initialises on a GPU (``cpu:gloo,cuda:nccl``: control-plane tensors
on the CPU, rows over NCCL), and the same layers on a pure ``nccl`` group of their own (their
control-plane tensors then live on the GPU: ``EPGroup.control_device``). The CPU twin runs the
same body on a gloo world of one (quick, and covered nowhere else: shortcuts off on CPU).
``taskflow`` runs here too: a group of one has no put channel, the part that refuses NCCL.
"""

from __future__ import annotations

import functools

import pytest
from _gpu_helpers import NEEDS_CUDA, layer_cases, value_or_fail, world_of_one

from moesaic.comm.world import run_world

WORLDS = [
    pytest.param("cuda", "auto", None, id="cuda-world-gloo+nccl", marks=NEEDS_CUDA),
    pytest.param("cuda", "auto", "nccl", id="cuda-pure-nccl-group", marks=NEEDS_CUDA),
    pytest.param("cpu", "gloo", None, id="cpu-gloo-twin"),
]


@functools.cache
def _results(kind: str, backend: str, group_backend: str | None) -> dict:
    (out,) = run_world(
        world_of_one, 1, kind, group_backend, device=kind, backend=backend, timeout_s=300
    )
    return out


@pytest.mark.parametrize(("kind", "backend", "group_backend"), WORLDS)
@pytest.mark.parametrize("case", [name for name, _, _ in layer_cases(1)])
def test_every_collective_runs_and_the_step_matches_the_reference(
    kind, backend, group_backend, case
):
    result = _results(kind, backend, group_backend)[case]
    value_or_fail(result, case)
    ops = {entry[2] for entry in result["log"]}
    assert "all_to_all" in ops or "all_gather" in ops, f"{case}: no collective ran ({ops})"
