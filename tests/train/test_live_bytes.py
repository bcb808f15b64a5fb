"""The training job's storage counter (``moesaic.train.memory.LiveBytes``, also
benchmarks/step_memory.py's): live storage bytes, the peak and its attribution."""

from __future__ import annotations

import threading

import torch

from moesaic.train.memory import ALIVE_AT_START, MADE_SINCE, LiveBytes, storage_key


def test_live_bytes_counts_storages_once_until_freed():
    """A storage counts once (views, in-place ops add nothing), leaves the count when freed;
    the peak is the most alive at once, attributed at that moment."""
    keep = torch.zeros(16)  # alive before: counted from start()
    known: dict[int, str] = {}
    tally = LiveBytes(lambda: dict(known))
    tally.start()
    base = tally.current
    assert base >= 64 and tally.peak == base == tally.start_bytes
    with tally.mode():
        b = torch.ones(500)  # 2000 bytes
        known[storage_key(b)] = "parameters"
        a = torch.empty(1000)  # 4000: the peak
        view = b.view(20, 25)
        view.add_(1.0)
        assert tally.current == base + 6000
        del a
        c = torch.zeros(250)  # 1000
    assert tally.current == base + 3000
    assert tally.peak == base + 6000
    assert tally.at_peak == {"parameters": 2000, ALIVE_AT_START: base, MADE_SINCE: 4000}
    del b, view, c
    with tally.mode():
        torch.empty(0)
    assert tally.current == base
    del keep


def test_live_bytes_counts_another_threads_allocations():
    """A mode entered on another thread (the prefetcher's) counts into the same tally."""
    tally = LiveBytes()
    tally.start()
    base = tally.current
    out: list[torch.Tensor] = []

    def worker() -> None:
        with tally.mode():
            out.append(torch.empty(2048))  # 8192 bytes

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert tally.current == base + 8192 == tally.peak
    assert tally.at_peak == {}  # no classifier: nothing attributed


def test_a_storage_resized_outside_the_dispatcher_is_read_again():
    """FSDP2 frees and re-allocates its gathered parameters with ``UntypedStorage.resize_``,
    which no op reports: the next op reads every counted storage's size again."""
    tally = LiveBytes()
    tally.start()
    base = tally.current
    with tally.mode():
        t = torch.empty(1024)  # 4096 bytes
        t.untyped_storage().resize_(0)
        torch.empty(0)
        assert tally.current == base
        t.untyped_storage().resize_(4 * 4096)
        torch.empty(0)
        assert tally.current == base + 4 * 4096 == tally.peak


def test_a_freed_storage_address_is_not_kept_from_the_start():
    """A storage alive at the start and freed in the step leaves "alive at the start": one made
    later at its address is the step's."""
    old = torch.empty(4096)
    tally = LiveBytes(dict)
    tally.start()
    key = storage_key(old)
    assert key in tally.before
    del old
    assert key not in tally.before


def test_start_does_not_count_unreachable_cycles():
    """A tensor held only by a garbage cycle is not alive: start() collects it first, so a
    later collection moves nothing (the count once fell below its start when the collector
    ran mid-test, freeing what an earlier test left in cycles)."""
    import gc

    class Holder:
        pass

    h = Holder()
    h.me, h.t = h, torch.zeros(10_000)  # 40,000 bytes, reachable only through the cycle
    del h
    tally = LiveBytes()
    tally.start()
    gc.collect()
    tally.update()
    assert tally.current == tally.start_bytes
