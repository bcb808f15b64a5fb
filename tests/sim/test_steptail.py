"""The step's tail (``moesaic.sim.steptail``): the control collective (norm, health flags,
statistics) where each schedule runs it, then the optimizer."""

from __future__ import annotations

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.sim.collectives import LinkModel
from moesaic.sim.model import ModelSpec
from moesaic.sim.pipelined import GRAD, NET, Costs, run_pipelined
from moesaic.sim.profile import Profile
from moesaic.sim.steptail import CONTROL, control_bytes, control_s

MODEL = ModelSpec(layers=2, batch=4, seq_len=16, hidden=32, ffn_hidden=32, experts=4, top_k=2)
CALL_S = 0.003  # the measured small all-reduce, a call in a stream
ALONE_S = 0.011  # the measured small all-reduce issued alone
TAIL_BYTES = 8 * (5 + MODEL.layers * MODEL.experts)


def _costs(world: int, R: int = 2, alone_s: float = ALONE_S) -> Costs:
    spec = ClusterSpec(levels=(Level(name="n", size=world, bandwidth_gbps=1.0, latency_ms=0.01),))
    link = LinkModel(spec=spec, allreduce_call_s=CALL_S, allreduce_alone_call_s=alone_s)
    return Costs(MODEL, link, Profile(flops_per_s=1e8), R)


def _lane(g, name):
    return [(t.key, wait) for t, wait in g.lanes.get(name, [])]


def test_control_bytes_are_the_head_and_every_layers_loads():
    """TrainStep.step_sums: the unreduced norm's square, two flags, the loss and the aux loss,
    then each MoE layer's E expert loads, float64."""
    assert control_bytes(MODEL.layers, MODEL.experts) == TAIL_BYTES == 8 * (5 + 2 * 4)


def test_the_control_collective_costs_the_measured_alone_call():
    """Its latency terms (0.01 ms a step) are far under the measured calls: it costs the alone
    call where measured (not the stream's, which hides each exchange's handshake), else the
    stream's."""
    link = _costs(4).link
    assert control_s(link, TAIL_BYTES) == pytest.approx(ALONE_S, rel=1e-3)
    unmeasured = _costs(4, alone_s=0.0).link
    assert control_s(unmeasured, TAIL_BYTES) == pytest.approx(CALL_S, rel=1e-2)


def test_vanilla_sums_after_the_gradients_and_blocks_the_optimizer():
    """vanilla: AR1, then the one control all-reduce on the same lane, and the optimizer after
    it: the step grows by one alone call."""
    c = _costs(2, R=1)
    g, tl = run_pipelined(c, degree=1, overlap=False, chunk_bytes=None, early=False)
    assert _lane(g, NET)[-2:] == [("bwd:AR1", "bwd:AT1.1"), ("norm", "bwd:AR1")]
    assert _lane(g, "compute")[-1] == ("optimizer", "norm")
    assert tl.start["optimizer"] == pytest.approx(tl.end["bwd:AR1"] + ALONE_S, rel=1e-3)
    assert "flags" not in tl.start


@pytest.mark.parametrize("chunk_parts", [None, 4], ids=["moe-only", "flowmoe"])
def test_pipelined_steps_sum_beside_the_last_gradients(chunk_parts):
    """moe-only and flowmoe: the control all-reduce on a lane of its own, issued when the
    backward's compute ends; the optimizer waits for it and the last all-reduce, so with
    gradients that take longer than the call it adds nothing."""
    c = _costs(2, alone_s=CALL_S)
    sp = None if chunk_parts is None else c.grad_bytes() / chunk_parts
    g, tl = run_pipelined(c, degree=2, overlap=chunk_parts is not None, chunk_bytes=sp)
    ((norm, after),) = _lane(g, CONTROL)
    backward_end = [k for k, _ in _lane(g, "compute") if k != "optimizer"][-1]
    assert (norm, after) == ("norm", backward_end)
    last_ar = _lane(g, NET if sp is None else GRAD)[-1][0]
    assert tl.start["norm"] == pytest.approx(tl.end[backward_end])
    assert tl.start["optimizer"] == pytest.approx(max(tl.end[last_ar], tl.end["norm"]))
    assert tl.end[last_ar] > tl.end["norm"]


def test_a_long_alone_call_delays_the_pipelined_optimizer():
    """An alone call longer than the last gradients' all-reduce ends the step after it."""
    c = _costs(2, alone_s=5.0)
    g, tl = run_pipelined(c, degree=2, overlap=False, chunk_bytes=None)
    backward_end = [k for k, _ in _lane(g, "compute") if k != "optimizer"][-1]
    assert tl.start["optimizer"] == pytest.approx(tl.end[backward_end] + 5.0, rel=1e-6)


def test_one_rank_has_no_collectives_to_check():
    g, _ = run_pipelined(_costs(1, R=1), degree=1, overlap=False, chunk_bytes=None, early=False)
    keys = {t.key for t in g.tasks()}
    assert "optimizer" in keys and "norm" not in keys
