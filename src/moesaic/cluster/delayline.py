"""Userspace delay line: joins each rank's tap to its port tap and delays what the rank sends.

The emulator needs latency, but the kernels we run on may lack ``sch_netem`` (and ``fq``, which
would honour BPF-set departure times), so latency is added here: one process in the fabric
namespace owns a pair of tap devices per rank, ``t<k>`` (moved into the rank's namespace as
``eth0``) and ``p<k>`` (a port of the rank's parent bridge), and copies frames between them.

* Upward frames (rank -> fabric) that carry IPv4 to another rank are held for the one-way path
  latency to that rank, ``spec.path(src, dst).latency_ms``, then written to the port; every other
  frame (ARP, downward traffic) is forwarded at once. Holding the whole path latency at the
  sender's access is equivalent to spreading it over the links, because the delay is constant:
  it shifts every packet of a flow by the same amount and leaves the queueing at the shaped
  links unchanged.
* Rates are not enforced here but by ``tbf`` on the taps' egress (kernel), before frames reach
  this process, so its speed only has to keep up, not be precise.
* Timer wake-ups are late by a fairly constant amount on a VM (~0.15-0.25 ms measured here);
  the loop learns that lateness (an exponential average over timer wake-ups) and sleeps that
  much less, so frames leave on time on average rather than always late.

Runs as ``python -I -S delayline.py CONFIG.json`` (standard library only, so it starts in tens
of milliseconds without importing torch). Prints ``ready`` once every tap exists and exits on
SIGTERM/SIGINT, when its stdin reaches EOF (the harness died), when its parent changes, or after
``max_lifetime_s``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import json
import os
import select
import signal
import struct
import sys
import time

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_PR_SET_PDEATHSIG = 1
_PR_SET_TIMERSLACK = 29
_ETHERTYPE_IPV4 = b"\x08\x00"
_READ_BYTES = 65600  # > the largest MTU we allow (65000) plus the Ethernet header
_READS_PER_WAKE = 64  # bounded work per fd per loop iteration
_MAX_QUEUED_FRAMES = 200_000  # ~1.8 GB at 9000 bytes: a runaway, not a working emulation
_MAX_LEAD_S = 1e-3
_IDLE_POLL_S = 0.5
_RT_PRIORITY = 10  # low among real-time priorities: above every normal task, below kernel threads


def _open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    ifreq = struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI)
    fcntl.ioctl(fd, _TUNSETIFF, ifreq)
    return fd


def _prctl(option: int, value: int) -> None:
    # Not Linux/glibc: only timer precision or cleanup-on-parent-death is lost.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _realtime_priority() -> None:
    """SCHED_FIFO, so frames leave on time even when the workers keep both cores busy.

    Safe because the loop sleeps whenever nothing is due (its CPU use is bounded by the traffic
    the tbf shapers let through) and the kernel's RT throttling keeps 5% of each second for
    everyone else anyway. Without the privilege we stay at normal priority.
    """
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(_RT_PRIORITY))


class _Stop(Exception):
    pass


def _on_signal(signum: int, frame: object) -> None:
    raise _Stop


class DelayLine:
    """The forwarding loop over all tap pairs (one instance per process)."""

    def __init__(self, config: dict) -> None:
        self.first_ip = int(config["first_rank_ip"])
        self.up: dict[int, tuple[int, list[float]]] = {}  # rank tap fd -> (port fd, delays_s)
        self.down: dict[int, int] = {}  # port fd -> rank tap fd
        for link in config["links"]:
            tap_fd = _open_tap(link["tap"])
            port_fd = _open_tap(link["port"])
            self.up[tap_fd] = (port_fd, [d * 1e-3 for d in link["delays_ms"]])
            self.down[port_fd] = tap_fd
        self.fds = [*self.up, *self.down]
        self.heap: list[tuple[float, int, int, bytes]] = []
        self.seq = 0
        self.lead_s = 0.0
        self.dropped = 0

    def _delay_s(self, frame: bytes, delays_s: list[float]) -> float:
        if len(frame) < 34 or frame[12:14] != _ETHERTYPE_IPV4:
            return 0.0
        dst = int.from_bytes(frame[30:34], "big") - self.first_ip
        return delays_s[dst] if 0 <= dst < len(delays_s) else 0.0

    def _write(self, fd: int, frame: bytes) -> None:
        try:
            os.write(fd, frame)
        except OSError:  # device going away at teardown, or a full queue: the frame is lost
            self.dropped += 1

    def _receive(self, fd: int, now: float) -> None:
        for _ in range(_READS_PER_WAKE):
            try:
                frame = os.read(fd, _READ_BYTES)
            except BlockingIOError:
                return
            except OSError:
                return
            if fd in self.down:
                self._write(self.down[fd], frame)
                continue
            port_fd, delays_s = self.up[fd]
            delay_s = self._delay_s(frame, delays_s)
            if delay_s <= 0.0:
                self._write(port_fd, frame)
            elif len(self.heap) >= _MAX_QUEUED_FRAMES:
                self.dropped += 1
            else:
                self.seq += 1
                heapq.heappush(self.heap, (now + delay_s, self.seq, port_fd, frame))

    def _release(self, now: float) -> None:
        # Frames due within the learned wake-up lateness go now: sleeping again would only make
        # them later. Bounded by the heap size.
        while self.heap and self.heap[0][0] <= now + self.lead_s:
            _, _, fd, frame = heapq.heappop(self.heap)
            self._write(fd, frame)

    def run(self, *, stdin_fd: int | None, parent_pid: int, deadline: float) -> None:
        watch = [*self.fds, *([stdin_fd] if stdin_fd is not None else [])]
        while time.monotonic() < deadline:
            now = time.monotonic()
            self._release(now)
            if self.heap:
                wake_at = self.heap[0][0] - self.lead_s
                timeout_s = max(0.0, wake_at - now)
            else:
                wake_at, timeout_s = None, _IDLE_POLL_S
            readable, _, _ = select.select(watch, [], [], timeout_s)
            now = time.monotonic()
            if not readable:
                if wake_at is not None and timeout_s > 0.0:
                    lateness_s = now - wake_at
                    self.lead_s = min(_MAX_LEAD_S, max(0.0, 0.8 * self.lead_s + 0.2 * lateness_s))
                elif wake_at is None and os.getppid() != parent_pid:
                    return
                continue
            for fd in readable:
                if fd == stdin_fd:
                    if not os.read(stdin_fd, 4096):
                        return
                    continue
                self._receive(fd, now)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: delayline.py CONFIG.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        config = json.load(f)
    parent_pid = os.getppid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(_PR_SET_TIMERSLACK, 1)  # 1 ns instead of the default 50 us on our timed wake-ups
    _realtime_priority()
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    if os.getppid() != parent_pid:  # the parent died before PDEATHSIG was armed
        return 1
    line = DelayLine(config)
    print("ready", flush=True)
    deadline = time.monotonic() + float(config["max_lifetime_s"])
    stdin_fd = None if config.get("detached") else sys.stdin.fileno()
    with contextlib.suppress(_Stop):
        line.run(stdin_fd=stdin_fd, parent_pid=parent_pid, deadline=deadline)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
