"""FlashDMoE's symmetric layout: Size(L) against Table 6.2, offsets, and write-conflict freedom."""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys

import pytest

from moesaic.taskflow import (
    LayoutWrite,
    PlanRegionError,
    ShapeBucket,
    SymmetricLayout,
    WriteConflictError,
    all_to_all_writes,
    check_write_conflicts,
    compare_layout_memory,
    compile_plan,
    plan_from_dict,
    plan_to_dict,
    symmetric_layout_bytes,
)
from moesaic.taskflow.layout import (
    COMBINE_ROUND,
    DISPATCH_ROUND,
    INCOMING,
    STAGING,
    check_plan_layout,
    expert_capacity,
)

MiB = 2**20

# FlashDMoE (paper 003) Table 6.2, verbatim: tile size bM = 128, Size(T) = Tokens * 4KB.
TABLE_6_2 = """\
Tokens	Experts	EC	max(bM, EC)	Bookkeeping (MB)	Size(L) (MB)	Total (MB)
4K	16	256	256	64.57	64.00	128.57
4K	32	128	128	64.55	64.00	128.55
4K	64	64	128	128.90	128.01	256.91
4K	128	32	128	257.96	256.02	513.98
8K	16	512	512	128.95	128.01	256.95
8K	32	256	256	128.90	128.01	256.91
8K	64	128	128	128.90	128.01	256.91
8K	128	64	128	258.15	256.02	514.17
16K	16	1024	1024	257.89	256.02	513.90
16K	32	512	512	257.79	256.02	513.81
16K	64	256	256	257.80	256.02	513.81
16K	128	128	128	258.53	256.02	514.54"""


def _table_rows():
    rows = []
    for line in TABLE_6_2.splitlines()[1:]:
        tokens, experts, ec, aligned, _book, size_l, _total = line.split("\t")
        rows.append((int(tokens[:-1]) * 1024, int(experts), int(ec), int(aligned), size_l))
    return rows


@pytest.mark.parametrize("tokens, experts, ec, aligned, size_l", _table_rows())
def test_size_reproduces_table_6_2(tokens, experts, ec, aligned, size_l):
    # H x dtype = 4 KB per token: H = 1024 in fp32 (FlashDMoE runs in fp32, §6.1)
    assert expert_capacity(tokens, experts) == ec
    layout = SymmetricLayout(world_size=8, local_experts=experts // 8, capacity=ec,
                             hidden_size=1024, dtype_bytes=4)  # fmt: skip
    assert layout.aligned_capacity == aligned
    assert f"{symmetric_layout_bytes(tokens, experts, 1024, 4) / MiB:.2f}" == size_l
    assert layout.total_bytes == symmetric_layout_bytes(tokens, experts, 1024, 4)
    # the payload alone is §5.4's case formula exactly: 4 Size(T), inflated by bM*E/S when
    # S/E < bM
    size_t = tokens * 4096
    inflate = max(1, 128 * experts // tokens)
    assert symmetric_layout_bytes(tokens, experts, 1024, 4, signal_bytes=0) == 4 * size_t * inflate


def test_the_table_needs_the_signals_and_their_tile_width():
    # without the signals (or with another tile width) some rows of the table come out wrong,
    # so the test above checks the reading, not only the payload
    def matches(**kw):
        return all(
            f"{symmetric_layout_bytes(t, e, 1024, 4, **kw) / MiB:.2f}" == s
            for t, e, _, _, s in _table_rows()
        )

    assert matches()
    assert not matches(signal_bytes=0)
    assert not matches(tile_n=128)
    assert not matches(tile_n=32)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        # non-power-of-two capacity 125 aligns up to 128; H = 1000 -> ceil(1000/64) = 16 tiles
        (dict(tokens=1000, num_experts=8, hidden_size=1000, dtype_bytes=2),
         4 * 8 * 128 * 1000 * 2 + (8 + 8 * 1 * 16) * 8),
        # top-2, capacity factor 1.25: C = ceil(1.25*4096*2/64) = 160 -> two tiles, 256 rows
        (dict(tokens=4096, num_experts=64, hidden_size=2048, dtype_bytes=2, top_k=2,
              capacity_factor=1.25),
         4 * 64 * 256 * 2048 * 2 + (64 + 64 * 2 * 32) * 8),
        # T = 1: one token still costs a whole aligned tile per cell
        (dict(tokens=1, num_experts=4, hidden_size=8, dtype_bytes=4),
         4 * 4 * 128 * 8 * 4 + (4 + 4 * 1 * 1) * 8),
        # explicit capacity (a taskflow bucket's slot rows) with a small tile
        (dict(tokens=99, num_experts=8, hidden_size=8, dtype_bytes=4, tile_m=2, capacity=4),
         4 * 8 * 4 * 8 * 4 + (8 + 8 * 2 * 1) * 8),
        # prime E, payload only
        (dict(tokens=700, num_experts=7, hidden_size=64, dtype_bytes=4, signal_bytes=0),
         4 * 7 * 128 * 64 * 4),
        # three rounds, one buffer per round
        (dict(tokens=256, num_experts=2, hidden_size=64, dtype_bytes=2, rounds=3, buffers=1),
         3 * 1 * 2 * 128 * 64 * 2 + (2 + 2 * 1 * 1) * 8),
    ],
)  # fmt: skip
def test_size_of_other_shapes(kwargs, expected):
    assert symmetric_layout_bytes(**kwargs) == expected


def test_size_does_not_depend_on_the_split_over_ranks():
    sizes = {
        SymmetricLayout(world_size=p, local_experts=64 // p, capacity=100, hidden_size=96,
                        dtype_bytes=2).total_bytes
        for p in (1, 2, 4, 8, 16, 64)
    }  # fmt: skip
    assert sizes == {symmetric_layout_bytes(1, 64, 96, 2, capacity=100)}


def test_offsets_tile_the_payload_exactly_once():
    lay = SymmetricLayout(world_size=3, local_experts=2, capacity=3, hidden_size=5,
                          dtype_bytes=2, tile_m=2)  # fmt: skip
    assert lay.aligned_capacity == 4 and lay.row_bytes == 10 and lay.cells == 3 * 2 * 2 * 2
    coords = itertools.product(range(3), range(2), range(2), range(2), range(4))
    offsets = [lay.offset(*c) for c in coords]
    # row-major over (peer, round, buffer, expert, slot): every row once, in order
    assert offsets == list(range(0, lay.payload_bytes, lay.row_bytes))
    assert lay.offset(2, 1, 1, 1, 3) == lay.payload_bytes - lay.row_bytes
    assert lay.offset(1, 0, 1, 0, 2) == ((((1 * 2 + 0) * 2 + 1) * 2 + 0) * 4 + 2) * 10
    assert lay.region(1, 0, 1, 0, 2, rows=2) == (
        lay.offset(1, 0, 1, 0, 2),
        lay.offset(1, 0, 1, 1, 0),
    )


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("world_size", 0, r"world_size \(0\) must be > 0"),
        ("local_experts", -1, r"local_experts \(-1\) must be > 0"),
        ("capacity", 2.5, "capacity must be an int"),
        ("hidden_size", True, "hidden_size must be an int, got bool"),
        ("dtype_bytes", 0, r"dtype_bytes \(0\) must be > 0"),
        ("tile_m", 0, r"tile_m \(0\) must be > 0"),
        ("rounds", 0, r"rounds \(0\) must be > 0"),
        ("buffers", "2", "buffers must be an int"),
        ("tile_n", 0, r"tile_n \(0\) must be > 0"),
        ("signal_bytes", -8, r"signal_bytes \(-8\) must be >= 0"),
    ],
)
def test_layout_fields_are_validated(field, value, match):
    kw = dict(world_size=2, local_experts=2, capacity=4, hidden_size=8, dtype_bytes=4)
    kw[field] = value
    with pytest.raises(ValueError, match=match):
        SymmetricLayout(**kw)


def test_bad_coordinates_name_the_field():
    lay = SymmetricLayout(world_size=2, local_experts=2, capacity=4, hidden_size=8,
                          dtype_bytes=4, tile_m=4)  # fmt: skip
    with pytest.raises(ValueError, match=r"peer \(2\) must be <= 1"):
        lay.offset(2, 0, 0, 0, 0)
    with pytest.raises(ValueError, match=r"round \(-1\) must be >= 0"):
        lay.offset(0, -1, 0, 0, 0)
    with pytest.raises(ValueError, match=r"slot \(4\) must be <= 3"):
        lay.offset(0, 0, 0, 0, 4)
    with pytest.raises(ValueError, match="may not leave its cell"):
        lay.region(0, 0, 0, 0, slot=3, rows=2)
    with pytest.raises(ValueError, match="writer must be a non-empty str"):
        LayoutWrite(writer="", source=0, target=0, peer=0, round=0, buffer=0, expert=0)
    with pytest.raises(ValueError, match=r"rows \(0\) must be > 0"):
        LayoutWrite(writer="w", source=0, target=0, peer=0, round=0, buffer=0, expert=0, rows=0)
    with pytest.raises(ValueError, match=r"target \(5\) must be <= 1"):
        check_write_conflicts(lay, [LayoutWrite(writer="w", source=0, target=5, peer=0,
                                                round=0, buffer=1, expert=0)])  # fmt: skip


# -- write-conflict freedom -------------------------------------------------------------------

LAY = SymmetricLayout(world_size=3, local_experts=2, capacity=4, hidden_size=8, dtype_bytes=2,
                      tile_m=2)  # fmt: skip


@pytest.mark.parametrize("tile_rows", [None, 1, 2, 3])
def test_all_to_all_write_set_is_conflict_free_and_covers_l(tile_rows):
    writes = list(all_to_all_writes(LAY, tile_rows))
    covered = check_write_conflicts(LAY, writes)
    assert covered == {r: LAY.payload_bytes for r in range(3)}


def test_a_writer_may_rewrite_its_own_bytes():
    w = LayoutWrite(writer="rank 1 dispatch e0", source=1, target=0, peer=1,
                    round=DISPATCH_ROUND, buffer=INCOMING, expert=0, slot=0, rows=2)  # fmt: skip
    assert check_write_conflicts(LAY, [w, w]) == {0: 2 * LAY.row_bytes}


def test_planted_overlapping_write_names_both_writers_and_the_range():
    writes = list(all_to_all_writes(LAY, tile_rows=2))
    # a second task of rank 1 puts into rows 3..3 of the cell rank 1's dispatch tile (rows
    # 2..3) owns: a valid index by Definition 5.3.2, so only the byte sweep can catch it
    planted = LayoutWrite(
        writer="rank 1 extra put",
        source=1,
        target=0,
        peer=1,
        round=DISPATCH_ROUND,
        buffer=INCOMING,
        expert=1,
        slot=3,
        rows=1,
    )
    start, stop = LAY.region(1, DISPATCH_ROUND, INCOMING, 1, slot=3, rows=1)
    with pytest.raises(WriteConflictError) as info:
        check_write_conflicts(LAY, [*writes[:40], planted, *writes[40:]])
    msg = str(info.value)
    assert f"write conflict on rank 0: bytes [{start}, {stop})" in msg
    assert "'rank 1 dispatch e1 rows 2 to rank 0'" in msg and "'rank 1 extra put'" in msg


def test_overlap_with_an_earlier_longer_write_is_caught():
    # A covers rows 0..3, B (another writer) rows 3..3: B overlaps A though a same-writer write
    # of A comes in between
    a1 = LayoutWrite(
        writer="A",
        source=0,
        target=0,
        peer=0,
        round=COMBINE_ROUND,
        buffer=STAGING,
        expert=0,
        slot=0,
        rows=4,
    )
    a2 = LayoutWrite(
        writer="A",
        source=0,
        target=0,
        peer=0,
        round=COMBINE_ROUND,
        buffer=STAGING,
        expert=0,
        slot=1,
        rows=1,
    )
    b = LayoutWrite(writer="B", source=0, target=0, peer=0, round=COMBINE_ROUND,
                    buffer=STAGING, expert=0, slot=3, rows=1)  # fmt: skip
    start, stop = LAY.region(0, COMBINE_ROUND, STAGING, 0, slot=3)
    with pytest.raises(WriteConflictError, match=rf"bytes \[{start}, {stop}\) are written by 'A'"):
        check_write_conflicts(LAY, [b, a2, a1])


@pytest.mark.parametrize(
    "write, rule",
    [
        # rank 2 puts into rank 0's cell of source 1 (no overlap: that cell is free here)
        (dict(source=2, target=0, peer=1, buffer=INCOMING), r"rule 1: a put into buffer 1"),
        # a self-loop put must be indexed by its own rank as well
        (dict(source=0, target=0, peer=1, buffer=INCOMING), r"rule 1: a put into buffer 1"),
        # another rank writing a staging cell
        (dict(source=1, target=0, peer=1, buffer=STAGING), r"rule 2: a staging write"),
    ],
)
def test_definition_5_3_2_violations_are_refused(write, rule):
    w = LayoutWrite(writer="bad", round=COMBINE_ROUND, expert=1, **write)
    assert check_write_conflicts(LAY, [w], rules=False)  # no overlap: the bytes alone are fine
    with pytest.raises(WriteConflictError, match=rf"'bad' .* breaks Definition 5.3.2 {rule}"):
        check_write_conflicts(LAY, [w])


# -- taskflow plans on L: the validator hook ---------------------------------------------------

# P=4, e=2, S=4 slot rows in 2-row tiles
BUCKET = ShapeBucket(tokens=7, hidden=8, ffn=6, experts=8, top_k=2, ep_size=4, slot_rows=4,
                     tile_m=2)  # fmt: skip


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_compiled_plans_are_conflict_free_on_l(direction):
    lay = SymmetricLayout.for_bucket(BUCKET)
    for rank in range(4):
        covered = check_plan_layout(compile_plan(BUCKET, direction, rank))
        # receive cells (round 0 incoming), staging and return cells of round 1: 3/4 of L
        assert covered == {rank: 3 * lay.payload_bytes // 4}


def _remote(d, rank, op, index):
    return next(
        w for w in d["remote_writes"]
        if (w["rank"], w["op"], w["task_index"]) == (rank, op, index)
    )  # fmt: skip


def test_validator_catches_a_planted_overlapping_put():
    d = plan_to_dict(compile_plan(BUCKET, "forward", 1))
    w0, w2 = _remote(d, 0, "dispatch", 4), _remote(d, 2, "dispatch", 4)
    assert w0["regions"] == [["x_recv", 1, 0, 2]] and w2["regions"] == [["x_recv", 1, 8, 10]]
    bad = copy.deepcopy(d)
    _remote(bad, 2, "dispatch", 4)["regions"] = [["x_recv", 1, 1, 3]]  # rows 1..2 of source 0
    lay = SymmetricLayout.for_bucket(BUCKET)
    start, stop = lay.region(0, DISPATCH_ROUND, INCOMING, 0, slot=1, rows=1)
    with pytest.raises(PlanRegionError) as info:
        plan_from_dict(bad)
    msg = str(info.value)
    assert f"write conflict on rank 1: bytes [{start}, {stop})" in msg
    assert "'rank 0 dispatch[4]'" in msg and "'rank 2 dispatch[4]'" in msg


def test_validator_refuses_puts_into_another_sources_slot():
    # swapping the rows of two sources keeps every row written once (no overlap, no gap), but
    # rank 2 would write the cell of source 0: Definition 5.3.2 rule 1
    d = plan_to_dict(compile_plan(BUCKET, "forward", 1))
    a, b = _remote(d, 0, "dispatch", 4), _remote(d, 2, "dispatch", 4)
    a["regions"], b["regions"] = b["regions"], a["regions"]
    with pytest.raises(PlanRegionError, match=r"Definition 5.3.2 rule 1"):
        plan_from_dict(d)


# -- memory: symmetric layout vs dropless ------------------------------------------------------


@pytest.mark.parametrize(
    "world_size, experts, rows",
    [
        (1, 4, [16, 0, 0, 0, 0, 16]),  # P = 1: the all-to-alls return their input
        (2, 4, [16, 16, 16, 16, 16, 16]),  # e = 2: regrouped both ways
        (4, 4, [16, 16, 0, 0, 16, 16]),  # e = 1: rows arrive grouped by expert
    ],
)
def test_memory_comparison_by_hand(world_size, experts, rows):
    # T=8, K=2: N = 16 rows of H=16 bf16 (32 B); C = ceil(8*2/4) = 4, one 4-row tile
    m = compare_layout_memory(tokens=8, num_experts=experts, top_k=2, hidden_size=16,
                              dtype_bytes=2, world_size=world_size, tile_m=4)  # fmt: skip
    assert list(m.dropless_rows.values()) == rows
    assert m.dropless_bytes == sum(rows) * 32
    assert m.symmetric_bytes == 4 * 4 * 4 * 32 + (4 + 4 * 1 * 1) * 8
    assert m.ratio == m.symmetric_bytes / m.dropless_bytes


def test_memory_comparison_follows_the_bucket_and_the_hot_rank():
    base = dict(tokens=4096, num_experts=64, top_k=2, hidden_size=1024, dtype_bytes=2,
                world_size=8)  # fmt: skip
    balanced = compare_layout_memory(**base)
    skewed = compare_layout_memory(**base, slot_rows=4 * 128, recv_rows=3 * 8192)
    assert skewed.symmetric_bytes > 3.9 * balanced.symmetric_bytes  # the bucket grows 4x
    assert skewed.dropless_rows["recv"] == 3 * 8192 and skewed.dropless_rows["send"] == 8192
    with pytest.raises(ValueError, match=r"num_experts \(64\) must be divisible by world_size"):
        compare_layout_memory(**{**base, "world_size": 6})


def _dropless_row_buffers(rank: int, world: int) -> tuple[int, int, int]:
    """Bytes of the new [rows, H] storages one dropless forward allocates (identity experts,
    the output y_TH left out), and the rows this rank sent and received."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    import moesaic
    from moesaic.comm.collectives import EPGroup
    from moesaic.placement import ExpertPlacement
    from moesaic.routing import build_plan
    from moesaic.strategies import make_strategy
    from moesaic.strategies.base import StrategyContext

    T, E, K, H = 64, 4, 2, 256

    class NewRowStorages(TorchDispatchMode):
        """Outputs whose storage is none of the op's inputs: the allocations."""

        def __init__(self) -> None:
            super().__init__()
            self.new: list[tuple[int, tuple[int, ...], int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat_in = tree_flatten((args, kwargs or {}))[0]
            ins = {t.untyped_storage().data_ptr() for t in flat_in if isinstance(t, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                ptr = t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
                if ptr is not None and ptr not in ins and t.dim() == 2 and t.shape[1] == H:
                    self.new.append((ptr, tuple(t.shape), t.untyped_storage().nbytes()))
            return out

    cfg = moesaic.MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=E, top_k=K)
    placement = ExpertPlacement.contiguous(E, world)
    strat = make_strategy("dropless", StrategyContext(cfg, EPGroup(None, 60.0), placement))
    gen = torch.Generator().manual_seed(rank)
    ids_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    ids_TK[: 8 * (rank + 1)] = torch.tensor([0, 1])  # skewed: ranks receive different counts
    plan = build_plan(ids_TK, torch.ones(T, K), placement, None)
    x_TH = torch.randn(T, H)
    with NewRowStorages() as mode:
        y_TH = strat.forward(x_TH, plan, lambda x_MH, counts_e: x_MH).y_TH
    out = (y_TH.untyped_storage().data_ptr(), (T, H))
    measured = sum(nbytes for ptr, shape, nbytes in mode.new if (ptr, shape) != out)
    counts_Pe = plan.counts_Pe
    if world > 1:
        import torch.distributed as dist

        all_counts = [torch.empty_like(counts_Pe) for _ in range(world)]
        dist.all_gather(all_counts, counts_Pe)
        received = int(sum(c[rank].sum() for c in all_counts))
    else:
        received = int(counts_Pe.sum())
    return measured, int(counts_Pe.sum()), received


def test_dropless_model_matches_what_a_forward_allocates():
    from moesaic.testing import run_world

    results = [(1, _dropless_row_buffers(0, 1))]
    results += [(2, r) for r in run_world(_dropless_row_buffers, 2, timeout_s=120)]
    for world, (measured, sent, received) in results:
        model = compare_layout_memory(
            tokens=64,
            num_experts=4,
            top_k=2,
            hidden_size=256,
            dtype_bytes=4,
            world_size=world,
            recv_rows=received,
        )
        assert sent == 128
        assert measured == model.dropless_bytes, (world, measured, model.dropless_rows)


def test_layout_module_is_torch_free():
    code = "import sys, moesaic.taskflow.layout; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
