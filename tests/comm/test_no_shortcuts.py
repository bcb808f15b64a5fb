"""A world of one with the single-rank shortcuts off (``MOESAIC_NO_SHORTCUTS=1``) issues every
lane's collectives for real (issue 49 item 2): one GPU then runs the NCCL paths.

A one-rank set used to become ``EPGroup.solo`` (trivial whatever the variable said) and a
one-rank gradient bucket got no staging buffer, so at world size one the ``rows`` lane's
all-to-alls, the pool's ``grad`` chunks and HybridEP's gathers, reduces and ``prefetch`` never
reached a process group. Here two training steps of a hybrid MoEGPT under ``flowmoe`` (R = 2)
with the prefetcher attached are counted per lane at the choke point, and their parameters equal
the same steps with the shortcuts on (a collective of one rank is an identity).

The ``puts`` lane stays unissued at world size one: a taskflow put to the rank itself is a copy,
and the gloo put channel it would use does not run on NCCL anyway.
"""

from __future__ import annotations

import functools
import os
from collections import Counter

import torch
import torch.nn.functional as F

from moesaic.comm.collectives import record_collectives
from moesaic.comm.world import run_world

B, T, STEPS = 4, 8, 2


def _train(layout, batches) -> dict:
    from moesaic.models import MoEGPT, MoEGPTConfig
    from moesaic.schedule.base import StepParts
    from moesaic.schedule.flowmoe import FlowMoEStep
    from moesaic.strategies.prefetch import ExpertPrefetcher
    from moesaic.train.parallel import GradientSync

    config = MoEGPTConfig.from_dict(
        {
            "d_model": 16,
            "n_layers": 2,
            "dense_layers": 0,
            "n_heads": 2,
            "seq_len": T,
            "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16, "dispatcher": "hybrid"},
        }
    )
    torch.manual_seed(0)
    model = MoEGPT(config, ep_group=layout.ep_group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    parts = StepParts(
        model=model,
        loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        grad_sync=GradientSync(layout),
        optimizer=optimizer,
        pipeline_degree=2,
        ar_chunk_bytes=4096,
    )
    lanes: Counter[str] = Counter()
    with ExpertPrefetcher(model).attach(optimizer) as prefetcher:
        step = FlowMoEStep(parts)
        for x_BT in batches:
            with record_collectives() as log:
                assert step.run(x_BT[:, :-1], x_BT[:, 1:]).applied
                prefetcher.wait()
            lanes.update(lane for _, lane, _, _ in log)
        step.close()
    return {
        "lanes": dict(lanes),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _world(rank: int, world: int) -> dict:
    from moesaic.train.parallel import build_layout

    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 256, (B, T + 1), generator=gen) for _ in range(STEPS)]
    out = {}
    for shortcuts in ("on", "off"):
        if shortcuts == "off":
            os.environ["MOESAIC_NO_SHORTCUTS"] = "1"  # read by every group built from here on
        else:
            os.environ.pop("MOESAIC_NO_SHORTCUTS", None)
        out[shortcuts] = _train(build_layout(1, 60.0), batches)
    os.environ.pop("MOESAIC_NO_SHORTCUTS", None)
    return out


@functools.cache
def _results() -> dict:
    (out,) = run_world(_world, 1, timeout_s=300.0)
    return out


def test_every_lane_issues_at_world_size_one_with_the_shortcuts_off():
    lanes = _results()["off"]["lanes"]
    # main: hybrid's gathers and gradient reduces, the token exchange's counts; rows: the
    # pipeline's row all-to-alls; grad: the pool's chunks; prefetch: the gathers after a step
    for lane in ("main", "rows", "grad", "prefetch"):
        assert lanes.get(lane, 0) > 0, f"no collective in lane {lane!r}: {lanes}"


def test_the_shortcuts_skip_them_and_change_nothing_else():
    on, off = _results()["on"], _results()["off"]
    assert sum(on["lanes"].values()) < sum(off["lanes"].values())
    assert on["lanes"].get("prefetch", 0) == 0 and on["lanes"].get("rows", 0) == 0
    for name, p in on["params"].items():
        torch.testing.assert_close(off["params"][name], p, rtol=0, atol=0, msg=name)
