"""One-sided puts with signals (moesaic.comm.channel.PutChannel) and the event counters they
bump (moesaic.comm.counters.EventCounters), on small gloo worlds.

Payloads encode their origin (source rank, tile index, element index), so a tile landing in the
wrong region, or a signal that overtook its data, shows up as a wrong value.
Run this file directly to measure the per-put overhead (not a timed test).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from moesaic.comm.channel import PutChannel
from moesaic.comm.collectives import CollectiveError, EPGroup
from moesaic.comm.counters import EventCounters
from moesaic.testing import run_world

N = 16  # elements per small tile
BIG = 1 << 20  # one 4 MB tile: a signal sent with the header would fire long before its data


def _tile(src: int, j: int, n: int = N) -> torch.Tensor:
    return src * 1000.0 + j * 10.0 + torch.arange(n, dtype=torch.float32) / 64


def _step(group: EPGroup, channel: PutChannel, buffer, counters, expected: int) -> None:
    """Begin a step and fence it: no rank puts before every rank receives."""
    channel.begin(buffer, counters, expected)
    group.barrier("test fence")


def interleaved_worker(rank: int, world: int, tiles: int):
    # region of (source s, tile j) in every rank's buffer: (s * tiles + j) * N; event s per source
    group = EPGroup(None, 20.0)
    channel = PutChannel(group, timeout_s=20.0)
    buffer = torch.zeros(world * tiles * N)
    counters = EventCounters(world, rank)
    _step(group, channel, buffer, counters, (world - 1) * tiles)
    before_P = list(group.traffic.peer_bytes_P)  # the fence's all-reduce counts too

    def put_tiles(parity: int) -> None:  # two threads put at once: even and odd tiles
        for j in range(parity, tiles, 2):
            for d in [(rank + k) % world for k in range(1, world)]:
                channel.put(_tile(rank, j), d, (rank * tiles + j) * N, (rank,))

    threads = [threading.Thread(target=put_tiles, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    channel.finish()
    expected = torch.cat(
        [_tile(s, j) * (s != rank) for s in range(world) for j in range(tiles)]
    )  # this rank's own region is never put to: self-puts are the caller's copies
    ok = torch.equal(buffer, expected)
    counts = [counters.count(s) for s in range(world)]
    traffic_P = [a - b for a, b in zip(group.traffic.peer_bytes_P, before_P)]
    return ok, counts, channel.puts_P, channel.bytes_P, traffic_P


def test_interleaved_puts_from_every_rank_land_in_their_regions():
    tiles = 8
    results = run_world(interleaved_worker, 3, tiles, timeout_s=60)
    for rank, (ok, counts, puts_P, bytes_P, traffic_P) in enumerate(results):
        assert ok, f"rank {rank}: buffer differs from the origin-encoded tiles"
        # exactly one bump per put, none lost or doubled
        assert counts == [0 if s == rank else tiles for s in range(3)]
        assert puts_P == [0 if p == rank else tiles for p in range(3)]
        assert bytes_P == [0 if p == rank else tiles * N * 4 for p in range(3)]
        header = (4 + 8) * 8  # counted in the EP group's traffic with every put
        assert traffic_P == [0 if p == rank else tiles * (N * 4 + header) for p in range(3)]


def signals_worker(rank: int, world: int, k: int):
    """Step 1: rank 0 puts k - 1 small tiles to event 0 of rank 1, one to events 1 and 2, then
    (once rank 1 saw k - 1 and not k) the BIG last tile of event 0 and a pure signal of event 3.
    Step 2: another buffer, one tile back from rank 1. Then the refusals."""
    out: dict[str, object] = {}
    group = EPGroup(None, 20.0)
    channel = PutChannel(group, timeout_s=20.0)
    buffer = torch.zeros(BIG + k * N)
    counters = EventCounters(4, rank)
    go = EventCounters(1, rank)  # rank 1's go back to rank 0: a put of step 1 too
    step_counters = counters if rank == 1 else go
    _step(group, channel, buffer, step_counters, k + 2 if rank == 1 else 1)
    if rank == 0:
        channel.put(_tile(0, 99), 1, BIG + (k - 1) * N, (1, 2))  # one tile, two events
        for j in range(k - 1):
            channel.put(_tile(0, j), 1, j * N, (0,))
        go.wait(0, 1, timeout_s=20)
        channel.put(_tile(0, 7, BIG), 1, (k - 1) * N, (0,))
        channel.put(torch.zeros(0), 1, 0, (3,))  # no rows: a pure signal
    else:
        out["events12"] = [counters.wait(e, 1, timeout_s=20) for e in (1, 2)]
        out["tile99"] = torch.equal(buffer[BIG + (k - 1) * N :][:N], _tile(0, 99))
        counters.wait(0, k - 1, timeout_s=20)
        with pytest.raises(CollectiveError) as exc:
            counters.wait(0, k, timeout_s=0.3)
        out["early"] = str(exc.value)
        channel.put(torch.zeros(0), 0, 0, (0,))
        out["count"] = counters.wait(0, k, timeout_s=20)
        out["signal"] = counters.wait(3, 1, timeout_s=20)
        small = torch.cat([_tile(0, j) for j in range(k - 1)])
        out["small"] = torch.equal(buffer[: (k - 1) * N], small)
        out["big"] = torch.equal(buffer[(k - 1) * N :][:BIG], _tile(0, 7, BIG))
    channel.finish()
    second = torch.zeros(2 * N)  # the next bucket's buffer: another size
    _step(group, channel, second, EventCounters(1, rank), 1 if rank == 0 else 0)
    if rank == 1:
        channel.put(_tile(1, 5), 0, N, (0,))
    channel.finish()
    out["second"] = torch.equal(second[N:], _tile(1, 5)) if rank == 0 else True
    sent = channel.puts
    for args, match in [
        ((torch.ones(4), rank, 0, (0,)), "must be another rank"),
        ((torch.ones(4), 1 - rank, 0, tuple(range(9))), r"at most max_events \(8\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            channel.put(*args)
    out["refused_sent"] = channel.puts - sent
    return out


def test_signals_follow_their_data_and_steps_change_buffers():
    k = 4
    out0, out1 = run_world(signals_worker, 2, k, timeout_s=60)
    assert out1["events12"] == [1, 1] and out1["tile99"]  # out of order across events
    assert "event 0 on rank 1: threshold 4, count reached 3" in out1["early"]
    assert "timed out after 0.3s" in out1["early"]
    assert out1["count"] == k and out1["signal"] == 1
    assert out1["small"] and out1["big"]  # the BIG tile was all there at its signal
    assert out0["second"]
    assert out0["refused_sent"] == out1["refused_sent"] == 0


TIMEOUT_S = 2.0


def dead_peer_worker(rank: int, world: int, mode: str):
    group = EPGroup(None, TIMEOUT_S)
    channel = PutChannel(group, timeout_s=TIMEOUT_S)
    counters = EventCounters(1, rank)
    if rank == 1:
        if mode == "mid":  # the header of a put leaves, its payload never does
            header = torch.tensor([1, 0, 32, 1, 0] + [0] * 7, dtype=torch.int64)
            dist.send(header, 0, group=channel.pg, tag=0x5201)
        time.sleep(0.2)
        os._exit(17)
    channel.begin(torch.zeros(64), counters, expected=1)
    start = time.monotonic()
    with pytest.raises(CollectiveError) as exc:
        counters.wait(0, 1, timeout_s=TIMEOUT_S)
    waited = time.monotonic() - start
    start = time.monotonic()
    with pytest.raises(CollectiveError) as finishing:
        channel.finish()
    finished_in = time.monotonic() - start
    with pytest.raises(CollectiveError, match="broken"):
        channel.begin(torch.zeros(64), EventCounters(1, rank), expected=0)
    return str(exc.value), waited, str(finishing.value), finished_in


@pytest.mark.parametrize("mode", ["before", "mid"])
def test_dead_peer_is_a_collective_error_within_the_timeout(mode):
    results = run_world(dead_peer_worker, 2, mode, timeout_s=60, allow_dead=True)
    assert results[1] is None
    message, waited, finishing, finished_in = results[0]
    assert "event 0 on rank 0: threshold 1" in message
    assert waited < TIMEOUT_S + 1.0
    assert "rank 0" in finishing
    assert finished_in < TIMEOUT_S + 1.0


def test_group_of_one_sends_nothing():
    if dist.is_initialized():
        pytest.skip("needs a process without a torch.distributed world")
    channel = PutChannel(EPGroup(None, 5.0), timeout_s=5.0)
    channel.begin(torch.zeros(4), EventCounters(1), expected=0)
    with pytest.raises(ValueError, match="self-puts are copies"):
        channel.put(torch.ones(4), 0, 0, (0,))
    channel.finish()
    assert channel.pg is None and channel.puts == 0


def test_event_counters_wait_and_timeout_in_threads():
    counters = EventCounters(3, rank=5)
    seen = []
    counters.add_listener(lambda event, count: seen.append((event, count)))
    bumper = threading.Timer(0.05, lambda: [counters.bump(2) for _ in range(3)])
    bumper.start()
    assert counters.wait(2, 3, timeout_s=5) == 3
    assert seen == [(2, 1), (2, 2), (2, 3)]
    with pytest.raises(CollectiveError, match="event 1 on rank 5: threshold 1, count reached 0"):
        counters.wait(1, 1, timeout_s=0.05)
    counters.fail("peer gone")
    with pytest.raises(CollectiveError, match="peer gone"):
        counters.wait(0, 1, timeout_s=5)
    assert counters.wait(2, 3, timeout_s=5) == 3  # reached thresholds still pass
    with pytest.raises(ValueError, match="event"):
        counters.wait(3, 1, timeout_s=1)
    with pytest.raises(ValueError, match=r"by \(0\) must be > 0"):
        counters.bump(0, by=0)


def overhead_worker(rank: int, world: int, puts: int, rounds: int):
    group = EPGroup(None, 60.0)
    channel = PutChannel(group, timeout_s=60.0)
    tile = _tile(rank, 0)
    counters = EventCounters(1, rank)
    _step(group, channel, torch.zeros(puts * N), counters, puts if rank == 1 else 0)
    start = time.perf_counter()
    if rank == 0:
        for j in range(puts):
            channel.put(tile, 1, j * N, (0,))
    channel.finish()
    pipelined = (time.perf_counter() - start) / puts
    counters = EventCounters(1, rank)
    _step(group, channel, torch.zeros(N), counters, rounds)
    start = time.perf_counter()
    for i in range(1, rounds + 1):  # ping-pong on event 0
        if rank == 0:
            channel.put(tile, 1, 0, (0,))
            counters.wait(0, i, timeout_s=60)
        else:
            counters.wait(0, i, timeout_s=60)
            channel.put(tile, 0, 0, (0,))
    channel.finish()
    one_way = (time.perf_counter() - start) / rounds / 2
    return pipelined, one_way


def benchmark_put_overhead(puts: int = 2000, rounds: int = 200) -> None:
    """Per-put cost of 64-byte tiles on loopback: pipelined (until every put arrived) and
    one-way latency (half a ping-pong round)."""
    for _ in range(3):
        pipelined, one_way = run_world(overhead_worker, 2, puts, rounds, timeout_s=300)[1]
        print(f"pipelined {pipelined * 1e6:.1f} us/put   one-way {one_way * 1e6:.1f} us")


if __name__ == "__main__":
    sys.exit(benchmark_put_overhead())
