"""The bytes gloo's collectives put on the wire, counted on the loopback interface: whether
``reduce_scatter_tensor`` (what FSDP2 reduces gradients with) moves a reduce-scatter's bytes or
an all-reduce's. ``ProcessGroupGloo`` has no reduce-scatter algorithm: it clones the input,
all-reduces it and keeps its chunk. ``sim.fsdp`` prices it so on a CPU profile
(``reduce_scatter_all_reduces``).

W ranks on this machine (gloo, TCP on ``lo``); each collective twice on a tensor of N fp32
elements (a shard of N / W where it takes one), between barriers and pauses; the loopback's
transmitted bytes before and after on rank 0 (nothing else may use ``lo`` meanwhile). A ring
all-gather moves ``W (W - 1) / W N`` elements in all, a ring reduce-scatter the same, an
all-reduce twice that.

Usage::

    python benchmarks/gloo_collective_bytes.py [--world 4] [--mib 32] [--out results/gloo_collective_bytes.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def lo_tx_bytes() -> int:
    """Bytes the loopback interface has transmitted (``/proc/net/dev``)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def _rank(rank: int, world: int, n: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world)
    full, shard = torch.ones(n), torch.ones(n // world)
    ops = {
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(n), shard),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty_like(shard), full),
        "all_reduce": lambda: dist.all_reduce(full.clone()),
    }
    rows = []
    for name, op in ops.items():
        for _ in range(2):
            dist.barrier()
            time.sleep(0.2)
            before, t0 = lo_tx_bytes(), time.perf_counter()
            op()
            dist.barrier()
            seconds = time.perf_counter() - t0
            time.sleep(0.2)
            rows.append({"op": name, "bytes": lo_tx_bytes() - before, "seconds": seconds})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--mib", type=int, default=32, help="the full tensor, MiB of fp32")
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n = args.mib * 2**20 // 4 // args.world * args.world
    tmp = Path(f"/tmp/gloo_collective_bytes.{os.getpid()}.json")
    mp.spawn(_rank, args=(args.world, n, args.port, str(tmp)), nprocs=args.world)
    rows = json.loads(tmp.read_text())
    tmp.unlink()
    ring = args.world * (args.world - 1) / args.world * n * 4
    for row in rows:
        row["over_ring_all_gather"] = row["bytes"] / ring
    result = {
        "world": args.world,
        "full_bytes": n * 4,
        "ring_all_gather_bytes": ring,
        "torch": torch.__version__,
        "machine": platform.node(),
        "rows": rows,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
