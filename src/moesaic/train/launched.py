"""A worker of ``moesaic train``'s own launcher: :func:`run_forked`, forked from the preloaded
server (``comm.world.preloaded_context``), or where there is none the command ``python -m
moesaic.train.launched CONFIG SUMMARY LAUNCHER_PID`` (also what ``--emulate`` starts in each
rank's namespace).

Either way a worker runs in a session of its own: a Ctrl-C in the terminal then reaches the
launcher alone, whose agent stops the workers with SIGTERM
(``launch._ctrl_c_stops_workers_with_sigterm``), which ends a worker silently wherever it is.
Workers in the terminal's process group were interrupted inside ``import torch`` by a Ctrl-C in
a run's first seconds: 72 lines of interleaved tracebacks. Out of the process group, a worker
no longer dies with its launcher by the terminal's signal: a command asks the kernel for SIGKILL
when the launcher dies (``PR_SET_PDEATHSIG``; Linux), a forked worker (whose parent is the
server) watches the launcher's pid and start time (``cluster.lifecycle.watch_launcher``).

``CONFIG`` holds the run's config as ``worker.write_config`` wrote it; rank 0 writes its summary
to ``SUMMARY``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher(launcher_pid: int) -> None:
    """SIGKILL this process when the launcher dies (already dead: exit now)."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != launcher_pid:  # it died before the request: nobody would stop us
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    config, summary, launcher_pid = sys.argv[1:] if argv is None else argv
    die_with_launcher(int(launcher_pid))
    from moesaic.train.worker import read_config, worker_main

    result = worker_main(read_config(config), launched=True)
    if result:
        Path(summary).write_text(json.dumps(result, default=str))
    return 0


def run_forked(
    config: str,
    summary: str,
    launcher: tuple[int, int | None],
    env: dict[str, str],
    std: tuple[int, int],
) -> None:
    """The worker as a function, forked by the preloaded server (``comm.world``'s
    forkserver, torch and torch._dynamo imported once: ``launch._run_agent``), which
    ``main`` is as a command: a session of its own (a Ctrl-C in the terminal reaches the
    launcher alone), dead with the ``launcher`` (pid, start ticks), the launcher's environment
    ``env`` with what the agent set for this rank on top (the variables that differ from the
    server's environment), its standard output and error on the launcher's (``std``, passed
    as ``comm.world.InheritedFd``), and ``worker_main``; rank 0 writes its summary to
    ``summary``."""
    from moesaic.cluster.lifecycle import watch_launcher
    from moesaic.comm.world import IMPORT_ENV, take_std

    os.setsid()
    watch_launcher(*launcher)
    take_std(std)
    from_agent = {k: v for k, v in os.environ.items() if IMPORT_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update({**env, **from_agent})
    from moesaic.train.worker import read_config, worker_main

    result = worker_main(read_config(config), launched=True)
    if result:
        Path(summary).write_text(json.dumps(result, default=str))


def exit_now(code: int) -> None:
    """Ends a worker whose work is done and written without the interpreter's teardown: its
    C++ static destructors may find a thread of gloo or DCP still joinable and abort the
    process after its summary ("terminate called without an active exception", SIGABRT: seen
    under load in CI even after the process group's teardown), which the launcher reports as a
    failed run. Output is flushed and logging shut down first; nothing else is pending."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
