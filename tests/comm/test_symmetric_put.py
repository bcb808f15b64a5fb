"""Remote puts through symmetric memory (``moesaic.comm.symmetric``, ``moesaic.comm.signals``)
on the CPU: no GPU here, so the device primitives are host stand-ins and everything else is the
code CUDA runs.

* The signal bookkeeping alone: word indices, running totals modulo 2**32, what a receiver
  makes of snapshots, who is behind the fence.
* The transport rule (``pick_transport``), every branch.
* :class:`SymmetricMemoryChannel` with :class:`HostPrimitives`: "symmetric memory" is a file
  mapped by every process (``torch.from_file(shared=True)``), so a peer's window is really
  written by another process. World of one (in this process): self-puts, the fence order, the
  deadlines, bad input. World of two (gloo for the agreement and the runtime's collectives):
  origin-encoded tiles and their signals, then the taskflow runtime at EP 2 through the channel
  against the same runtime on the gloo channel, then a peer that never reaches the fence.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from moesaic.comm.collectives import CollectiveError, EPGroup
from moesaic.comm.counters import EventCounters
from moesaic.comm.signals import WORD, Arrivals, SignalLayout, SignalLedger, ahead_or_equal
from moesaic.comm.symmetric import SymmetricMemoryChannel, pick_transport
from moesaic.placement import ExpertPlacement
from moesaic.routing import Router
from moesaic.testing import run_world

N = 16  # elements per tile


class HostPrimitives:
    """``SymmetricPrimitives`` on the host: buffers are files every rank maps (one rank: plain
    tensors), each operation is done at once (a put stream that never lags unless ``stuck``),
    and every call is logged for the order checks."""

    def __init__(self, group: EPGroup, directory: Path) -> None:
        self.group, self.directory = group, directory
        self.count = itertools.count()
        self.log: list[tuple] = []
        self.stuck = False

    def _path(self, k: int, rank: int) -> str:
        return str(self.directory / f"{k}-{rank}.bin")

    def allocate(self, numel, dtype, device):
        k = next(self.count)
        if self.group.size == 1:
            t = torch.zeros(numel, dtype=dtype)
        else:
            t = torch.from_file(self._path(k, self.group.rank), True, numel, dtype=dtype)
            t.zero_()
        self.log.append(("allocate", k))
        t.symm_id = k  # type: ignore[attr-defined]
        return t

    def peers(self, tensor):
        if self.group.size == 1:
            return [tensor]
        self.group.barrier("test rendezvous")  # every rank's file exists
        k = tensor.symm_id
        return [
            tensor
            if p == self.group.rank
            else torch.from_file(self._path(k, p), True, tensor.numel(), dtype=tensor.dtype)
            for p in range(self.group.size)
        ]

    def after_compute(self, device):
        self.log.append(("after_compute",))

    def copy(self, dst, src):
        self.log.append(("copy", src.numel()))
        dst.copy_(src)

    def write(self, words, index, value):
        assert 0 <= value < WORD
        self.log.append(("write", index, value))
        words[index] = value - WORD if value >= WORD // 2 else value  # as int32

    def read(self, words):
        return words.tolist()

    def drained(self):
        return not self.stuck


def _tile(src: int, j: int) -> torch.Tensor:
    return src * 1000.0 + j * 10.0 + torch.arange(N, dtype=torch.float32) / 64


def _channel(tmp_path: Path, timeout_s: float = 5.0, group: EPGroup | None = None):
    group = group or EPGroup.solo(timeout_s)
    prims = HostPrimitives(group, tmp_path)
    return SymmetricMemoryChannel(group, timeout_s, primitives=prims), prims


# ---- the bookkeeping ---------------------------------------------------------------------


def test_layout_indices_and_bad_event():
    L = SignalLayout(ranks=3, events=4)
    assert (L.width, L.numel) == (6, 18)
    assert (L.epoch_index(2), L.puts_index(2), L.event_index(2, 3)) == (12, 13, 17)
    # every word belongs to exactly one (source, role)
    words = [L.epoch_index(s) for s in range(3)] + [L.puts_index(s) for s in range(3)]
    words += [L.event_index(s, j) for s in range(3) for j in range(4)]
    assert sorted(words) == list(range(18))
    with pytest.raises(ValueError, match=r"event \(4\) must be <= 3"):
        L.event_index(0, 4)
    with pytest.raises(ValueError, match=r"src \(3\) must be <= 2"):
        L.puts_index(3)
    with pytest.raises(ValueError, match="events"):
        SignalLayout(ranks=2, events=0)


def test_totals_wrap_and_arrivals_count_each_increment_once():
    L = SignalLayout(ranks=2, events=3)
    ledger, arrivals, snap = SignalLedger(2), Arrivals(L), [0] * L.numel
    ledger._totals[1][L.event_index(0, 2)] = WORD - 2  # about to wrap
    arrivals._seen[L.event_index(0, 2)] = WORD - 2
    snap[L.event_index(0, 2)] = WORD - 2
    arrivals.begin_step()
    for _ in range(3):  # three signals of event 2 from source 0, across the wrap
        snap[L.event_index(0, 2)] = ledger.next(1, L.event_index(0, 2))
    snap[L.puts_index(0)] = ledger.next(1, L.puts_index(0), by=3)
    snap[L.event_index(1, 0)] = 5  # five of event 0 from source 1, as a signed int32 would read
    snap[L.puts_index(1)] = 1
    assert snap[L.event_index(0, 2)] == 1  # wrapped
    assert arrivals.absorb(snap) == [(0, 5), (2, 3)]
    assert arrivals.absorb(snap) == []  # nothing new: nothing twice
    assert (arrivals.step_puts_P(), arrivals.step_puts()) == ([3, 1], 4)
    arrivals.begin_step()
    assert arrivals.step_puts() == 0
    with pytest.raises(ValueError, match="snapshot has 3 words"):
        arrivals.absorb([0, 0, 0])


def test_fence_epochs_wrap():
    L = SignalLayout(ranks=3, events=1)
    arrivals, snap = Arrivals(L), [0] * L.numel
    snap[L.epoch_index(0)] = 7
    snap[L.epoch_index(1)] = 8  # a peer already began the next step
    snap[L.epoch_index(2)] = 6
    arrivals.absorb(snap)
    assert arrivals.behind(7) == [2]
    assert ahead_or_equal(1, WORD - 1) and not ahead_or_equal(WORD - 1, 1)


@pytest.mark.parametrize(
    ("mode", "device", "ranks", "ready", "want"),
    [
        ("gloo", "cpu", 2, True, "gloo"),
        ("gloo", "cpu", 1, False, None),  # one rank: self-puts are copies
        ("gloo", "cuda", 1, True, None),
        ("auto", "cuda", 2, True, "symmetric"),
        ("auto", "cuda", 1, True, None),  # auto needs no transport on one rank
        ("auto", "cpu", 2, True, "gloo"),
        ("symmetric", "cuda", 1, True, "symmetric"),
        ("symmetric", "cuda", 4, True, "symmetric"),
    ],
)
def test_pick_transport(mode, device, ranks, ready, want):
    assert pick_transport(mode, device, ranks, ready) == want


@pytest.mark.parametrize(
    ("mode", "device", "ranks", "ready", "match"),
    [
        ("nccl", "cuda", 2, True, r"transport \('nccl'\) must be one of"),
        ("symmetric", "cpu", 2, True, "needs CUDA tensors.*got cpu tensors"),
        ("symmetric", "cuda", 2, False, "symmetric memory unavailable"),
        ("gloo", "cuda", 2, True, "CPU tensors only"),
        ("auto", "cuda", 2, False, "CPU tensors only"),
    ],
)
def test_pick_transport_refuses(mode, device, ranks, ready, match):
    with pytest.raises(ValueError, match=match):
        pick_transport(mode, device, ranks, ready)


# ---- the channel, world of one -----------------------------------------------------------


def test_self_puts_land_and_signal_in_fence_order(tmp_path):
    channel, prims = _channel(tmp_path)
    window = channel.window(4 * N, torch.float32, torch.device("cpu"), num_events=3)
    assert torch.equal(window, torch.zeros(4 * N))
    for step in range(2):  # the second step counts from what the first left
        counters = EventCounters(3)
        start = len(prims.log)
        channel.begin(window, counters, expected=3)
        channel.put(_tile(step, 0), 0, 0, (0,))
        channel.put(_tile(step, 1), 0, 2 * N, (0, 2))
        channel.put(torch.empty(0), 0, 0, (1,))  # a pure signal
        channel.finish()
        assert torch.equal(window[:N], _tile(step, 0)) and torch.equal(
            window[N : 2 * N], 0 * _tile(0, 0)
        )
        assert torch.equal(window[2 * N : 3 * N], _tile(step, 1))
        assert [counters.count(j) for j in range(3)] == [2, 1, 1]
        L = SignalLayout(1, 3)
        want = [("after_compute",), ("write", L.epoch_index(0), step + 1)]
        want += [("after_compute",), ("copy", N), ("write", L.event_index(0, 0), 2 * step + 1)]
        want += [("write", L.puts_index(0), 3 * step + 1)]
        want += [("after_compute",), ("copy", N), ("write", L.event_index(0, 0), 2 * step + 2)]
        want += [("write", L.event_index(0, 2), step + 1), ("write", L.puts_index(0), 3 * step + 2)]
        want += [("after_compute",), ("write", L.event_index(0, 1), step + 1)]
        want += [("write", L.puts_index(0), 3 * step + 3)]
        assert prims.log[start:] == want
    assert (channel.puts, channel.puts_P, channel.bytes_P) == (6, [6], [4 * 4 * N])


def test_missing_puts_and_a_stuck_stream_fail_within_the_deadline(tmp_path):
    channel, prims = _channel(tmp_path, timeout_s=0.2)
    window = channel.window(N, torch.float32, torch.device("cpu"), num_events=1)
    counters = EventCounters(1)
    channel.begin(window, counters, expected=2)
    channel.put(_tile(0, 0), 0, 0, (0,))
    with pytest.raises(CollectiveError, match=r"1 of 2 \(per source rank \[1\]\)"):
        channel.finish()
    with pytest.raises(CollectiveError, match="did not all arrive"):  # the counters' waiters
        counters.wait(0, 2, 5.0)
    with pytest.raises(CollectiveError, match="broken"):  # a failed channel refuses steps
        channel.begin(window, EventCounters(1), expected=0)

    channel, prims = _channel(tmp_path, timeout_s=0.2)
    window = channel.window(N, torch.float32, torch.device("cpu"), num_events=1)
    channel.begin(window, EventCounters(1), expected=1)
    channel.put(_tile(0, 0), 0, 0, (0,))
    prims.stuck = True
    with pytest.raises(CollectiveError, match=r"rank 0 to rank\(s\) \[0\] did not complete"):
        channel.finish()


def test_bad_input_names_the_parameter(tmp_path):
    channel, _ = _channel(tmp_path)
    window = channel.window(2 * N, torch.float32, torch.device("cpu"), num_events=2)
    with pytest.raises(ValueError, match="put outside a step"):
        channel.put(_tile(0, 0), 0, 0, ())
    with pytest.raises(ValueError, match="buffer must be a window of this channel"):
        channel.begin(torch.zeros(2 * N), EventCounters(2), 0)
    with pytest.raises(ValueError, match="counters have 3 events, the window's signals 2"):
        channel.begin(window, EventCounters(3), 0)
    with pytest.raises(ValueError, match="numel"):
        channel.window(0, torch.float32, torch.device("cpu"), 1)
    channel.begin(window, EventCounters(2), expected=0)
    with pytest.raises(ValueError, match=r"dst_rank \(1\) must be <= 0"):
        channel.put(_tile(0, 0), 1, 0, ())
    with pytest.raises(ValueError, match=r"offset \(17\) must be <= 16"):
        channel.put(_tile(0, 0), 0, N + 1, ())
    with pytest.raises(ValueError, match=r"event \(2\) must be <= 1"):
        channel.put(_tile(0, 0), 0, 0, (0, 2))
    with pytest.raises(ValueError, match=r"src .*float64.* must match the window"):
        channel.put(_tile(0, 0).double(), 0, 0, ())
    with pytest.raises(ValueError, match="begin called twice"):
        channel.begin(window, EventCounters(2), 0)
    channel.finish()
    assert channel.puts == 0


# ---- world of two ------------------------------------------------------------------------


def _layer_inputs(rank: int):
    """Rank ``rank``'s tokens, routing and local experts of a small SwiGLU layer at EP 2."""
    gen = torch.Generator().manual_seed(5)
    H, F, E, T = 16, 12, 8, 10
    from moesaic import MoEConfig

    router = Router(MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=2))
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    x_all = torch.randn(2 * T, H, generator=gen)
    w = [torch.randn(E, *s, generator=gen) / 4 for s in ((H, F), (F, H), (H, F))]
    dy = torch.randn(2 * T, H, generator=gen)
    x = x_all[rank * T : (rank + 1) * T]
    routing, _ = router(x, ExpertPlacement.contiguous(E, 2))
    local = slice(rank * E // 2, (rank + 1) * E // 2)
    return x, dy[rank * T : (rank + 1) * T], routing, [t[local] for t in w], (H, F)


def _layer_step(rt, rank: int) -> list[torch.Tensor]:
    from moesaic.taskflow.runtime.concurrent import TaskflowRuntime

    assert isinstance(rt, TaskflowRuntime)
    x, dy, routing, w, (H, F) = _layer_inputs(rank)
    bucket = rt.bucket(routing, hidden=H, ffn=F, activation="swiglu")
    fwd_plan, bwd_plan = rt.plans(bucket)
    fwd = rt.forward(fwd_plan, x, routing, w[0], w[1], w[2])
    bwd = rt.backward(bwd_plan, dy, routing, fwd.saved, w[0], w[1], w[2])
    return [fwd.y_TH, bwd.dx_TH, bwd.dw1_eHF, bwd.dw2_eFH, bwd.dw3_eHF, bwd.dtopk_weights_TK]


def two_rank_worker(rank: int, world: int, directory: str) -> dict:
    from moesaic.taskflow.runtime.concurrent import TaskflowRuntime

    torch.set_num_threads(1)
    group = EPGroup(None, 30.0)
    out: dict = {}
    # 1. tiles from every rank to every rank (self included), origin-encoded, two events each:
    # event s counts source s's tiles, event 2 every tile
    channel, _ = _channel(Path(directory) / "tiles", 30.0, group)
    (Path(directory) / "tiles").mkdir(exist_ok=True)
    window = channel.window(2 * 3 * N, torch.float32, torch.device("cpu"), num_events=3)
    counters = EventCounters(3, rank)
    channel.begin(window, counters, expected=2 * 3)
    for j, d in itertools.product(range(3), range(2)):
        channel.put(_tile(rank, j), d, (rank * 3 + j) * N, (rank, 2))
    counters.wait(2, 6, 30.0)
    out["counts"] = [counters.count(j) for j in range(3)]
    channel.finish()
    out["window"] = window.clone()
    out["puts_P"] = channel.puts_P
    # 2. the taskflow runtime at EP 2 on this channel against the same runtime on gloo
    outputs = {}
    for transport in ("gloo", "symmetric"):
        rt = TaskflowRuntime(group, tile_m=2, timeout_s=30.0)
        if transport == "symmetric":  # host primitives: pick_transport wants CUDA for these
            rt._symmetric, _ = _channel(Path(directory), 30.0, group)
            rt.transport_for = lambda device, rt=rt: rt._symmetric  # type: ignore[method-assign]
        outputs[transport] = _layer_step(rt, rank) + _layer_step(rt, rank)  # two steps
        out[f"{transport}_puts"] = rt.channel.puts if rt.channel is not None else -1
    out["same"] = [torch.equal(a, b) for a, b in zip(outputs["gloo"], outputs["symmetric"])]
    # 3. rank 1 never reaches the fence: rank 0 names it
    if rank == 0:
        channel2 = rt._symmetric
        plan = next(iter(rt._windows))
        window2 = rt._windows[plan].data
        channel2.timeout_s = 0.3
        try:
            channel2.begin(
                window2, EventCounters(channel2._windows[window2.data_ptr()].layout.events), 0
            )
        except CollectiveError as exc:
            out["fence"] = str(exc)
    group.barrier("test done")
    return out


def test_two_ranks_tiles_runtime_and_a_late_peer(tmp_path):
    r0, r1 = run_world(two_rank_worker, 2, str(tmp_path), timeout_s=120)
    for rank, r in enumerate((r0, r1)):
        want = torch.cat([_tile(s, j) for s in range(2) for j in range(3)])
        assert torch.equal(r["window"], want), rank
        assert r["counts"] == [3, 3, 6]
        assert r["puts_P"] == [3, 3]
        assert all(r["same"]), (rank, r["same"])
        assert r["symmetric_puts"] > 0 and r["gloo_puts"] == r["symmetric_puts"]
    assert "waited 0.3s at the step fence for rank(s) [1]" in r0["fence"]


def test_ranks_sharing_a_gpu_are_refused_by_name():
    """Symmetric memory maps one peer per device: two ranks on one GPU (the shared-gloo GPU
    tests) are refused before torch's rendezvous fails without naming them."""
    from moesaic.comm.symmetric import check_one_rank_per_device

    check_one_rank_per_device([("a", 0), ("a", 1), ("b", 0), ("b", 1)])
    with pytest.raises(ValueError, match=r"ranks 1 and 2 share cuda:1 on a"):
        check_one_rank_per_device([("a", 0), ("a", 1), ("a", 1)])
