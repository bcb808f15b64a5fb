"""Device and transport combinations a run cannot make are refused before anything starts
(issue 49 items 3 and 9), checked on CPU with the device, backend and hosts passed as data.

* taskflow on CUDA at EP > 1 on its host runtime with the default gloo puts (which take CPU
  tensors only: the run used to fail at its first forward), and its symmetric-memory transport
  or its persistent kernel with an EP group that spans hosts (torch's symmetric memory maps the
  peers of one host); the persistent kernel (the CUDA default) uses no transport: accepted;
* the sequential taskflow runtime on a backend that ignores message tags (NCCL);
* the device of a process chosen among the GPUs it can see.
"""

from __future__ import annotations

import pytest
import torch

from moesaic.comm.world import device_type_for, visible_cuda_device
from moesaic.taskflow.runtime.sequential import check_tagged_messages
from moesaic.train.config import TrainConfig


def _taskflow(
    transport: str | None = None,
    ep: int | None = None,
    kernels: str = "torch",
    activation: str = "swiglu",
) -> TrainConfig:
    moe: dict = {"dispatcher": "taskflow", "kernels": kernels, "activation": activation}
    if transport is not None:
        moe["options"] = {"transport": transport}
    cfg: dict = {"model": {"moe": moe}}
    if ep is not None:
        cfg["ep"] = ep
    return TrainConfig.from_dict(cfg)


@pytest.mark.parametrize("transport", [None, "gloo"])  # None: the default (gloo)
def test_taskflow_gloo_puts_on_cuda_at_ep_above_one_are_refused(transport):
    with pytest.raises(ValueError, match=r"^options.transport \('gloo'\) puts CPU tensors only"):
        _taskflow(transport).check_world(4, device="cuda")


@pytest.mark.parametrize("kernels", ["auto", "triton"])
def test_taskflow_persistent_kernel_ignores_the_transport(kernels):
    """On CUDA the kernel stores tiles into the peers itself: the default gloo transport (a
    host runtime's) is no reason to refuse; across hosts it is refused as symmetric memory
    is. With Triton missing, "auto" falls back to the host runtime, and gloo is refused."""
    cfg = _taskflow(None, kernels=kernels)
    assert cfg.check_world(4, device="cuda") == 4
    with pytest.raises(ValueError, match=rf"^kernels \('{kernels}'\): .* spans 2 hosts"):
        cfg.check_world(8, device="cuda", ranks_per_host=4)


def test_taskflow_auto_kernels_without_the_kernel_use_the_transport(monkeypatch):
    """``kernels="auto"`` runs on the host runtime for GELU experts or without Triton: there
    the gloo transport is refused on CUDA at EP > 1."""
    from moesaic.kernels import persistent_steps

    gelu = _taskflow(None, kernels="auto", activation="gelu")
    with pytest.raises(ValueError, match=r"^options.transport \('gloo'\) .* kernels 'auto'"):
        gelu.check_world(4, device="cuda")
    monkeypatch.setattr(persistent_steps, "triton_available", lambda: False)
    with pytest.raises(ValueError, match=r"^options.transport \('gloo'\) puts CPU tensors"):
        _taskflow(None, kernels="auto").check_world(4, device="cuda")


@pytest.mark.parametrize("transport", ["symmetric", "auto"])
def test_taskflow_symmetric_memory_across_hosts_is_refused(transport):
    # 8 ranks, 4 per host: an EP group of 8 spans 2 hosts
    with pytest.raises(ValueError, match=r"spans 2 hosts"):
        _taskflow(transport).check_world(8, device="cuda", ranks_per_host=4)
    # EP 4 beside DP 2: each EP group on a host of its own
    assert _taskflow(transport, ep=4).check_world(8, device="cuda", ranks_per_host=4) == 4
    # 3 ranks per host, EP 2: group 1 (ranks 2 and 3) straddles the two hosts
    with pytest.raises(ValueError, match=r"of 2 ranks spans 2 hosts"):
        _taskflow(transport, ep=2).check_world(6, device="cuda", ranks_per_host=3)


@pytest.mark.parametrize(
    ("transport", "world", "device"),
    [
        (None, 4, "cpu"),  # gloo puts of CPU tensors: what CI runs
        (None, 1, "cuda"),  # EP 1: nothing to put
        ("symmetric", 4, "cuda"),  # one host
    ],
)
def test_taskflow_runs_that_can_start_pass(transport, world, device):
    assert _taskflow(transport).check_world(world, device=device) == world


def test_other_strategies_run_anywhere():
    cfg = TrainConfig.from_dict({"model": {"moe": {"dispatcher": "dropless"}}})
    assert cfg.check_world(8, device="cuda", ranks_per_host=2) == 8


def test_the_sequential_runtime_refuses_a_backend_without_tags():
    check_tagged_messages(4, "gloo")
    check_tagged_messages(1, "nccl")  # one rank: no messages
    with pytest.raises(ValueError, match=r"matches its 2 ranks' messages by tag, which backend "):
        check_tagged_messages(2, "nccl")


@pytest.mark.parametrize(
    ("local_rank", "count", "want"),
    [
        (0, 8, 0),
        (5, 8, 5),  # torchrun on an 8-GPU node
        (5, 1, 0),  # CUDA_VISIBLE_DEVICES gives each process its own single GPU
        (3, 2, 1),  # two visible GPUs shared by four processes
        (2, 0, 0),  # no count reported: the first device
    ],
)
def test_the_device_is_chosen_among_the_visible_ones(monkeypatch, local_rank, count, want):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert visible_cuda_device(local_rank) == torch.device("cuda", want)


def test_a_negative_local_rank_is_refused():
    with pytest.raises(ValueError, match=r"^local_rank \(-1\) must be >= 0$"):
        visible_cuda_device(-1)


@pytest.mark.parametrize(
    ("backend", "cuda", "want"),
    [
        ("nccl", False, "cuda"),
        ("auto", True, "cuda"),
        ("auto", False, "cpu"),
        ("gloo", True, "cpu"),
    ],
)
def test_the_run_device_follows_the_backend(monkeypatch, backend, cuda, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert device_type_for(backend) == want


def test_the_launcher_refuses_before_it_starts_a_worker(monkeypatch):
    """``moesaic train``'s check before spawning knows the device its workers will take."""
    from moesaic.train.launch import validate_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    moe = {"dispatcher": "taskflow", "kernels": "torch"}  # the host runtime: gloo puts
    cfg = TrainConfig.from_dict({"nproc": 2, "model": {"moe": moe}})
    with pytest.raises(ValueError, match=r"^options.transport \('gloo'\) puts CPU tensors only"):
        validate_config(cfg, 2)
