"""The step's tail (``moesaic.sim.steptail``): the health check's tiny collectives where each
schedule runs them, then the optimizer."""

from __future__ import annotations

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.sim.collectives import LinkModel
from moesaic.sim.model import ModelSpec
from moesaic.sim.pipelined import GRAD, NET, Costs, run_pipelined
from moesaic.sim.profile import Profile
from moesaic.sim.steptail import CONTROL, flags_s, norm_s

MODEL = ModelSpec(layers=2, batch=4, seq_len=16, hidden=32, ffn_hidden=32, experts=4, top_k=2)
CALL_S = 0.003  # the measured small all-reduce


def _costs(world: int, R: int = 2) -> Costs:
    spec = ClusterSpec(levels=(Level(name="n", size=world, bandwidth_gbps=1.0, latency_ms=0.01),))
    link = LinkModel(spec=spec, allreduce_call_s=CALL_S)
    return Costs(MODEL, link, Profile(flops_per_s=1e8), R)


def _lane(g, name):
    return [(t.key, wait) for t, wait in g.lanes.get(name, [])]


def test_tiny_collectives_cost_the_measured_call():
    """Their latency terms (0.01 ms a step) are far under the measured call: both cost it (and
    a few bytes' transfer)."""
    link = _costs(4).link
    assert norm_s(link) == pytest.approx(CALL_S, rel=1e-3)
    assert flags_s(link) == pytest.approx(CALL_S, rel=1e-3)


def test_vanilla_checks_after_the_gradients_and_blocks_the_optimizer():
    """vanilla: AR1, then the norm's all-reduce and the flags' all-gather on the same lane, and
    the optimizer after them: the step grows by both calls."""
    c = _costs(2, R=1)
    g, tl = run_pipelined(c, degree=1, overlap=False, chunk_bytes=None, early=False)
    assert [key for key, _ in _lane(g, NET)[-3:]] == ["bwd:AR1", "norm", "flags"]
    assert _lane(g, NET)[-2:] == [("norm", "bwd:AR1"), ("flags", "norm")]
    assert _lane(g, "compute")[-1] == ("optimizer", "flags")
    assert tl.start["optimizer"] == pytest.approx(tl.end["bwd:AR1"] + 2 * CALL_S)


@pytest.mark.parametrize("chunk_parts", [None, 4], ids=["moe-only", "flowmoe"])
def test_pipelined_steps_gather_their_flags_beside_the_last_gradients(chunk_parts):
    """moe-only and flowmoe: one gather on a lane of its own, issued when the backward's compute
    ends; the optimizer waits for it and the last all-reduce, so with gradients that take
    longer than the call it adds nothing."""
    c = _costs(2)
    sp = None if chunk_parts is None else c.grad_bytes() / chunk_parts
    g, tl = run_pipelined(c, degree=2, overlap=chunk_parts is not None, chunk_bytes=sp)
    ((flags, after),) = _lane(g, CONTROL)
    backward_end = [k for k, _ in _lane(g, "compute") if k != "optimizer"][-1]
    assert (flags, after) == ("flags", backward_end)
    assert "norm" not in tl.start
    last_ar = _lane(g, NET if sp is None else GRAD)[-1][0]
    assert tl.start["flags"] == pytest.approx(tl.end[backward_end])
    assert tl.start["optimizer"] == pytest.approx(max(tl.end[last_ar], tl.end["flags"]))
    assert tl.end[last_ar] > tl.end["flags"]


def test_one_rank_has_no_collectives_to_check():
    g, _ = run_pipelined(_costs(1, R=1), degree=1, overlap=False, chunk_bytes=None, early=False)
    keys = {t.key for t in g.tasks()}
    assert "optimizer" in keys and not keys & {"norm", "flags"}
