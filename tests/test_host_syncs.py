"""Host syncs: the counter itself, and the budget of one MoE layer step per strategy (issue 21).

A host sync is an operation after which the host waits for the device (a value read on the
host, an output shape that depends on the data, a copy to the CPU, a blocking copy to the
device). On a GPU each one stalls the pipeline, so a layer step must issue few, and the budget
tests below count them on CPU with ``moesaic.testing.HostSyncCounter``: each rank of a spawned
gloo world counts its own, over the forward and backward of one layer step (after a first step,
which runs the one-time rank agreement, grouped-matmul probe and plan compilation).

Budgets per layer forward + backward at EP 2 and 4:

* dropless: 1, the split exchange. The split sizes size the row all-to-all, so the host must
  read them: the send counts and the received counts go into one ``tolist`` after the count
  all-to-all; everything else (N, M, rows per expert) is a sum of those, the regroup
  permutation and grouped-matmul offsets are built on the device, and the backward reuses the
  forward's splits. (Issue 21 allows 2.)
* padded on the path a GPU runs (the experts compute on the whole buffer): 0 with a capacity,
  every shape is static; 1 without, where C is the group's largest expert load (one all-reduce
  MAX whose result sizes the buffer, so the host must read it).
* padded on the CPU's default path (``skip_padding``: compute only the filled rows): one more
  read, which rows are filled. Free without a device, so the CPU keeps its faster path.
* hybrid: 1, the split read of the dropless exchange it runs over its offset group; its expert
  gathers move weights of static shapes and read nothing.
* taskflow: 19 (measured; the runtime is not this change's): per forward the shape bucket (4
  reads of the all-reduced max load and token count, ``taskflow/runtime/concurrent.py``), the
  step's routing tables on the host (7 in ``sequential.step_routing``: worst load, the
  expert of each row, splits, dropped mask) and the statistics' send counts (1,
  ``strategies/taskflow.py``), and the backward recomputes the step's routing (7 more).
  Another 10 copies to the CPU (``.cpu()`` of counts, order, weights twice and kept mask in
  each ``step_routing``) are invisible on a CPU, and the executor threads' work is not counted
  (another thread).
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

import moesaic
from moesaic.experts import GroupCounts, group_offsets
from moesaic.routing import build_plan, count_ids
from moesaic.strategies.dropless import _regroup
from moesaic.testing import HostSyncCounter, run_world

# ---- the counter ------------------------------------------------------------------------------

x6 = torch.arange(6)
mask6 = x6 > 2
floats = torch.randn(6)

# (what, the operation, the kind it must count as): each counted exactly once
SYNCS = [
    ("item", lambda: x6.sum().item(), "read"),
    ("int()", lambda: int(x6[0]), "read"),
    ("bool()", lambda: bool(x6[0]), "read"),
    ("float()", lambda: float(floats[0]), "read"),
    ("tolist", lambda: x6.tolist(), "read"),
    ("torch.equal", lambda: torch.equal(x6, x6), "read"),
    ("nonzero", lambda: torch.nonzero(mask6), "shape"),
    ("where(mask)", lambda: torch.where(mask6), "shape"),
    ("masked_select", lambda: x6.masked_select(mask6), "shape"),
    ("bool-mask index", lambda: x6[mask6], "shape"),
    ("bool-mask assign", lambda: x6.clone().__setitem__(mask6, 0), "shape"),
    ("unique", lambda: torch.unique(x6), "shape"),
    ("bincount", lambda: torch.bincount(x6), "shape"),
    ("repeat_interleave", lambda: torch.arange(3).repeat_interleave(x6[:3]), "shape"),
    ("copy to a device", lambda: x6.to("meta"), "to_device"),
    ("torch.tensor(list, device)", lambda: torch.tensor([1, 2], device="meta"), "to_device"),
    ("torch.as_tensor(list, device)", lambda: torch.as_tensor([1, 2], device="meta"), "to_device"),
]
# Sync-free: static shapes, no reads (nonzero_static has its size given; repeat_interleave its
# output_size; .cpu() of a CPU tensor is a no-op; a non-blocking copy does not wait).
FREE = [
    ("matmul", lambda: floats[:4].view(2, 2) @ floats[:4].view(2, 2)),
    ("sort", lambda: torch.sort(x6, stable=True)),
    ("topk", lambda: torch.topk(floats, 2)),
    ("cumsum", lambda: x6.cumsum(0)),
    ("scatter_add", lambda: torch.zeros(6, dtype=torch.long).scatter_add_(0, x6, x6)),
    ("long index", lambda: x6[x6.flip(0)]),
    ("where(mask, a, b)", lambda: torch.where(mask6, x6, 0)),
    ("nonzero_static", lambda: torch.nonzero_static(mask6, size=3)),
    ("repeat_interleave(output_size)", lambda: x6[:3].repeat_interleave(x6[:3], output_size=3)),
    (".cpu() on the CPU", lambda: x6.cpu()),
    ("non-blocking copy", lambda: x6.to("meta", non_blocking=True)),
    ("torch.tensor(list)", lambda: torch.tensor([1, 2])),
]


@pytest.mark.parametrize(("what", "op", "kind"), SYNCS, ids=[s[0] for s in SYNCS])
def test_each_kind_of_sync_is_counted_once(what, op, kind):
    with HostSyncCounter() as syncs:
        op()
    assert [e.kind for e in syncs.events] == [kind], syncs.report()
    assert syncs.events[0].where.startswith(__file__), syncs.events[0]  # the line that did it


@pytest.mark.parametrize(("what", "op"), FREE, ids=[f[0] for f in FREE])
def test_sync_free_ops_are_not_counted(what, op):
    with HostSyncCounter() as syncs:
        op()
    assert syncs.count == 0, syncs.report()


def test_copy_to_the_host_is_counted():
    # On CPU the only other device is meta, which cannot be read: the copy is counted, then fails.
    with HostSyncCounter() as syncs, pytest.raises(NotImplementedError):
        torch.empty(2, device="meta").cpu()
    assert [(e.kind, e.op) for e in syncs.events] == [("to_host", "aten._to_copy")]


def test_strict_constructors_count_host_data_given_any_device():
    """``torch.tensor(list, device=x.device)`` copies to the GPU on a GPU run: counted on CPU
    only when asked (``strict_constructors``), and never for data already a tensor."""
    for strict, want in ((False, 0), (True, 1)):
        with HostSyncCounter(strict_constructors=strict) as syncs:
            torch.tensor([1, 2], device=x6.device)
            torch.as_tensor(x6, device=x6.device)
        assert syncs.count == want, syncs.report()


def test_backward_syncs_name_their_autograd_node():
    x = torch.randn(6, requires_grad=True)
    with HostSyncCounter() as syncs:
        x[mask6].sum().backward()
    assert [(e.op, e.backward) for e in syncs.events] == [
        ("aten.index", None),
        ("aten.index_put", "IndexBackward0"),
    ]


def test_report_names_the_moesaic_line():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1]])
    plan = build_plan(ids, torch.ones(3, 2), 4, capacity=2)  # N is data-dependent: not read
    with HostSyncCounter() as syncs:
        plan.order_N  # noqa: B018 (the read is the point)
    event = syncs.events[0]
    assert event.op == "aten._local_scalar_dense" and "moesaic/routing.py:" in event.where
    assert event.where.endswith(" order_N")
    with pytest.raises(AssertionError, match=r"1 host syncs, budget 0:\n1 x .*routing.py"):
        syncs.check(at_most=0, what="order_N")
    syncs.check(at_most=1)


def test_only_the_entering_thread_is_counted_and_patches_are_undone():
    original = torch.Tensor.tolist
    seen = []
    with HostSyncCounter() as outer, HostSyncCounter() as inner:
        worker = threading.Thread(target=lambda: seen.append((x6.tolist(), x6.sum().item())))
        worker.start()
        worker.join()
        x6.tolist()
    assert seen and outer.count == inner.count == 1  # nested counters both count
    assert torch.Tensor.tolist is original and "tolist" not in torch.Tensor.__dict__
    with HostSyncCounter() as again:
        x6.tolist()
    assert again.count == 1


# ---- the sync-free replacements equal what they replace -----------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_count_ids_equals_bincount(seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 7, (40,), generator=gen)
    mask = torch.rand(40, generator=gen) < 0.6
    assert torch.equal(count_ids(ids, 9), torch.bincount(ids, minlength=9))
    assert torch.equal(count_ids(ids, 9, mask), torch.bincount(ids[mask], minlength=9))


# received rows per (source rank, local expert): empty segments, an empty source, nothing at all
REGROUP_COUNTS = [[[2, 0, 3], [1, 4, 0]], [[0, 0, 0], [3, 1, 2]], [[0, 0], [0, 0]], [[5, 1]]]


@pytest.mark.parametrize("counts", REGROUP_COUNTS)
def test_regroup_equals_the_stable_sort_of_segment_keys(counts):
    """The device permutation of dropless equals the host sort it replaced, exactly."""
    recv_Pe = torch.tensor(counts)
    P, e = recv_Pe.shape
    seg_keys = torch.arange(e).repeat(P) * P + torch.arange(P).repeat_interleave(e)
    want = torch.sort(seg_keys.repeat_interleave(recv_Pe.reshape(-1)), stable=True).indices
    M = int(recv_Pe.sum())  # dropless has it from the host splits
    with HostSyncCounter() as syncs:
        regroup_M, inverse_M = _regroup(recv_Pe, M)
    assert syncs.count == 0, syncs.report()
    assert torch.equal(regroup_M, want)
    assert torch.equal(inverse_M[regroup_M], torch.arange(regroup_M.numel()))


def test_group_offsets_from_the_device_counts_equal_the_lists():
    counts = GroupCounts([5, 0, 8], torch.tensor([5, 0, 8]))
    with HostSyncCounter(strict_constructors=True) as syncs:
        offs = group_offsets(counts, torch.device("cpu"))
    assert syncs.count == 0, syncs.report()
    assert torch.equal(offs, group_offsets([5, 0, 8], torch.device("cpu")))
    assert offs.dtype == torch.int32 and offs.tolist() == [5, 5, 13]


# ---- the layer's budget -------------------------------------------------------------------------

H, F, E = 16, 24, 8
# (name, MoEConfig overrides, run padded on the GPU's path (no skip_padding), budget at EP 2, 4)
CASES = [
    ("dropless", {}, False, 1),
    ("dropless capacity", {"capacity_factor": 0.75}, False, 1),
    ("padded capacity", {"dispatcher": "padded", "capacity_factor": 0.75}, True, 0),
    ("padded", {"dispatcher": "padded"}, True, 1),
    ("padded capacity (CPU path)", {"dispatcher": "padded", "capacity_factor": 0.75}, False, 1),
    ("padded (CPU path)", {"dispatcher": "padded"}, False, 2),
    ("hybrid", {"dispatcher": "hybrid", "options": {"domain_sizes": (2,)}}, False, 1),
    ("taskflow", {"dispatcher": "taskflow"}, False, 19),
]


def _step(layer: moesaic.MoELayer, x: torch.Tensor, g: torch.Tensor) -> None:
    x = x.clone().requires_grad_()
    y = layer(x)
    ((y * g).sum() + moesaic.aux_loss(layer)).backward()


def budget_worker(rank: int, world: int) -> dict[tuple[str, int], tuple[int, str]]:
    """Each case's host syncs on this rank over one counted step, with this rank's tokens:
    ``{(name, tokens): (count, report)}``. Rank 1 has no tokens in the second counted step of
    each case without a capacity (it must still take part alike; with a capacity the ranks
    need equal batches: ``padded`` sizes its buffers by the local capacity)."""
    torch.set_num_threads(1)
    out = {}
    for name, overrides, device_path, _ in CASES:
        cfg = moesaic.MoEConfig(
            hidden_size=H, ffn_hidden_size=F, num_experts=E, init_std=0.5, **overrides
        )
        torch.manual_seed(0)
        layer = moesaic.MoELayer(cfg)
        if device_path:
            layer.strategy.skip_padding = False  # the GPU path: compute on the whole buffer
        opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        empty = rank == 1 and "capacity_factor" not in overrides
        for tokens in (12, 0 if empty else 12):
            x, g = torch.randn(tokens, H, generator=gen), torch.randn(tokens, H, generator=gen)
            _step(layer, x, g)  # first: agreement, probes, plans; then (new weights) counted
            opt.step()
            opt.zero_grad()
            with HostSyncCounter() as syncs:
                _step(layer, x, g)
            out[name, tokens] = (syncs.count, syncs.report())
    return out


# ---- a whole training step: forward, backward, gradient sync, norm, flags, clip, optimizer --

TRAIN_BLOCKS, TRAIN_STEPS, TRAIN_COUNTED = 2, 7, 5
# what the world's control plane carries per step (told apart from the EP group's own
# collectives of EP = world by what they carry)
CONTROL = ("health flags", "gradient norm")


def train_step_worker(rank: int, world: int) -> dict[str, dict]:
    """Host syncs of the last of ``TRAIN_STEPS`` whole training steps (dropless, EP 2, AdamW as
    a GPU run builds it: ``make_adamw``, fused), and the control-plane collectives per step
    over the last ``TRAIN_COUNTED`` (flowmoe with Sp tuned online)."""
    from moesaic.comm.collectives import record_collectives
    from moesaic.models import MoEGPT, MoEGPTConfig
    from moesaic.schedule import make_step
    from moesaic.schedule.base import StepParts
    from moesaic.train.loop import _step_statistics, make_adamw
    from moesaic.train.parallel import GradientSync, build_layout

    torch.set_num_threads(1)
    layout = build_layout(world, 60.0)
    out = {}
    for schedule, R in (("vanilla", 1), ("flowmoe", 2)):
        moe = {"ffn_hidden_size": 24, "num_experts": 4, "top_k": 2}
        model_cfg = {"vocab_size": 64, "d_model": 16, "n_layers": TRAIN_BLOCKS, "n_heads": 2}
        torch.manual_seed(0)
        model = MoEGPT(MoEGPTConfig.from_dict({**model_cfg, "seq_len": 8, "moe": moe}))
        parts = StepParts(
            model=model,
            loss_fn=lambda logits, y: torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), y.flatten()
            ),
            grad_sync=GradientSync(layout),
            optimizer=make_adamw(model.parameters(), lr=1e-3, device=torch.device("cuda")),
            pipeline_degree=R,
            ar_chunk_bytes=None if schedule == "flowmoe" else 1024,  # flowmoe: tuned online
            grad_clip=1e-3,  # always clips: the clipping's cost is counted too
            statistics=_step_statistics(model, "cpu"),  # the loop's loss, aux and loads
        )
        step = make_step(schedule, parts)
        gen = torch.Generator().manual_seed(rank)
        control = 0
        for s in range(TRAIN_STEPS):
            x_BT = torch.randint(0, 64, (4, 9), generator=gen)
            with record_collectives() as log, HostSyncCounter() as syncs:
                result = step.run(x_BT[:, :-1], x_BT[:, 1:])
            assert result.applied and len(result.statistics) == 2 + TRAIN_BLOCKS * 4
            if s >= TRAIN_STEPS - TRAIN_COUNTED:
                control += sum(1 for *_, what in log if any(c in what for c in CONTROL))
        if hasattr(step, "close"):
            step.close()
        out[schedule] = {
            "syncs": syncs.count,
            "report": syncs.report(),
            "control": control / TRAIN_COUNTED,
            "R": R,
        }
    return out


def _two_rank_worker(rank: int, world: int) -> dict:
    return {
        "budget": budget_worker(rank, world),
        "flowmoe": flowmoe_worker(rank, world),
        "train": train_step_worker(rank, world),
    }


@functools.cache
def _world_of_2() -> list[dict]:
    """The layer budget and the FlowMoE checks at EP 2, one after the other in one spawned
    world (a spawn costs seconds on 2 cores; every counted step follows a warm-up step)."""
    return run_world(_two_rank_worker, 2, timeout_s=240)


@pytest.mark.parametrize("world", [2, 4])
def test_layer_step_host_sync_budget(world):
    if world == 2:
        per_rank = [r["budget"] for r in _world_of_2()]
    else:
        per_rank = run_world(budget_worker, world, timeout_s=240)
    budgets = {name: budget for name, _, _, budget in CASES}
    failures = [
        f"EP {world} rank {rank} {name} ({tokens} tokens): {count} host syncs, budget "
        f"{budgets[name]}:\n{report}"
        for rank, result in enumerate(per_rank)
        for (name, tokens), (count, report) in result.items()
        if count > budgets[name]
    ]
    assert not failures, "\n".join(failures)


# ---- FlowMoE: R chunks, each a layer's forward and backward -------------------------------------

FLOW_BLOCKS, FLOW_R = 2, (2, 4)
FLOW_CASES = [("dropless", {}, 1), ("padded capacity", {"dispatcher": "padded"}, 0)]


def flowmoe_worker(rank: int, world: int) -> dict[tuple[str, int], tuple[int, str]]:
    """Host syncs of the FlowMoE block pipeline (forward and backward of every block and chunk,
    gradient hooks and the pool's chunks issued in the gaps) in the second step, when the pool
    reduces during the backward. The pool's ``finish`` and the step's end (the global norm and
    health flags, read once per step) are outside the counter."""
    from moesaic.models import MoEGPT, MoEGPTConfig
    from moesaic.schedule.base import StepParts
    from moesaic.schedule.flowmoe import FlowMoEStep
    from moesaic.train.parallel import GradientSync, build_layout

    torch.set_num_threads(1)
    layout = build_layout(world, 60.0)
    out = {}
    for name, overrides, _ in FLOW_CASES:
        for R in FLOW_R:
            moe = {"ffn_hidden_size": 24, "num_experts": 4, "top_k": 2, **overrides}
            if overrides:
                moe["capacity_factor"] = 2.0
            model_cfg = {"vocab_size": 64, "d_model": 16, "n_layers": FLOW_BLOCKS, "n_heads": 2}
            cfg = MoEGPTConfig.from_dict({**model_cfg, "seq_len": 8, "moe": moe})
            torch.manual_seed(0)
            model = MoEGPT(cfg, ep_group=layout.ep_group)
            for block in model.blocks:
                if hasattr(block.moe.strategy, "skip_padding"):
                    block.moe.strategy.skip_padding = False  # padded: the GPU's path
            parts = StepParts(
                model=model,
                loss_fn=lambda logits, y: torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), y.flatten()
                ),
                grad_sync=GradientSync(layout),
                optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                pipeline_degree=R,
                ar_chunk_bytes=1024,
            )
            step = FlowMoEStep(parts)
            gen = torch.Generator().manual_seed(rank)
            x_BT = torch.randint(0, 64, (4, 9), generator=gen)
            step.run(x_BT[:, :-1], x_BT[:, 1:])  # learns hook counts, builds the pool
            pool = step.pool
            pool.begin_step()
            with HostSyncCounter() as syncs:
                step.pipeline.run(x_BT[:, :-1], x_BT[:, 1:], parts.loss_fn, pool)
            pool.finish()
            parts.optimizer.zero_grad()
            step.close()
            out[name, R] = (syncs.count, syncs.report())
    return out


def test_flowmoe_host_syncs_are_r_times_the_strategy_budget():
    """FlowMoE runs each block's layer once per chunk: at most R x blocks x the strategy's budget
    per layer (dropless 1, padded with a capacity 0); the pipeline and the pool add none."""
    per_rank = [r["flowmoe"] for r in _world_of_2()]
    budgets = {name: budget for name, _, budget in FLOW_CASES}
    failures = [
        f"rank {rank} {name} R={R}: {count} host syncs, budget "
        f"{R * FLOW_BLOCKS * budgets[name]}:\n{report}"
        for rank, result in enumerate(per_rank)
        for (name, R), (count, report) in result.items()
        if count > R * FLOW_BLOCKS * budgets[name]
    ]
    assert not failures, "\n".join(failures)
    # not vacuous: dropless reads its splits once per chunk and block (measured: 4 at R = 2)
    assert per_rank[0]["dropless", 2][0] == 2 * FLOW_BLOCKS


def test_dropless_at_ep1_reads_nothing_on_the_host():
    """One rank, nothing dropped: no split sizes to read, the experts take their counts on the
    device (``DeviceCounts``), so a dropless step runs without one host sync (the GPU run of
    issue 27 measured 1-2 per step before, each a stall of the launch queue)."""
    cfg = moesaic.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, init_std=0.5)
    torch.manual_seed(0)
    layer = moesaic.MoELayer(cfg)
    x, g = torch.randn(12, H), torch.randn(12, H)
    _step(layer, x, g)  # first: the grouped-matmul probe
    with HostSyncCounter() as syncs:
        _step(layer, x, g)
    assert syncs.count == 0, syncs.report()


# reads at a training step's end: the global norm and every rank's flags, in one tensor
STEP_END_READS = {"vanilla": 1, "flowmoe": 1}


def test_training_step_host_sync_budget():
    """A whole training step (dropless, EP 2): each MoE layer's budget (1 per layer and chunk)
    plus one read at the step's end, the global norm, every rank's flags and the loop's
    statistics together (``STEP_END_READS``; 2 on 89f6ff4, the norm read apart: that fails
    here); the optimizer (fused AdamW, as on a GPU) and the clipping (one multi-tensor
    multiply) read nothing (on 3bca125 AdamW(foreach=False) read each parameter's step count
    and the flags were read once per flag: 32-37 per step with the loop's statistics in
    ``benchmarks/results/step_budget.json``)."""
    for rank, result in enumerate(r["train"] for r in _world_of_2()):
        for schedule, got in result.items():
            budget = got["R"] * TRAIN_BLOCKS + STEP_END_READS[schedule]
            assert got["syncs"] <= budget, f"rank {rank} {schedule}: {got['report']}"
            assert got["syncs"] >= got["R"] * TRAIN_BLOCKS  # not vacuous: the layers' reads


def test_control_plane_collectives_per_step():
    """The world's control plane per step: each rank's squared norm of its own (expert)
    gradients, its health flags and the training loop's statistics (loss, aux loss, expert
    loads: ``train.loop._step_statistics``) in one all-reduce (1; 89f6ff4: vanilla
    all-reduced the expert norm over the EP group and gathered the flags in the step, and the
    loop all-reduced its statistics after it, 3); flowmoe also agrees the tuner's Sp only
    where it can have changed, once per ``iters_per_sample`` (5) steps (3bca125: every
    step)."""
    from moesaic.schedule.tuner import SpTuner

    per_sample = SpTuner.__init__.__kwdefaults__["iters_per_sample"]
    for result in (r["train"] for r in _world_of_2()):
        assert result["vanilla"]["control"] == 1
        assert result["flowmoe"]["control"] == 1 + 1 / per_sample
