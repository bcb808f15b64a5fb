"""benchmarks/step_memory.py's counter: live storage bytes, the peak and its attribution."""

from __future__ import annotations

import threading

import torch

from _scripts import load_benchmark

step_memory = load_benchmark("step_memory")


def test_live_bytes_counts_storages_once_until_freed():
    """A storage counts once (views, in-place ops add nothing), leaves the count when freed;
    the peak is the most alive at once, attributed at that moment."""
    keep = torch.zeros(16)  # alive before: counted from start()
    known: dict[int, str] = {}
    tally = step_memory.LiveBytes(lambda: dict(known))
    tally.start()
    base = tally.current
    assert base >= 64 and tally.peak == base
    with tally.mode():
        b = torch.ones(500)  # 2000 bytes
        known[step_memory._key(b)] = "parameters"
        a = torch.empty(1000)  # 4000: the peak
        view = b.view(20, 25)
        view.add_(1.0)
        assert tally.current == base + 6000
        del a
        c = torch.zeros(250)  # 1000
    assert tally.current == base + 3000
    assert tally.peak == base + 6000
    assert tally.at_peak == {
        "parameters": 2000,
        "gradients": 0,
        "optimizer state": 0,
        "strategy state": 0,
        "other, alive at the step's start": base,
        "other, made in the step": 4000,
    }
    del b, view, c
    assert tally.current == base
    del keep


def test_live_bytes_counts_another_threads_allocations():
    """A mode entered on another thread (the prefetcher's) counts into the same tally."""
    tally = step_memory.LiveBytes(dict)
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
    out.clear()
    assert tally.current == base


def test_a_freed_storage_address_is_not_kept_from_the_start():
    """A storage alive at the start and freed in the step leaves "alive at the start": one made
    later at its address is the step's."""
    old = torch.empty(4096)
    tally = step_memory.LiveBytes(dict)
    tally.start()
    key = step_memory._key(old)
    assert key in tally.before
    del old
    assert key not in tally.before
