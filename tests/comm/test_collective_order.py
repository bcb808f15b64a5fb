"""Every rank issues the same collectives in the same order, per step, for every schedule and
strategy: what NCCL requires across all the communicators two ranks share (one thread issues
them all, so a different interleaving on two ranks can hang them).

Each rank records its collectives at the choke point (``record_collectives``: ``(global ranks,
lane, op, what)`` per collective issued through ``EPGroup``, in issue order) while it builds the
model and step ("step 0": agreements and group creation) and during each of 2 optimizer steps
(the first reduces flowmoe's gradients at ``finish`` while the pool learns its hook counts, the
second during the backward, one chunk per gap). For every pair of ranks, the entries on
communicators that hold both (any lane) must be the very same sequence.

Cases: every schedule x every strategy it runs (``supports``: ``taskflow`` runs vanilla only),
each with balanced routing and
with a skewed router that sends every token to experts 0 and 1 (the ranks holding experts 2
and 3 receive no rows yet take part in every collective): on 2 ranks at EP 2, and flowmoe at
EP 1 x DP 2; on 4 ranks at EP 2 x DP 2 (``dropless`` under every schedule, ``taskflow`` and
``hybrid`` under vanilla) and ``hybrid`` at EP 4 with expert domains of 2 (level, prefetch and
offset groups all distinct) under vanilla and flowmoe.

Two kinds of traffic need a word:

* **taskflow's one-sided puts** are not compared: they are point-to-point messages, not
  collectives (``PutChannel`` sends them with ``dist.isend``/``irecv`` on the ``puts`` lane's
  group, from executor threads in an order set by timing, matched by source and tag per pair).
  They never enter the log (``EPGroup.count_sent`` only counts their bytes), the ``puts`` lane
  carries nothing else, and the taskflow strategy refuses NCCL groups. The test checks that
  the log holds no ``puts`` entry and that every rank did put (so that leaving them out of the
  comparison is not vacuous).
* **hybrid's prefetched gathers** are compared like the rest, although on gloo they run in the
  prefetcher's background thread (on device streams they are enqueued from the calling
  thread): they start at the optimizer step's post-hook, after the step's last collective,
  and the test waits for them inside the step's recording.

``test_comparison_catches_a_reordered_log`` feeds a recorded log with two adjacent collectives
on different communicators swapped to the comparison, which must fail.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from moesaic.comm.collectives import record_collectives
from moesaic.comm.world import run_world
from moesaic.models import MoEGPT, MoEGPTConfig
from moesaic.schedule import make_step, schedule_names
from moesaic.schedule.base import StepParts
from moesaic.schedule_table import schedule_spec
from moesaic.strategies import get_strategy, strategy_names

Entry = tuple[Any, ...]  # (global ranks, lane, op, what)

PIPELINED = [name for name in schedule_names() if schedule_spec(name).pipelined]


def _runs(strategy: str, schedule: str) -> bool:
    """What the strategy declares it runs under (``MoEStrategy.supports``)."""
    return get_strategy(strategy).supports.runs_under(schedule)


# (schedule, strategy, EP size, domain sizes) on 2 ranks: EP 2, and EP 1 x DP 2 for flowmoe
# (expert gradients reduced over the world, no row all-to-all to interleave with). Hybrid under
# a pipelined schedule with domains of one rank, so that its rows cross the ranks (its gathers
# under flowmoe: on 4 ranks below).
CASES_2 = [
    (schedule, strategy, 2, (1,) if strategy == "hybrid" and schedule in PIPELINED else None)
    for schedule in schedule_names()
    for strategy in strategy_names()
    if _runs(strategy, schedule)
]
CASES_2 += [("flowmoe", "dropless", 1, None)]
# On 4 ranks: EP 2 x DP 2 (DP pairs in the main and grad lanes, put and prefetch groups of two
# that are not ranks 0..P-1: taskflow's puts there used to go to the wrong ranks and hang), and
# hybrid at EP 4 with domains of 2 (level, prefetch and offset groups all distinct).
CASES_4 = [(schedule, "dropless", 2, None) for schedule in schedule_names()]
CASES_4 += [("vanilla", "taskflow", 2, None), ("vanilla", "hybrid", 2, None)]
CASES_4 += [("vanilla", "hybrid", 4, (2,)), ("flowmoe", "hybrid", 4, (2,))]
B, T, R, STEPS = 4, 8, 2, 2
# Small enough that the replicated gradients (26 KB) leave in 7 chunks.
SP = 4096


def _config(strategy: str, domain_sizes: tuple[int, ...] | None) -> MoEGPTConfig:
    moe = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16, "dispatcher": strategy}
    moe["aux_loss_coef"] = 0.01
    if domain_sizes is not None:  # hybrid's option
        moe["options"] = {"domain_sizes": domain_sizes}
    return MoEGPTConfig.from_dict(
        # layernorm: _skew moves ln2's bias (RMSNorm has none)
        {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": T, "norm": "layernorm", "moe": moe}
    )


def _lm_loss(logits_BTV, y_BT):
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())


@torch.no_grad()
def _skew(model: MoEGPT) -> None:
    """Experts 0 and 1 win every token: each MoE norm adds 100 u to its input and the router
    scores u at 1, 0.9, -1, -0.9 (the normed input's own part is ~|x| = 4), so only the ranks
    holding experts 0 and 1 receive rows."""
    for block in model.blocks:
        u = F.normalize(torch.randn(block.ln2.bias.shape), dim=0)
        block.ln2.bias.copy_(100 * u)
        block.moe.router.weight.copy_(torch.outer(torch.tensor([1.0, 0.9, -1.0, -0.9]), u))


def shared_order(log: Sequence[Entry], a: int, b: int) -> list[Entry]:
    """The entries of ``log`` on communicators holding both global ranks ``a`` and ``b``."""
    return [e for e in log if a in e[0] and b in e[0]]


def assert_same_order(logs: Sequence[Sequence[Entry]], label: str = "") -> None:
    """For every pair of ranks (``logs[r]``: rank r's log), the collectives on the
    communicators both hold are one sequence; the error names the first difference."""
    for a, b in itertools.combinations(range(len(logs)), 2):
        seq_a, seq_b = shared_order(logs[a], a, b), shared_order(logs[b], a, b)
        if seq_a == seq_b:
            continue
        k = next(
            (i for i, (x, y) in enumerate(zip(seq_a, seq_b)) if x != y), min(len(seq_a), len(seq_b))
        )
        got_a = seq_a[k] if k < len(seq_a) else "nothing"
        got_b = seq_b[k] if k < len(seq_b) else "nothing"
        raise AssertionError(
            f"{label}: ranks {a} and {b} issue different sequences on their shared "
            f"communicators; collective #{k}: rank {a} {got_a}, rank {b} {got_b}"
        )


def _run_case(layout, schedule, strategy, domain_sizes, skew, batches):
    from moesaic.strategies.prefetch import ExpertPrefetcher
    from moesaic.train.hooks import ModelHooks
    from moesaic.train.parallel import GradientSync

    with record_collectives() as log:  # step 0: construction (agreements, groups)
        torch.manual_seed(0)
        model = MoEGPT(_config(strategy, domain_sizes), ep_group=layout.ep_group)
        if skew:
            _skew(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        # as training attaches them (train/loop.py): hybrid's gathers start after each
        # optimizer step
        hooks = ModelHooks(model).attach(optimizer)
        prefetchers = [h for h in hooks.hooks if isinstance(h, ExpertPrefetcher)]
        parts = StepParts(
            model=model,
            loss_fn=_lm_loss,
            grad_sync=GradientSync(layout),
            optimizer=optimizer,
            pipeline_degree=R if schedule in PIPELINED else 1,
            ar_chunk_bytes=SP,
        )
        step = make_step(schedule, parts)
    logs, received = [list(log)], []
    for x_BT in batches:
        with record_collectives() as log:
            assert step.run(x_BT[:, :-1], x_BT[:, 1:]).applied
            for prefetcher in prefetchers:  # its gathers are part of the step's log
                prefetcher.wait()
        logs.append(list(log))
        counts = [block.moe.take_stats().counts_E for block in model.blocks]
        received.append(torch.stack(counts).sum(0).tolist())
    puts = sum(
        block.moe.strategy.runtime.channel.puts
        for block in model.blocks
        if strategy == "taskflow" and block.moe.strategy.runtime.channel is not None
    )
    if hasattr(step, "close"):
        step.close()
    hooks.close()
    return {"logs": logs, "counts_E": received, "puts": puts}


def _world(rank, world_size, cases):
    from moesaic.train.parallel import build_layout

    layouts = {}
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    batches = [torch.randint(0, 256, (B, T + 1), generator=gen) for _ in range(STEPS)]
    out = {}
    for schedule, strategy, ep, domains in cases:
        if ep not in layouts:
            layouts[ep] = build_layout(ep, 60.0)
        for skew in (False, True):
            key = (schedule, strategy, ep, skew)
            out[key] = _run_case(layouts[ep], schedule, strategy, domains, skew, batches)
    return out


@functools.cache
def _results(world_size: int) -> list[dict]:
    cases = CASES_2 if world_size == 2 else CASES_4
    return run_world(_world, world_size, cases, timeout_s=300.0)


def _check(world_size: int, schedule: str, strategy: str, ep: int) -> list[dict]:
    """Every step's logs (construction included) agree across ranks, with balanced and with
    skewed routing; no put is in the log. Returns the world's results."""
    results = _results(world_size)
    for skew in (False, True):
        runs = [r[(schedule, strategy, ep, skew)] for r in results]
        for s in range(STEPS + 1):
            assert_same_order([run["logs"][s] for run in runs], f"step {s} skew={skew}")
        for run in runs:
            assert all(e[1] != "puts" for log in run["logs"] for e in log)
    return results


def _interleaved(log: Sequence[Entry]) -> bool:
    """A gradient chunk was issued between two row all-to-alls (two communicators)."""
    lanes = [e[1] for e in log]
    rows = [i for i, lane in enumerate(lanes) if lane == "rows"]
    return bool(rows) and "grad" in lanes[rows[0] : rows[-1]]


def _ids(cases) -> list[str]:
    return [f"{c[0]}-{c[1]}-ep{c[2]}" for c in cases]


@pytest.mark.parametrize(("schedule", "strategy", "ep", "domains"), CASES_2, ids=_ids(CASES_2))
def test_same_order_on_two_ranks(schedule, strategy, ep, domains):
    results = _check(2, schedule, strategy, ep)
    for r in results:
        # the skewed router: experts 2 and 3 (rank 1's at EP 2) received no rows in step 1
        assert r[(schedule, strategy, ep, True)]["counts_E"][0][2:] == [0, 0]
        if strategy == "taskflow":  # puts travelled, outside the log
            assert r[(schedule, strategy, ep, False)]["puts"] > 0
        if schedule == "flowmoe" and ep > 1:  # chunks interleave with the all-to-alls
            assert _interleaved(r[(schedule, strategy, ep, False)]["logs"][2])


@pytest.mark.parametrize(("schedule", "strategy", "ep", "domains"), CASES_4, ids=_ids(CASES_4))
def test_same_order_on_four_ranks(schedule, strategy, ep, domains):
    results = _check(4, schedule, strategy, ep)
    # Groups that hold only some ranks (DP pairs, hybrid's levels and offset groups) are in
    # the logs, so the pairwise filter matters.
    logs = [log for r in results for log in r[(schedule, strategy, ep, False)]["logs"]]
    groups = {e[0] for log in logs for e in log}
    assert any(len(g) == 2 for g in groups), groups
    # the skewed router: experts 2 and 3 (EP ranks 1 of EP 2; ranks 2 and 3 of EP 4) got none
    assert all(r[(schedule, strategy, ep, True)]["counts_E"][0][2:] == [0, 0] for r in results)
    if strategy == "taskflow":  # every rank put, outside the log
        assert all(r[(schedule, strategy, ep, False)]["puts"] > 0 for r in results)


def _swap_chunk_and_rows(log: list[Entry]) -> list[Entry]:
    """``log`` with its first gradient chunk swapped with the row all-to-all next to it: what
    a pool deciding by timing could issue on one rank."""
    k = next(i for i in range(len(log) - 1) if {log[i][1], log[i + 1][1]} == {"grad", "rows"})
    return [*log[:k], log[k + 1], log[k], *log[k + 2 :]]


def test_comparison_catches_a_reordered_log():
    """The comparison can fail: rank 1's recorded flowmoe step with one pair of collectives
    on different communicators (a gradient chunk and a row all-to-all) swapped, or with its
    last collective missing, is refused; the real logs pass."""
    logs = [r[("flowmoe", "dropless", 2, False)]["logs"][2] for r in _results(2)]
    assert_same_order(logs)
    swapped = _swap_chunk_and_rows(logs[1])
    assert sorted(swapped) == sorted(logs[1]) and swapped != logs[1]
    with pytest.raises(AssertionError, match=r"ranks 0 and 1 issue different sequences"):
        assert_same_order([logs[0], swapped])
    with pytest.raises(AssertionError, match=r"rank 1 nothing"):
        assert_same_order([logs[0], logs[1][:-1]])


@pytest.mark.parametrize("schedule", PIPELINED)
@pytest.mark.parametrize("strategy", strategy_names())
def test_pipelined_schedules_refuse_what_strategies_do_not_run(schedule, strategy):
    """The cases above leave out what a strategy's ``supports`` refuses (and only that), and
    building the step refuses it with the strategy's reason."""
    from moesaic.train.parallel import GradientSync, build_layout

    if _runs(strategy, schedule):
        assert any(c[:2] == (schedule, strategy) for c in CASES_2)
        return
    model = MoEGPT(_config(strategy, None))
    parts = StepParts(
        model=model,
        loss_fn=_lm_loss,
        grad_sync=GradientSync(build_layout(1, 60.0)),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        pipeline_degree=R,
    )
    why = get_strategy(strategy).supports.why
    assert why
    with pytest.raises(ValueError, match=rf"strategy '{strategy}' does not run under schedule"):
        make_step(schedule, parts)
