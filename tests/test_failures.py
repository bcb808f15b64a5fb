"""No hangs: a dead or absent peer is a clear CollectiveError within the deadline."""

from __future__ import annotations

import os
import time

import pytest
import torch

import moesaic
from moesaic.testing import run_world

TIMEOUT_S = 2.0


def _layer(dispatcher: str = "dropless") -> moesaic.MoELayer:
    cfg = moesaic.MoEConfig(
        hidden_size=8,
        ffn_hidden_size=8,
        num_experts=4,
        collective_timeout_s=TIMEOUT_S,
        dispatcher=dispatcher,
    )
    torch.manual_seed(0)
    return moesaic.MoELayer(cfg)


def absent_peer_worker(rank: int, world: int, mode: str, done: str):
    layer = _layer()
    layer(torch.randn(3, 8))  # the first forward also checks that the ranks' dtypes agree
    if rank == 1:
        if mode == "dies":
            os._exit(17)  # killed: its sockets close under rank 0
        # Alive but never joins the collective: for TIMEOUT_S + 2 s, or until rank 0 is done.
        deadline = time.monotonic() + TIMEOUT_S + 2
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.02)
        return None
    start = time.monotonic()
    try:
        layer(torch.randn(5, 8))
    except moesaic.CollectiveError as exc:
        result = str(exc), time.monotonic() - start
    else:
        result = "no error", time.monotonic() - start
    open(done, "w").close()
    return result


@pytest.mark.parametrize("mode", ["hangs", "dies"])
def test_absent_peer_is_a_clear_error(mode, tmp_path):
    done = str(tmp_path / "done")
    results = run_world(absent_peer_worker, 2, mode, done, timeout_s=60, allow_dead=True)
    message, elapsed = results[0]
    assert results[1] is None
    assert "dispatch counts failed on rank 0/2 of the expert-parallel group" in message
    assert f"collective_timeout_s={TIMEOUT_S:g}" in message
    # hangs: the deadline; dies: gloo sees the reset connection at once.
    assert elapsed < TIMEOUT_S + 3.0


def hybrid_absent_peer_worker(rank: int, world: int):
    """hybrid: the next forward after a weight update gathers experts; a dead peer fails it."""
    layer = _layer("hybrid")  # one domain of both ranks
    layer(torch.randn(3, 8))
    with torch.no_grad():
        layer.experts.w1.mul_(0.5)  # new weights: the next forward must gather again
    if rank == 1:
        os._exit(17)
    start = time.monotonic()
    try:
        layer(torch.randn(5, 8))
    except moesaic.CollectiveError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_hybrid_gather_with_a_dead_peer_is_a_clear_error():
    results = run_world(hybrid_absent_peer_worker, 2, timeout_s=60, allow_dead=True)
    message, elapsed = results[0]
    assert "hybrid gather of experts failed on rank 0/2" in message, message
    assert f"collective_timeout_s={TIMEOUT_S:g}" in message
    assert elapsed < TIMEOUT_S + 3.0
