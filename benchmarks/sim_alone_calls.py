"""The call floors ``calibrate --cluster`` measures since 2026-12-05, measured on the clusters of
the unseen rules already measured, whose stored profiles predate them: each configuration's
cluster is brought up again; one tiny all-reduce after a barrier timed as ``calibrate`` times it
(``Profile.allreduce_alone_call_s``, :func:`moesaic.measure.calibrate.alone_all_reduce_s`: the
slowest rank's time per repetition, the mean over ``CALL_REPS`` after one warm-up), and a tiny
all-to-all three ways (:func:`measure`; the back-to-back call is ``a2a_call_s`` since).
``sim_seen_repredict.py --alone FILE [--a2a-floor back-to-back]`` prices the stored points again
with these figures in their profiles (an explanation of seen data, not a validation; the
validation is a rule fixed before it is measured).

Usage (root: the emulated network needs network namespaces; an otherwise idle machine)::

    python benchmarks/sim_alone_calls.py --rules 17-32 --out benchmarks/results/sim_alone_calls.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_unseen as su
import sim_unseen_wide as wide
from moesaic.cluster.netns import EmulatedCluster
from moesaic.cluster.spec import ClusterSpec
from moesaic.measure.calibrate import (
    ALONE_CALL_BYTES,
    CALL_BYTES_PER_PAIR,
    CALL_REPS,
    alone_all_reduce_s,
    back_to_back_a2a_s,
)

RESULTS = Path(__file__).resolve().parent / "results"


def _worker(rank: int, world: int, reps: int, timeout_s: float) -> list[float]:
    """This rank's seconds per repetition (after one warm-up)."""
    import torch

    from moesaic.comm.collectives import EPGroup

    group = EPGroup(None, timeout_s)
    tensor = torch.zeros(ALONE_CALL_BYTES // 4)
    times = [alone_all_reduce_s(group, tensor) for _ in range(1 + reps)]
    group.barrier("calibrate barrier")
    return times[1:]


def _worker_a2a(rank: int, world: int, reps: int, timeout_s: float) -> list[tuple[float, float]]:
    """This rank's (issue, end) monotonic times of a tiny all-to-all after a barrier, per
    repetition after one warm-up (the ranks share the machine's monotonic clock), then
    ``(0, calibrate's back-to-back call)``."""
    import torch

    from moesaic.comm.collectives import EPGroup

    group = EPGroup(None, timeout_s)
    send = torch.zeros(world * CALL_BYTES_PER_PAIR // 4)
    recv = torch.empty_like(send)
    out = []
    for _ in range(1 + reps):
        group.barrier("calibrate barrier")
        t0 = time.perf_counter()
        group.all_to_all_single(recv, send, what="a2a after the last arrival")
        out.append((t0, time.perf_counter()))
    back_to_back = back_to_back_a2a_s(group, recv, send)
    group.barrier("calibrate barrier")
    return [*out[1:], (0.0, back_to_back)]


def measure(text: str, reps: int = CALL_REPS, timeout_s: float = 120.0) -> tuple[float, dict]:
    """On the cluster ``text`` describes, brought up once: the alone all-reduce (seconds) and
    a tiny all-to-all three ways: after a barrier, the slowest rank's seconds (``calibrate``'s
    ``a2a_call_s`` until 2026-12-05) and, per rank, from the last rank's issue to its end (the
    call without the barrier's exit skew), each the mean over the repetitions; and back to
    back, the ranks' mean (``calibrate``'s since,
    :func:`moesaic.measure.calibrate.back_to_back_a2a_s`)."""
    path = Path(f"/tmp/alone_calls_{os.getpid()}.toml")
    path.write_text(text)
    spec = ClusterSpec.from_toml(path)
    with EmulatedCluster(spec) as cluster:
        alone = cluster.run(_worker, spec.world_size, reps, timeout_s, timeout_s=timeout_s)
        per_rank = cluster.run(_worker_a2a, spec.world_size, reps, timeout_s, timeout_s=timeout_s)
    slowest, after_last = [], []
    for i in range(reps):
        last_issue = max(r[i][0] for r in per_rank)
        slowest.append(max(r[i][1] - r[i][0] for r in per_rank))
        after_last.append(statistics.fmean(r[i][1] - last_issue for r in per_rank))
    a2a = {
        "slowest_s": statistics.fmean(slowest),
        "after_last_s": statistics.fmean(after_last),
        "back_to_back_s": statistics.fmean(r[-1][1] for r in per_rank),
    }
    return statistics.fmean(max(r[i] for r in alone) for i in range(reps)), a2a


def cluster_of(rule: int, name: str) -> str:
    """The configuration's cluster file text."""
    if rule >= 27:
        rules = wide.RULE_SETS.values()
        cfg = next(c for r in rules for c in r.configurations if c["name"] == name)
        return wide.cluster_toml(cfg)
    return su.cluster_toml(su.find_configuration(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rules", default="17-32", help="first-last")
    ap.add_argument("--out", default=str(RESULTS / "sim_alone_calls.json"))
    args = ap.parse_args()
    first, last = map(int, args.rules.split("-"))
    out_path = Path(args.out)
    out: dict[str, Any] = json.loads(out_path.read_text()) if out_path.exists() else {}
    out.setdefault("what", __doc__.split("\n\n")[0])
    out.setdefault("load_before", list(os.getloadavg()))
    seconds = out.setdefault("alone_call_s", {})
    a2a = out.setdefault("a2a_call", {})
    for rule in range(first, last + 1):
        data = json.loads((RESULTS / f"sim_unseen{rule}.json").read_text())
        for entry in data["configurations"]:
            key = f"{rule}/{entry['name']}"
            if key in seconds and "back_to_back_s" in a2a.get(key, {}):
                continue
            t0 = time.perf_counter()
            seconds[key], a2a[key] = measure(cluster_of(rule, entry["name"]))
            stored = entry["profile"].get("allreduce_call_s", 0.0)
            stored_a2a = entry["profile"].get("a2a_call_s", 0.0)
            print(
                f"{key}: alone {seconds[key] * 1e3:.2f} ms, the stream's call "
                f"{stored * 1e3:.2f} ms; all-to-all {a2a[key]['slowest_s'] * 1e3:.2f} ms "
                f"slowest, {a2a[key]['after_last_s'] * 1e3:.2f} ms after the last issue, "
                f"{a2a[key]['back_to_back_s'] * 1e3:.2f} ms back to back "
                f"(stored {stored_a2a * 1e3:.2f}) ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
            out_path.write_text(json.dumps(out, indent=1))
    out["load_after"] = list(os.getloadavg())
    out_path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
