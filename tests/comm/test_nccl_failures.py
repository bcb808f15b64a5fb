"""A dead peer on NCCL becomes the same one-line root cause as on gloo (issue 49 item 8).

On NCCL a wait is a stream wait and cannot see a dead peer; the process group's watchdog does,
and by default takes the process down from its own thread. ``init_world`` asks it to abort the
communicators only (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``), so the next issue or wait raises
its finding as a ``DistBackendError``; the choke point turns that into the ``CollectiveError``
line gloo gives. Checked here with synthetic errors worded as torch 2.x's watchdog words them
(no GPU needed): the line names the operation, the rank and the deadline, carries the
watchdog's finding without its tags, and the training's failure vocabulary reads it as one
line caused by a peer.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

from moesaic.comm.collectives import CollectiveError, failure_cause, wait_work
from moesaic.comm.world import run_world
from moesaic.train.errors import describe, is_peer_failure

WATCHDOG = (
    "[PG ID 1 PG GUID 3 Rank 1] Process group watchdog thread terminated with exception: "
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, "
    "OpType=ALLTOALL_BASE, NumelIn=96, NumelOut=96, Timeout(ms)=60000) ran for 60012 "
    "milliseconds before timing out.\nException raised from checkTimeout at "
    "/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:632 (most recent call first):\n"
    "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98"
)
REMOTE = (
    "[PG ID 1 PG GUID 3 Rank 0] NCCL error: remote process exited or there was a network "
    "error, NCCL version 2.27.3\nncclRemoteError: A call failed possibly due to a network "
    "error or a remote process exiting prematurely."
)
GLOO = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
# what moesaic prints on gloo (wait_work's line), whatever the backend
LINE = re.compile(
    r"^dispatch counts failed on rank 1/2 of the expert-parallel group "
    r"\(collective_timeout_s=60\): a peer died, hung, or skipped this collective\. Cause: \S"
)


class _FailingWork:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def wait(self, *_args) -> None:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "cause"),
    [
        (dist.DistBackendError(WATCHDOG), "Watchdog caught collective operation timeout: WorkNCCL"),
        (dist.DistBackendError(REMOTE), "NCCL error: remote process exited"),
        (RuntimeError(GLOO), "Connection closed by peer"),
    ],
    ids=["nccl-watchdog-timeout", "nccl-remote-error", "gloo-dead-peer"],
)
@pytest.mark.parametrize("on_stream", [True, False])
def test_a_failed_wait_is_one_line_naming_op_rank_and_cause(exc, cause, on_stream):
    failed = "dispatch counts failed on rank 1/2 of the expert-parallel group"
    with pytest.raises(CollectiveError) as info:
        wait_work(_FailingWork(exc), failed, 60.0, on_stream=on_stream)
    line = describe(info.value)
    assert LINE.match(line), line
    assert "\n" not in line and "[PG" not in line and "frame #" not in line
    assert line.split("Cause: ", 1)[1].startswith(cause)
    assert is_peer_failure(info.value)


def test_the_cause_drops_the_watchdog_tags_and_keeps_its_finding():
    assert failure_cause(dist.DistBackendError(WATCHDOG)) == (
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLTOALL_BASE, "
        "NumelIn=96, NumelOut=96, Timeout(ms)=60000) ran for 60012 milliseconds before timing "
        "out."
    )
    assert failure_cause(RuntimeError("")) == "RuntimeError"
    assert len(failure_cause(RuntimeError("x" * 1000))) == 300


def _issue_on_aborted_communicator(rank: int, world: int) -> str:
    """A collective issued on a communicator the watchdog aborted raises at issue."""
    from moesaic.comm.collectives import EPGroup

    os.environ["MOESAIC_NO_SHORTCUTS"] = "1"  # a world of one issues its collectives
    group = EPGroup(None, 60.0)

    def aborted(*_args, **_kwargs):
        raise dist.DistBackendError(
            "[PG ID 0 PG GUID 0(default_pg) Rank 0] NCCL communicator was aborted on rank 0."
        )

    dist.all_reduce = aborted  # (this spawned process only)
    try:
        group.all_reduce(torch.zeros(1), what="health flags all_reduce")
    except CollectiveError as exc:
        return describe(exc)
    return "no error"


def test_an_issue_on_an_aborted_communicator_is_the_same_line():
    (line,) = run_world(_issue_on_aborted_communicator, 1, timeout_s=120.0)
    assert line == (
        "health flags all_reduce failed on rank 0/1 of the expert-parallel group "
        "(collective_timeout_s=60): a peer died, hung, or skipped this collective. Cause: NCCL "
        "communicator was aborted on rank 0."
    )


def test_a_cuda_world_asks_the_watchdog_to_clean_up_only(monkeypatch):
    """``init_world`` on CUDA sets the watchdog's handling before the group exists, and leaves
    a user's own value (the GPU and the group are faked: no GPU here)."""
    from moesaic.comm import world

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda _device: None)
    monkeypatch.setattr(world, "_meet", lambda: None)

    def init(name, **kwargs):
        seen.append((name, os.environ.get(world.NCCL_ERROR_HANDLING)))

    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.delenv(world.NCCL_ERROR_HANDLING, raising=False)
    world.init_world(device="cuda:0", timeout_s=5.0)
    monkeypatch.setenv(world.NCCL_ERROR_HANDLING, "3")
    world.init_world(device="cuda:0", timeout_s=5.0)
    assert seen == [("cpu:gloo,cuda:nccl", "2"), ("cpu:gloo,cuda:nccl", "3")]
    world.init_world(device="cpu", timeout_s=5.0)  # a CPU world: not asked
    assert seen[-1] == ("gloo", "3")


def test_the_launcher_hands_the_workers_clean_up_only_unless_set(monkeypatch):
    """torch's elastic agent gives each worker its own environment's value (1 when unset, which
    takes the process down): ``moesaic train``'s launcher asks before starting it."""
    from moesaic.comm import world

    monkeypatch.delenv(world.NCCL_ERROR_HANDLING, raising=False)
    world.ask_nccl_watchdog_to_clean_up_only()
    assert os.environ[world.NCCL_ERROR_HANDLING] == "2"
    monkeypatch.setenv(world.NCCL_ERROR_HANDLING, "1")  # the user's choice stays
    world.ask_nccl_watchdog_to_clean_up_only()
    assert os.environ[world.NCCL_ERROR_HANDLING] == "1"
