"""Worker entry point: ``python -m moesaic.cluster.worker JOB.pkl RANK`` inside a rank namespace.

Started by :meth:`moesaic.cluster.launcher.ClusterLauncher.run`; not meant to be run by hand. It
initialises a gloo process group over the emulated network (TCP rendezvous on rank 0's address,
every collective bounded by the job's timeout), calls ``fn(rank, world_size, *args)`` and writes
``("ok", value)`` or ``("error", traceback)`` to ``result-<RANK>.pkl`` atomically.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import sys
import traceback
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the harness dies, so no worker outlives it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _write_result(result_dir: Path, rank: int, status: str, value: object) -> None:
    tmp = result_dir / f".result-{rank}.tmp"
    try:
        data = pickle.dumps((status, value))
    except Exception as exc:  # an unpicklable return value is the function's bug; report it
        data = pickle.dumps(("error", f"rank {rank}: result is not picklable: {exc!r}"))
    tmp.write_bytes(data)
    os.replace(tmp, result_dir / f"result-{rank}.pkl")


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m moesaic.cluster.worker JOB.pkl RANK", file=sys.stderr)
        return 2
    parent_pid = os.getppid()
    _die_with_parent()
    if os.getppid() != parent_pid:
        return 1
    job = pickle.loads(Path(argv[1]).read_bytes())
    rank = int(argv[2])
    result_dir = Path(job["result_dir"])
    import torch
    import torch.distributed as dist

    from moesaic.comm.world import init_world

    torch.set_num_threads(job["threads"])
    try:
        fn, args = pickle.loads(job["payload"])
        init_world(
            device="cpu",
            backend="gloo",
            timeout_s=job["timeout_s"],
            init_method=f"tcp://{job['master_addr']}:{job['master_port']}",
            rank=rank,
            world_size=job["world_size"],
        )
        value = fn(rank, job["world_size"], *args)
    except BaseException:
        _write_result(result_dir, rank, "error", traceback.format_exc())
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _write_result(result_dir, rank, "ok", value)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
