"""Checks on what a benchmark is asked to do, made before it starts (torch-free).

* Where the result goes: the committed result of the default run is only replaced by the
  default run; any other run names its own ``--out`` (a file, or a directory to write a file
  named by the config into). Writing is atomic and leaves no temporary file behind.
* Whether this machine can run it: an EP world is one process per rank, so a world far larger
  than the machine's cores (``--ep 64`` on 2 cores) is refused unless explicitly allowed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from moesaic.checks import check_output_file

# The committed result of ``moesaic bench layer`` at its defaults (relative to the working
# directory, the repository root when run as documented).
DEFAULT_OUT = Path("benchmarks/results/bench_layer_cpu.json")

# Processes (ranks) per core a benchmark may start without --allow-oversubscribe. The committed
# default runs EP 4 on 2 cores (2 per core, reported as oversubscribed); at 64 ranks on 2 cores
# (32 per core, ~0.4 GB of torch each) the machine stopped responding.
MAX_PROCESSES_PER_CORE = 4


def available_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_world_sizes(
    world_sizes: Iterable[int],
    *,
    cores: int | None = None,
    allow_oversubscribe: bool = False,
    option: str | None = None,
) -> None:
    """Refuse worlds of more than ``MAX_PROCESSES_PER_CORE`` processes per core.

    Args:
        world_sizes: the process counts the benchmark will start, one world after another.
        cores: this machine's cores (default: :func:`available_cores`).
        allow_oversubscribe: skip the check (the user asked for it).
        option: how the user asked for the largest world, for the message (default ``--ep N``).

    Raises:
        ValueError: naming the option, the request, this machine's cores and the override.
    """
    largest = max(world_sizes, default=1)
    cores = available_cores() if cores is None else cores
    limit = MAX_PROCESSES_PER_CORE * cores
    if allow_oversubscribe or largest <= limit:
        return
    asked = f"{option} has {largest} ranks: it" if option else f"--ep {largest}"
    raise ValueError(
        f"{asked} would start {largest} processes on this machine's {cores} core(s), more "
        f"than {MAX_PROCESSES_PER_CORE} per core ({limit}); pass --allow-oversubscribe to run "
        "it anyway"
    )


def resolve_out(
    out: str | None,
    *,
    default_run: bool,
    differences: str = "",
    cluster: str | None = None,
) -> Path:
    """The result file of a run, checked before the run starts.

    Args:
        out: ``--out`` as given: a file, an existing directory, a path ending in a separator
            (a directory to create), or ``None``.
        default_run: the run has the default config, whose committed result it may replace.
        differences: how the run differs from the default, for the message (e.g. ``--quick``).
        cluster: the ``--cluster`` file, which names the result file written into a directory.

    Raises:
        ValueError: ``out`` is ``None`` for a non-default run, or cannot be a file path.
    """
    if out is None:
        if default_run:
            return DEFAULT_OUT
        why = f" ({differences})" if differences else ""
        raise ValueError(
            f"--out FILE is required for a run that differs from the default{why}: "
            f"{DEFAULT_OUT} holds the committed result of the default run"
        )
    path = Path(out)
    if out.endswith(("/", os.sep)) or path.is_dir():
        name = f"bench_layer_cluster_{Path(cluster).stem}.json" if cluster else DEFAULT_OUT.name
        path = path / name
    return check_output_file("--out", path)  # a writable file, before the benchmark runs


def write_json(document: dict, path: Path) -> Path:
    """Write ``document`` to ``path`` atomically (a crash leaves the old file or the new one).

    The temporary file is a hidden sibling in the same directory, removed if anything fails.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # Named by pid (not mkstemp, whose 0600 mode the result would keep): a hidden sibling on the
    # same file system, so the replace is atomic.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(document, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
