"""One-sided puts with a signal (moesaic.comm.onesided) on small gloo worlds.

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

from moesaic.comm.collectives import CollectiveError
from moesaic.comm.onesided import EventCounters, OneSidedWindow, SymmetricMemoryTransport
from moesaic.testing import run_world

N = 16  # elements per small tile
BIG = 1 << 20  # one 4 MB tile: a signal sent with the header would fire long before its data


def _tile(src: int, j: int, n: int = N) -> torch.Tensor:
    return src * 1000.0 + j * 10.0 + torch.arange(n, dtype=torch.float32) / 64


def interleaved_worker(rank: int, world: int, tiles: int):
    # region of (source s, tile j) in every rank's buffer: (s * tiles + j) * N; event s per source
    with OneSidedWindow(world * tiles * N, num_events=world, timeout_s=20) as win:

        def put_tiles(parity: int) -> None:  # two threads put at once: even and odd tiles
            for j in range(parity, tiles, 2):
                for d in [(rank + k) % world for k in range(world)]:  # self included
                    tile = _tile(rank, j).view(4, 4)
                    win.put_with_signal(tile, d, ((rank * tiles + j) * N, N), rank)

        threads = [threading.Thread(target=put_tiles, args=(p,)) for p in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in range(world):
            win.wait(s, tiles)
        expected = torch.cat([_tile(s, j) for s in range(world) for j in range(tiles)])
        ok = torch.equal(win.buffer.data, expected)
        counts = [win.counters.count(s) for s in range(world)]
        traffic = list(win.transport.traffic.peer_bytes_P)  # type: ignore[attr-defined]
    return ok, counts, traffic


def test_interleaved_puts_from_every_rank_land_in_their_regions():
    tiles = 8
    results = run_world(interleaved_worker, 3, tiles, timeout_s=60)
    for rank, (ok, counts, traffic) in enumerate(results):
        assert ok, f"rank {rank}: buffer differs from the origin-encoded tiles"
        assert counts == [tiles] * 3  # exactly one bump per put, none lost or doubled
        assert traffic == [0 if p == rank else tiles * N * 4 for p in range(3)]


def threshold_worker(rank: int, world: int, k: int):
    """Rank 0 puts k tiles to event 0 of rank 1 (the last one BIG) and one to event 1."""
    out: dict[str, object] = {}
    with OneSidedWindow(BIG + k * N, num_events=2, timeout_s=20) as win:
        if rank == 0:
            win.put_with_signal(_tile(0, 99), 1, (BIG + (k - 1) * N, N), 1)  # event 1 first
            for j in range(k - 1):
                win.put_with_signal(_tile(0, j), 1, (j * N, N), 0)
            win.flush()
            win.wait(0, 1)  # rank 1's go: it saw k - 1 puts and not k
            win.put_with_signal(_tile(0, 7, BIG), 1, ((k - 1) * N, BIG), 0)
        else:
            out["event1"] = win.wait(1, 1)  # proceeds although event 0 is unfinished
            out["tile99"] = torch.equal(win.buffer.region(BIG + (k - 1) * N, N), _tile(0, 99))
            win.wait(0, k - 1)
            with pytest.raises(CollectiveError) as exc:
                win.wait(0, k, timeout_s=0.3)
            out["early"] = str(exc.value)
            win.put_with_signal(torch.zeros(1), 0, (0, 1), 0)
            out["count"] = win.wait(0, k)
            small = torch.cat([_tile(0, j) for j in range(k - 1)])
            out["small"] = torch.equal(win.buffer.region(0, (k - 1) * N), small)
            out["big"] = torch.equal(win.buffer.region((k - 1) * N, BIG), _tile(0, 7, BIG))
    return out


def test_consumer_proceeds_after_exactly_k_puts_with_all_their_data():
    k = 4
    out = run_world(threshold_worker, 2, k, timeout_s=60)[1]
    assert out["event1"] == 1 and out["tile99"]  # out of order across events
    assert "event 0 on rank 1: threshold 4, count reached 3" in out["early"]
    assert "timed out after 0.3s" in out["early"]
    assert out["count"] == k and out["small"] and out["big"]


def errors_worker(rank: int, world: int):
    messages = []
    with pytest.raises(ValueError) as exc:  # sizes differ across ranks: refused on every rank
        OneSidedWindow(8 + rank, num_events=1, timeout_s=10)
    messages.append(str(exc.value))
    with OneSidedWindow(64, num_events=2, timeout_s=10) as win:
        bad = [
            (torch.ones(4), 2, (0, 4), 0),  # unknown rank
            (torch.ones(4), -1, (0, 4), 0),  # negative rank
            (torch.ones(4), 1 - rank, (62, 4), 0),  # region past the end
            (torch.ones(4), 1 - rank, (-1, 4), 0),  # negative offset
            (torch.ones(8), 1 - rank, (0, 4), 0),  # tile larger than its region
            (torch.ones(4, dtype=torch.float64), 1 - rank, (0, 4), 0),  # wrong dtype
            (torch.ones(4), 1 - rank, (0, 4), 2),  # unknown event
        ]
        for args in bad:
            with pytest.raises(ValueError) as exc:
                win.put_with_signal(*args)
            messages.append(str(exc.value))
        sent = win.transport.traffic.collectives  # type: ignore[attr-defined]
        dist.barrier()  # any stray put would have reached the peer by close
    counts = [win.counters.count(e) for e in range(2)]
    return messages, sent, counts, bool(win.buffer.data.eq(0).all())


def test_bad_puts_are_refused_before_anything_is_sent():
    for messages, sent, counts, untouched in run_world(errors_worker, 2, timeout_s=60):
        assert "must have the same numel" in messages[0]
        assert "dst_rank (2) must be <= 1" in messages[1]
        assert "dst_rank (-1) must be >= 0" in messages[2]
        assert "offset + numel = 66 > buffer numel 64" in messages[3]
        assert "dst_region offset (-1) must be >= 0" in messages[4]
        assert "src (8 elements) must fit in dst_region (4 elements)" in messages[5]
        assert "src dtype (torch.float64) must be the buffer's (torch.float32)" in messages[6]
        assert "dst_event (2) must be <= 1" in messages[7]
        assert sent == 0 and counts == [0, 0] and untouched


TIMEOUT_S = 2.0


def dead_peer_worker(rank: int, world: int, mode: str):
    win = OneSidedWindow(64, num_events=1, timeout_s=TIMEOUT_S)
    if rank == 1:
        if mode == "mid":  # the header of a put leaves, its payload never does
            header = torch.tensor([1, 1, 0, 32, 0], dtype=torch.int64)
            dist.send(header, 0, group=win.transport.group, tag=0x5101)  # type: ignore[attr-defined]
        time.sleep(0.2)
        os._exit(17)
    start = time.monotonic()
    with pytest.raises(CollectiveError) as exc:
        win.wait(0, 1)
    waited = time.monotonic() - start
    start = time.monotonic()
    with pytest.raises(CollectiveError) as closing:
        win.close()
    return str(exc.value), waited, str(closing.value), time.monotonic() - start


@pytest.mark.parametrize("mode", ["before", "mid"])
def test_dead_peer_is_a_collective_error_within_the_timeout(mode):
    results = run_world(dead_peer_worker, 2, mode, timeout_s=60, allow_dead=True)
    assert results[1] is None
    message, waited, closing, closed_in = results[0]
    assert "event 0 on rank 0: threshold 1, count reached 0" in message
    assert waited < TIMEOUT_S + 1.0
    assert "rank 0" in closing
    assert closed_in < TIMEOUT_S + 1.0


def test_event_counters_wait_and_timeout_in_threads():
    counters = EventCounters(3, rank=5)
    bumper = threading.Timer(0.05, lambda: [counters.bump(2) for _ in range(3)])
    bumper.start()
    assert counters.wait(2, 3, timeout_s=5) == 3
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


def test_solo_window_copies_locally_and_notifies_listeners():
    if dist.is_initialized():
        pytest.skip("needs a process without a torch.distributed world")
    seen = []
    with OneSidedWindow(32, num_events=2) as win:  # torch.distributed is not running here
        win.counters.add_listener(lambda event, count: seen.append((event, count)))
        win.put_with_signal(_tile(0, 1).view(2, 8), 0, (8, N), 1)
        win.put_with_signal(_tile(0, 2)[:4], 0, (0, 8), 1)  # a tile smaller than its region
        assert win.wait(1, 2, timeout_s=1) == 2
        assert torch.equal(win.buffer.region(8, N), _tile(0, 1))
        assert torch.equal(win.buffer.region(0, 4), _tile(0, 2)[:4])
        with pytest.raises(ValueError, match=r"dst_rank \(1\) must be <= 0"):
            win.put_with_signal(_tile(0, 1), 1, (0, N), 0)
    assert seen == [(1, 1), (1, 2)]
    with pytest.raises(ValueError, match="transport must be 'gloo' or 'symmetric_memory'"):
        OneSidedWindow(8, num_events=1, transport="nvshmem")


def test_symmetric_memory_transport_is_an_explicit_stub():
    with pytest.raises(NotImplementedError, match="not implemented"):
        SymmetricMemoryTransport()


def overhead_worker(rank: int, world: int, puts: int, rounds: int):
    with OneSidedWindow(puts * N, num_events=2, timeout_s=60) as win:
        tile = _tile(rank, 0)
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            for j in range(puts):
                win.put_with_signal(tile, 1, (j * N, N), 0)
            win.flush()
        else:
            win.wait(0, puts)
        pipelined = (time.perf_counter() - start) / puts
        dist.barrier()
        start = time.perf_counter()
        for i in range(1, rounds + 1):  # ping-pong on event 1
            if rank == 0:
                win.put_with_signal(tile, 1, (0, N), 1)
                win.wait(1, i)
            else:
                win.wait(1, i)
                win.put_with_signal(tile, 0, (0, N), 1)
        one_way = (time.perf_counter() - start) / rounds / 2
    return pipelined, one_way


def benchmark_put_overhead(puts: int = 2000, rounds: int = 200) -> None:
    """Per-put cost of 64-byte tiles on loopback: pipelined and one-way latency."""
    for _ in range(3):
        pipelined, one_way = run_world(overhead_worker, 2, puts, rounds, timeout_s=300)[1]
        print(f"pipelined {pipelined * 1e6:.1f} us/put   one-way {one_way * 1e6:.1f} us")


if __name__ == "__main__":
    sys.exit(benchmark_put_overhead())
