"""Ctrl-C during a benchmark: one ``KeyboardInterrupt`` in the parent, no worker tracebacks.

A terminal's Ctrl-C sends SIGINT to the whole process group, workers included. A worker still
importing torch (spawn start-up takes seconds on a loaded machine) dies in that import and
prints a traceback of its own, before any benchmark code could catch it. Within
:func:`interrupts_to_main_thread`:

* SIGINT is ignored, so every process started inside the block (EP world workers, the emulated
  cluster's ranks) starts with it ignored: an ignored signal survives ``exec``, and Python then
  installs no ``KeyboardInterrupt`` handler.
* This process blocks SIGINT instead (a blocked signal is kept pending, not dropped) and a helper
  thread takes it with ``sigwait``: it stops this process's worker processes (SIGTERM, which
  ends them without output) and raises ``KeyboardInterrupt`` in the main thread.

Blocking only covers threads created after the block starts, so it must be entered before torch
is imported (importing torch starts a thread); if other threads exist already, the block does
nothing special and Ctrl-C behaves as it would without it.
"""

from __future__ import annotations

import _thread
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker
from types import FrameType


def _only_thread() -> bool:
    """Whether the calling (main) thread is the process's only OS thread."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:  # no procfs: Python's own threads are all we can see
        return threading.active_count() == 1


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextmanager
def interrupts_to_main_thread() -> Iterator[None]:
    """Within the block, Ctrl-C stops the worker processes quietly and raises
    ``KeyboardInterrupt`` in the main thread; processes started inside ignore SIGINT.

    A plain block (no change) outside the main thread, without ``pthread_sigmask`` and
    ``SIGUSR2``, or when this process already runs other threads (see the module docstring).
    """
    if (
        not hasattr(signal, "pthread_sigmask")
        or not hasattr(signal, "SIGUSR2")
        or threading.current_thread() is not threading.main_thread()
        or not _only_thread()
    ):
        yield
        return
    # interrupt_main() only runs a Python-level handler, and SIGINT's is SIG_IGN in the block:
    # SIGUSR2 (never actually sent) stands in for it.
    stand_in = signal.SIGUSR2
    done = threading.Event()

    def wait() -> None:
        interrupted = False
        while True:
            signal.sigwait({signal.SIGINT})  # the helper inherits the blocked mask
            if done.is_set():
                return
            if not interrupted:  # a second Ctrl-C while stopping changes nothing
                interrupted = True
                _thread.interrupt_main(stand_in)
                for child in multiprocessing.active_children():
                    child.terminate()

    # The spawn start method's resource tracker is started on the first queue, and starting it
    # *unblocks* SIGINT (multiprocessing.resource_tracker.ensure_running): start it first.
    resource_tracker.ensure_running()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    old_stand_in = signal.signal(stand_in, _raise_interrupt)
    helper = threading.Thread(target=wait, name="moesaic-sigint", daemon=True)
    helper.start()
    try:
        yield
    finally:
        done.set()
        assert helper.ident is not None  # started above
        signal.pthread_kill(helper.ident, signal.SIGINT)  # wakes its sigwait; it then returns
        helper.join()
        signal.signal(stand_in, signal.SIG_DFL if old_stand_in is None else old_stand_in)
        signal.signal(signal.SIGINT, signal.default_int_handler if old_int is None else old_int)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
