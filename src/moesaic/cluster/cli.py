"""``moesaic cluster up | down | check | show``: the emulated cluster from the command line.

* ``up --cluster FILE`` builds the cluster and holds it (until Ctrl-C, SIGTERM or ``--hold-s``),
  printing the namespaces and addresses as JSON (also written to ``--state FILE``). Run commands
  on a rank with ``ip netns exec <namespace> ...``. The cluster is removed when ``up`` ends.
* ``down [--run-id ID [--force]]`` removes what killed runs left behind (``msc-<id>-*``
  namespaces, every process inside them, their temp directories). A cluster that is still up
  (its owner process alive) is kept, with a line saying so, unless named with ``--run-id`` and
  ``--force``; ``up`` then notices that its network is gone and exits 1.
* ``check --cluster FILE`` builds the cluster, measures it (:mod:`moesaic.cluster.verify`),
  prints configured vs measured values, optionally writes JSON, and exits 1 if a level is off by
  more than the tolerance.
* ``show --cluster FILE`` validates a description and prints its levels and per-level paths
  (needs no root).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["add_subparser"]


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``cluster`` and its subcommands to the top-level ``moesaic`` parser."""
    parser = subparsers.add_parser(
        "cluster",
        help="emulated multi-level cluster in network namespaces",
        description="Emulate a multi-level cluster with network namespaces and shaped links.",
    )
    sub = parser.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND", required=True)

    up = sub.add_parser("up", help="build the cluster and hold it until Ctrl-C")
    up.add_argument("--cluster", required=True, type=Path, help="cluster description (TOML)")
    up.add_argument("--hold-s", type=float, default=3600.0, help="tear down after this long")
    up.add_argument("--state", type=Path, help="also write the cluster's description here")
    up.add_argument("--mtu-bytes", type=int, default=9000)
    up.set_defaults(func=_cmd_up)

    down = sub.add_parser("down", help="remove namespaces and processes left by crashed runs")
    down.add_argument("--run-id", help="only this run (6 hex digits); default: every stale run")
    down.add_argument(
        "--force", action="store_true", help="remove --run-id even if its cluster is still up"
    )
    down.set_defaults(func=_cmd_down)

    check = sub.add_parser("check", help="measure the emulated links against the description")
    check.add_argument("--cluster", required=True, type=Path, help="cluster description (TOML)")
    check.add_argument("--json", type=Path, help="write the report here")
    check.add_argument("--tolerance", type=float, default=0.15, help="relative, default 0.15")
    check.add_argument("--duration-s", type=float, default=0.3, help="per bandwidth transfer")
    check.add_argument("--timeout-s", type=float, default=300.0)
    check.set_defaults(func=_cmd_check)

    show = sub.add_parser("show", help="validate a description and print its paths")
    show.add_argument("--cluster", required=True, type=Path, help="cluster description (TOML)")
    show.set_defaults(func=_cmd_show)


def _cmd_show(args: argparse.Namespace) -> int:
    from moesaic.cluster.spec import ClusterSpec

    spec = ClusterSpec.from_toml(args.cluster)
    print(f"{spec.name}: {spec.world_size} ranks, levels outermost first")
    for level, (a, b) in spec.representative_pairs().items():
        path = spec.path(a, b)
        lv = spec.levels[level]
        print(
            f"  {lv.name:<14} size {lv.size:<4} link {lv.bandwidth_gbps:g} Gbit/s; "
            f"ranks {a}-{b}: path {path.bandwidth_gbps:g} Gbit/s, {path.latency_ms:g} ms one way"
        )
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from moesaic.checks import check_positive
    from moesaic.cluster.netns import EmulatedCluster
    from moesaic.cluster.spec import ClusterSpec

    check_positive("--hold-s", args.hold_s)
    spec = ClusterSpec.from_toml(args.cluster)
    with EmulatedCluster(spec, mtu_bytes=args.mtu_bytes) as cluster:
        info = json.dumps(cluster.describe(), indent=2)
        if args.state:
            args.state.write_text(info + "\n")
        print(info, flush=True)
        print(
            f"cluster {cluster.run_id} is up; run on a rank with "
            f"`ip netns exec {cluster.rank_namespaces[0]} <command>`. Ctrl-C to tear down.",
            file=sys.stderr,
            flush=True,
        )
        try:
            missing = _hold(cluster, args.hold_s)
        except KeyboardInterrupt:
            missing = []
    if missing:
        print(
            f"cluster {cluster.run_id} was removed from outside (`moesaic cluster down --force`?): "
            f"namespace(s) {' '.join(missing)} are gone",
            file=sys.stderr,
        )
        return 1
    print(f"cluster {cluster.run_id} is down", file=sys.stderr)
    return 0


def _hold(cluster, hold_s: float, check_every_s: float = 1.0) -> list[str]:
    """Waits ``hold_s``; returns the cluster's namespaces that vanished meanwhile (stops then)."""
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline:
        time.sleep(min(check_every_s, max(0.0, deadline - time.monotonic())))
        missing = cluster.missing_namespaces()
        if missing:
            return missing
    return []


def _cmd_down(args: argparse.Namespace) -> int:
    import re

    from moesaic.cluster.lifecycle import down

    if args.run_id is not None and not re.fullmatch(r"[0-9a-f]{6}", args.run_id):
        raise ValueError(f"--run-id ({args.run_id!r}) must be 6 lowercase hex digits")
    if args.force and args.run_id is None:
        raise ValueError("--force needs --run-id: a live cluster is only ever removed by name")
    report = down(args.run_id, force=args.force)
    for line in report.lines():
        print(line)
    # Asked to remove one cluster and it is still up: the request was refused.
    return 1 if args.run_id is not None and report.kept else 0


def _cmd_check(args: argparse.Namespace) -> int:
    from moesaic.cluster.netns import EmulatedCluster
    from moesaic.cluster.spec import ClusterSpec
    from moesaic.cluster.verify import check

    spec = ClusterSpec.from_toml(args.cluster)
    with EmulatedCluster(spec) as cluster:
        report = check(
            cluster,
            tolerance=args.tolerance,
            timeout_s=args.timeout_s,
            duration_s=args.duration_s,
        )
    print(report.table())
    if args.json:
        args.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0 if report.ok else 1
