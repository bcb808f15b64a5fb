"""One process group per distinct (rank set, lane), whatever the number of MoE layers.

NCCL spends hundreds of MB of device memory per communicator, so a group per layer does not
fit a 32-layer model. For every strategy (and the pipelined schedules, whose pool adds the
``grad`` and ``rows`` lanes) a fresh world builds an ``MoEGPT`` with 2 MoE layers and runs one
training step (forward, backward, gradient reduction, update: some groups are made lazily, the
pool's on its first step), then another fresh world does the same with 8 MoE layers. Both
counts must be equal:

* ``registry().created``: the groups made through ``moesaic.comm.groups`` (every rank makes
  every group, so this is the world's count);
* ``len(pg_map)``: torch's own table of this rank's groups (the default group and those it is
  a member of), which also sees a group made outside the registry.

Every group in torch's table is the default group or one of the registry's, and the counts
are those of the distinct (rank set, lane) pairs each case uses (``CASES``, which also gives the
counts before the registry).

The fresh worlds are re-initialised inside one spawned world (destroy, then a new file://
rendezvous), so that the cases cost no process start each.
"""

from __future__ import annotations

import datetime
import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moesaic.comm.world import run_world
from moesaic.models import MoEGPT, MoEGPTConfig
from moesaic.schedule import make_step, schedule_names
from moesaic.schedule.base import StepParts
from moesaic.strategies import strategy_names

LAYERS = (2, 8)
B, T = 2, 8
# (world size, schedule, strategy, EP size, domain sizes) -> (groups the registry made in the
# world, torch's groups on each rank including the default one), for 2 and for 8 MoE layers.
# Before the registry (commit 568dad6), per rank for 2 -> 8 layers: hybrid 7 -> 19 at EP 2
# (a level group and its prefetch clone per layer) and 9 -> 27 at EP 4 with domains of 2 (+ the
# offset group), taskflow 5 -> 11 (a put channel group per layer); the others did not grow.
CASES = {
    # the EP group is the world's ranks in the main lane (a group of its own, not the default
    # group: see comm/groups.py); DP groups of one rank are not made
    (2, "vanilla", "dropless", 2, None): (1, 2),
    (2, "vanilla", "padded", 2, None): (1, 2),
    # one domain of 2: its level group is the EP group {0, 1} (main); offset groups of one
    # rank; no prefetch lane without a prefetcher (PREFETCHED: with one; before issue 49 item
    # 7 the lane was made with the layer, 2 and 3 here)
    (2, "vanilla", "hybrid", 2, None): (1, 2),
    (2, "vanilla", "taskflow", 2, None): (2, 3),  # {0, 1} in the main and puts lanes
    (2, "moe-only", "dropless", 2, None): (3, 4),  # {0, 1} in the main, grad and rows lanes
    (2, "flowmoe", "dropless", 2, None): (3, 4),
    (2, "flowmoe", "padded", 2, None): (3, 4),
    # EP {0..3}, levels {0, 1}, {2, 3} in the main lane; offset groups {0, 2}, {1, 3} (with
    # the prefetch lane made eagerly before issue 49 item 7: 7 and 5)
    (4, "vanilla", "hybrid", 4, (2,)): (5, 4),
    # main: EP {0, 1}, {2, 3} and DP {0, 2}, {1, 3}; grad: the DP groups and the world;
    # rows: the EP groups
    (4, "flowmoe", "dropless", 2, None): (9, 6),
    (4, "vanilla", "taskflow", 4, None): (2, 3),  # the world's ranks in the main and puts lanes
    # main: EP {0, 1}, {2, 3} and DP {0, 2}, {1, 3}; puts: the EP groups
    (4, "vanilla", "taskflow", 2, None): (6, 4),
}
# The same with hybrid's prefetcher attached to the optimizer: its first prefetch (after the
# step) makes the level groups in the prefetch lane, once for all layers.
PREFETCHED = {
    (2, "vanilla", "hybrid", 2, None): (2, 3),  # + {0, 1} in the prefetch lane
    (4, "vanilla", "hybrid", 4, (2,)): (7, 5),  # + {0, 1}, {2, 3} in the prefetch lane
}


def _config(strategy: str, domain_sizes: tuple[int, ...] | None, layers: int) -> MoEGPTConfig:
    moe = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16, "dispatcher": strategy}
    if domain_sizes is not None:  # hybrid's option
        moe["options"] = {"domain_sizes": domain_sizes}
    return MoEGPTConfig.from_dict(
        {"d_model": 16, "n_layers": layers, "n_heads": 2, "seq_len": T, "moe": moe}
    )


def _lm_loss(logits_BTV, y_BT):
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())


def _fresh_world(rank: int, world_size: int, path: str) -> None:
    """Replace this process's world with a new one (every rank, the same ``path``)."""
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )


def _groups_after_one_step(
    schedule, strategy, ep, domains, layers, prefetch=False
) -> dict[str, int]:
    from moesaic.comm.groups import registry
    from moesaic.strategies.prefetch import ExpertPrefetcher
    from moesaic.train.parallel import GradientSync, build_layout

    layout = build_layout(ep, 60.0)
    torch.manual_seed(0)
    model = MoEGPT(_config(strategy, domains, layers), ep_group=layout.ep_group)
    parts = StepParts(
        model=model,
        loss_fn=_lm_loss,
        grad_sync=GradientSync(layout),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        pipeline_degree=1 if schedule == "vanilla" else 2,
        ar_chunk_bytes=4096,
    )
    step = make_step(schedule, parts)
    prefetcher = ExpertPrefetcher(model).attach(parts.optimizer) if prefetch else None
    x_BT = torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(layout.rank))
    assert step.run(x_BT[:, :-1], x_BT[:, 1:]).applied
    if prefetcher is not None:
        prefetcher.wait()
        prefetcher.close()
    if hasattr(step, "close"):
        step.close()
    reg = registry()
    pg_map = dist.distributed_c10d._world.pg_map
    # the registry's table (it has no public iterator); non-members hold a placeholder
    mine = {pg for pg in reg._groups.values() if pg is not dist.GroupMember.NON_GROUP_MEMBER}
    return {
        "registry": reg.created,
        "pg_map": len(pg_map),
        "outside": sum(pg is not dist.group.WORLD and pg not in mine for pg in pg_map),
    }


def _puts_lane_before_and_after_a_step() -> tuple[int, int]:
    """Groups in the puts lane once a taskflow layer is built, and after its first step."""
    from moesaic import MoEConfig, MoELayer
    from moesaic.comm.groups import registry

    def puts() -> int:
        return sum(lane == "puts" for _ranks, lane in registry()._groups)

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=16, num_experts=4, dispatcher="taskflow")
    layer = MoELayer(cfg)
    before = puts()
    layer(torch.randn(6, 16)).sum().backward()
    return before, puts()


def _world(rank, world_size, rdv_dir):
    out, k = {}, 0
    if world_size == 2:
        _fresh_world(rank, world_size, os.path.join(rdv_dir, "world2-puts"))
        out["puts"] = _puts_lane_before_and_after_a_step()
    runs = [(c, False) for c in CASES] + [(c, True) for c in PREFETCHED]
    for case, prefetch in (r for r in runs if r[0][0] == world_size):
        for layers in LAYERS:
            _fresh_world(rank, world_size, os.path.join(rdv_dir, f"world{world_size}-{k}"))
            k += 1
            out[case, layers, prefetch] = _groups_after_one_step(*case[1:], layers, prefetch)
    return out


@functools.cache
def _results(world_size: int, rdv_dir: str) -> list[dict]:
    return run_world(_world, world_size, rdv_dir, timeout_s=300.0)


@pytest.fixture(scope="module")
def rdv_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("rdv"))


def test_every_strategy_and_schedule_is_counted():
    assert {c[2] for c in CASES} == set(strategy_names())
    assert {c[1] for c in CASES} == set(schedule_names())


@pytest.mark.parametrize("case", list(CASES), ids=["-".join(map(str, c[:4])) for c in CASES])
def test_same_groups_for_2_and_8_layers(case, rdv_dir):
    """The same groups after one step with 2 and with 8 MoE layers, all of them the
    registry's, as many as the distinct (rank set, lane) pairs the case uses."""
    made, on_rank = CASES[case]
    for rank, r in enumerate(_results(case[0], rdv_dir)):
        two, eight = r[case, 2, False], r[case, 8, False]
        assert two == eight, (rank, two, eight)
        assert two["outside"] == 0, (rank, two)
        assert (two["registry"], two["pg_map"]) == (made, on_rank), (rank, two)


@pytest.mark.parametrize(
    "case", list(PREFETCHED), ids=["-".join(map(str, c[:4])) for c in PREFETCHED]
)
def test_the_prefetch_lane_is_made_by_the_first_prefetch(case, rdv_dir):
    """Communicators per rank are made where something uses them (issue 49 item 7): hybrid's
    prefetch lane by its first prefetch, once for every layer."""
    made, on_rank = PREFETCHED[case]
    for rank, r in enumerate(_results(case[0], rdv_dir)):
        two, eight = r[case, 2, True], r[case, 8, True]
        assert two == eight, (rank, two, eight)
        assert (two["registry"], two["pg_map"]) == (made, on_rank), (rank, two)


def test_the_puts_lane_is_made_by_the_first_step_that_puts(rdv_dir):
    """taskflow's gloo put channel (and its lane) comes with the first step that puts, not with
    the layer: a run on symmetric memory, or one never stepped, holds none."""
    for r in _results(2, rdv_dir):
        assert r["puts"] == (0, 1)
