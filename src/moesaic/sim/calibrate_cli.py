"""``moesaic calibrate``: measure this machine (and an emulated cluster's links) into a
simulator profile (:class:`moesaic.sim.profile.Profile`).

It measures this machine's matmul rate and op overhead (torch, under a second) and writes a
profile; ``--cluster`` brings the emulated cluster up and measures its links
(:mod:`moesaic.sim.calibrate`, needs root), ``--links`` takes the link figures from a committed
cluster check result instead (no network is built).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from moesaic.checks import check_output_file, check_positive_int
from moesaic.sim.cli_files import load_option

__all__ = ["add_calibrate", "run_calibrate"]


def add_calibrate(subparsers) -> None:
    """Adds ``calibrate`` to the top-level parser."""
    c = subparsers.add_parser(
        "calibrate",
        help="measure this machine into a simulator profile",
        description="Measure matmul FLOP/s and op overhead, and the links of an emulated "
        "cluster (--cluster, needs root) or take them from a cluster check result (--links).",
    )
    c.add_argument("--out", required=True, metavar="FILE.json", help="profile to write")
    links = c.add_mutually_exclusive_group()
    links.add_argument(
        "--cluster", metavar="FILE.toml", help="emulate this cluster and measure its links (root)"
    )
    links.add_argument("--links", metavar="CHECK.json", help="cluster_check result (links)")
    c.add_argument(
        "--duration-s",
        type=float,
        default=0.3,
        help="--cluster: seconds per bandwidth transfer (default 0.3)",
    )
    c.add_argument(
        "--sustain-s",
        type=float,
        default=1.0,
        help="--cluster: warm-up of each loaded collective stream, seconds "
        "(default 1.0; 0: idle collective shares only)",
    )
    c.add_argument(
        "--no-floor",
        action="store_true",
        help="--cluster: skip the unshaped pair (floor_s = 0)",
    )
    c.add_argument(
        "--size",
        type=int,
        default=None,
        help="matmul size (default 512 on a CPU, 4096 on a GPU)",
    )
    c.set_defaults(func=run_calibrate)


def _print_calibration(cal: Any, shares: tuple[Any, ...]) -> None:
    """What ``--cluster`` measured: the collectives, the puts' CPU, the shares."""
    for name, c in cal.collectives.items():
        median, bound = c["median_s"], c["bound_s"]
        print(
            f"{name}: median {median * 1e3:.2f} ms, link-load bound {bound * 1e3:.2f} ms "
            f"({bound / median:.2f} of it)"
        )
    print(
        f"one-sided puts: {cal.put_cpu_s * 1e6:.0f} us CPU per put + "
        f"{cal.put_cpu_per_byte_s * 1e9:.2f} ns per byte"
    )
    for x in shares:
        print(
            f"{x.kind} {x.regime} {x.bytes_per_rank / 1e3:.0f} kB/rank: "
            f"{x.measured_s * 1e3:.2f} ms, share {x.share:.2f} of the links"
        )


def run_calibrate(args: argparse.Namespace) -> int:
    import torch

    from moesaic.sim.profile import (
        Profile,
        default_matmul_size,
        links_from_cluster_check,
        measure,
    )

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = default_matmul_size(device) if args.size is None else args.size
    check_positive_int("--size", size)
    check_output_file("--out", args.out)  # before the measurement, not after it
    measured = measure(size)
    floor_s, scale, source = 0.0, 1.0, f"measured matmul {size}^3 here; links as specified"
    links: tuple[Any, ...] = ()
    shares: tuple[Any, ...] = ()
    cpu: dict[str, Any] = {}
    if args.links:
        floor_s, scale = load_option("links", args.links, links_from_cluster_check)
        source = f"measured matmul {size}^3 here; links from {args.links}"
    elif args.cluster:
        from moesaic.cluster.spec import ClusterSpec
        from moesaic.sim.calibrate import measure_links

        spec = load_option("cluster", args.cluster, ClusterSpec.from_toml)
        cal = measure_links(
            spec, duration_s=args.duration_s, floor=not args.no_floor, sustain_s=args.sustain_s
        )
        floor_s, scale, links, shares = cal.floor_s, cal.bandwidth_scale, cal.links, cal.shares
        # The emulated ranks all run on this machine and share its cores.
        cpu = {
            "put_cpu_s": cal.put_cpu_s,
            "put_cpu_per_byte_s": cal.put_cpu_per_byte_s,
            "cores": os.cpu_count() or 0,
            "ranks_per_machine": spec.world_size,
            "cluster": spec,  # what was measured: simulate checks it against its cluster
        }
        floor = "no floor" if args.no_floor else "floor from an unshaped pair"
        source = (
            f"measured matmul {size}^3 here; links measured on the emulated "
            f"{args.cluster} ({floor})"
        )
        _print_calibration(cal, shares)
    profile = Profile(
        flops_per_s=measured["flops_per_s"],
        half_flops_per_s=measured["half_flops_per_s"],
        task_overhead_s=measured["task_overhead_s"],
        floor_s=floor_s,
        bandwidth_scale=scale,
        source=source,
        links=links,
        collectives=shares,
        **cpu,
    )
    profile.save(args.out)
    print(json.dumps(profile.to_dict()))
    return 0
