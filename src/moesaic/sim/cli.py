"""``moesaic simulate`` and ``moesaic calibrate``.

``simulate`` reads a cluster TOML (``moesaic cluster``'s format), a model TOML
(:class:`moesaic.sim.model.ModelSpec`, or a ``moesaic train --config`` training config:
:func:`moesaic.sim.model.load_model_spec`) and optionally a profile (``calibrate``'s JSON), and
prints one iteration's summary per strategy (``--strategy all``: one row each); ``--json``
prints one JSON object (a list for ``all``). ``calibrate`` measures this machine's matmul rate
and op overhead (torch, under a second) and writes a profile; ``--cluster`` brings the emulated
cluster up and measures its links (:mod:`moesaic.sim.calibrate`, needs root), ``--links`` takes
the link figures from a committed cluster check result instead (no network is built).
Torch-free but for ``calibrate`` and ``--png`` (matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from moesaic.checks import check_number, check_output_file, check_positive_int

__all__ = ["add_subparser"]

EPILOG = """\
examples:
  moesaic simulate --cluster examples/clusters/flowmoe_2rank.toml \\
      --model examples/models/flowmoe_small.toml --strategy all
  moesaic simulate --cluster examples/clusters/hybridep_2dc.toml \\
      --model examples/models/hybridep_small.toml --strategy hybrid --json --trace t.json
  moesaic simulate --cluster examples/clusters/flowmoe_2rank.toml \\
      --model examples/train_tiny.toml --strategy flowmoe
  moesaic calibrate --out profile.json --links benchmarks/results/cluster_check.json
  sudo moesaic calibrate --out profile.json --cluster examples/clusters/flowmoe_2rank.toml
"""


def add_subparser(subparsers) -> None:
    """Adds ``simulate`` and ``calibrate`` to the top-level parser (whichever is asked for)."""
    p = subparsers.add_parser(
        "simulate",
        help="simulate a training iteration on a cluster (per strategy)",
        description="Simulate one training iteration of an MoE model on a cluster.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cluster", required=True, metavar="FILE.toml", help="cluster description")
    p.add_argument(
        "--model",
        required=True,
        metavar="FILE.toml",
        help="model and batch: a model file or a training config (`moesaic train --config`)",
    )
    p.add_argument("--strategy", default="all", help="a strategy name or 'all' (default)")
    p.add_argument("--profile", metavar="FILE.json", help="machine profile (moesaic calibrate)")
    p.add_argument(
        "--flops-per-s",
        type=float,
        metavar="X",
        help="matmul FLOP/s (> 0; default 1e11); with --profile, overrides its matmul rates",
    )
    p.add_argument(
        "--allow-profile-mismatch",
        action="store_true",
        help="use a --profile measured on another cluster (its figures extrapolated)",
    )
    p.add_argument("--degree", type=int, default=2, metavar="R", help="pipeline degree R")
    p.add_argument("--sp-bytes", type=float, metavar="B", help="FlowMoE Sp (default G/16)")
    p.add_argument("--domains", metavar="S0,S1,..", help="hybrid domain sizes (default: planned)")
    p.add_argument("--prefetch", action="store_true", help="hybrid: prefetched gathers")
    p.add_argument("--compression-ratio", type=float, default=1.0, metavar="CR",
                   help="hybrid: SR compression of gathered experts (+Migration)")  # fmt: skip
    p.add_argument("--shared-every", type=int, default=1, metavar="N",
                   help="hybrid: shared experts' all-reduce every N gathers")  # fmt: skip
    p.add_argument("--all-reduce", choices=("ring", "hierarchical", "best"), default="best",
                   help="gradient all-reduce algorithm: the faster of ring and hierarchical per "
                   "size, as NCCL picks (default), or gloo's ring")  # fmt: skip
    p.add_argument(
        "--trace", metavar="F.json", help="write a Chrome trace (one process per strategy)"
    )
    p.add_argument(
        "--png",
        metavar="F.png",
        help="draw the timeline (Gantt chart); several strategies: F.<strategy>.png each",
    )
    p.add_argument(
        "--csv",
        metavar="F.csv",
        help="write compute/communication per strategy, block and phase",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_simulate)
    c = subparsers.add_parser(
        "calibrate",
        help="measure this machine into a simulator profile",
        description="Measure matmul FLOP/s and op overhead, and the links of an emulated "
        "cluster (--cluster, needs root) or take them from a cluster check result (--links).",
    )
    c.add_argument("--out", required=True, metavar="FILE.json", help="profile to write")
    links = c.add_mutually_exclusive_group()
    links.add_argument("--cluster", metavar="FILE.toml",
                       help="emulate this cluster and measure its links (root)")  # fmt: skip
    links.add_argument("--links", metavar="CHECK.json", help="cluster_check result (links)")
    c.add_argument("--duration-s", type=float, default=0.3,
                   help="--cluster: seconds per bandwidth transfer (default 0.3)")  # fmt: skip
    c.add_argument("--sustain-s", type=float, default=1.0,
                   help="--cluster: warm-up of each loaded collective stream, seconds "
                   "(default 1.0; 0: idle collective shares only)")  # fmt: skip
    c.add_argument("--no-floor", action="store_true",
                   help="--cluster: skip the unshaped pair (floor_s = 0)")  # fmt: skip
    c.add_argument("--size", type=int, default=None,
                   help="matmul size (default 512 on a CPU, 4096 on a GPU)")  # fmt: skip
    c.set_defaults(func=run_calibrate)


def _load(option: str, path: str, load: Any) -> Any:
    try:
        return load(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"--{option}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"--{option} {path}: {exc}") from None


def _note(line: str) -> None:
    """One line on stderr (stdout stays the summary, or the JSON with ``--json``)."""
    print(f"moesaic simulate: {line}", file=sys.stderr)


def _check_profile(args: argparse.Namespace, profile: Any, spec: Any) -> None:
    """Refuses a profile measured on another cluster unless ``--allow-profile-mismatch``; says
    in one line when the profile does not record its cluster, or what is extrapolated."""
    from moesaic.sim.profile import describe_cluster

    if profile.cluster is None:
        if profile.cluster_bound:
            _note(
                f"--profile {args.profile} does not record the cluster it was measured on "
                f"(written before profiles did); its link and collective figures are applied "
                f"to {spec.name!r} unchecked"
            )
        return
    diff = profile.cluster_differences(spec)
    if not diff:
        return
    measured = (
        f"--profile {args.profile} was measured on {describe_cluster(profile.cluster)}, "
        f"not on --cluster {args.cluster} {describe_cluster(spec)}: {'; '.join(diff)}"
    )
    if not args.allow_profile_mismatch:
        raise ValueError(
            f"{measured}; its collective shares and link rates would be extrapolated "
            "(--allow-profile-mismatch does so)"
        )
    _note(
        f"--allow-profile-mismatch: extrapolating the collective shares and link rates of "
        f"{describe_cluster(profile.cluster)} to {describe_cluster(spec)} ({'; '.join(diff)})"
    )


def _profile(args: argparse.Namespace, spec: Any) -> Any:
    """``--profile`` (checked against the cluster) with ``--flops-per-s`` as an override of its
    matmul rates, or a profile of ``--flops-per-s`` (default 1e11) alone."""
    import dataclasses

    from moesaic.sim.profile import Profile

    flops = args.flops_per_s
    if flops is not None:
        check_number("--flops-per-s", flops, 0.0, lo_open=True)
    if not args.profile:
        return Profile(flops_per_s=1e11 if flops is None else flops, source="--flops-per-s")
    profile = _load("profile", args.profile, Profile.load)
    _check_profile(args, profile, spec)
    if flops is None:
        return profile
    half = f", bf16 {profile.half_flops_per_s:.3g}" if profile.half_flops_per_s else ""
    _note(
        f"--flops-per-s {flops:.3g} overrides the matmul rate of --profile {args.profile} "
        f"(fp32 {profile.flops_per_s:.3g}{half} FLOP/s) for every dtype; its other figures apply"
    )
    # half_flops_per_s = 0: a bf16 model runs at the given rate too (Profile.for_model).
    return dataclasses.replace(profile, flops_per_s=flops, half_flops_per_s=0.0)


def _strategies(args: argparse.Namespace, spec: Any, model: Any) -> tuple[str, ...]:
    """The strategies to run: the one named, or for ``all`` every one that can simulate this
    cluster and model (each left out named in one line)."""
    from moesaic.sim.simulate import STRATEGIES, unsupported_reason

    if args.strategy != "all":
        return (args.strategy,)
    skipped = {n: r for n in STRATEGIES if (r := unsupported_reason(spec, model, n)) is not None}
    names = tuple(n for n in STRATEGIES if n not in skipped)
    if not names:
        raise ValueError(
            "--strategy all: no strategy can simulate this cluster and model: "
            + "; ".join(f"{n}: {r}" for n, r in skipped.items())
        )
    if skipped:
        _note("--strategy all: skipping " + "; ".join(f"{n} ({r})" for n, r in skipped.items()))
    return names


def _results(args: argparse.Namespace) -> list[Any]:
    from moesaic.cluster.spec import ClusterSpec
    from moesaic.sim.model import load_model_spec
    from moesaic.sim.simulate import SimOptions, simulate

    spec = _load("cluster", args.cluster, ClusterSpec.from_toml)
    model = _load("model", args.model, load_model_spec)
    profile = _profile(args, spec)
    domains = None
    if args.domains:
        try:
            domains = tuple(int(x) for x in args.domains.split(","))
        except ValueError:
            raise ValueError(f"--domains ({args.domains!r}) must be integers: S0,S1,..") from None
    opts = SimOptions(degree=args.degree, sp_bytes=args.sp_bytes, domain_sizes=domains,
                      prefetch=args.prefetch, compression_ratio=args.compression_ratio,
                      shared_expert_every=args.shared_every,
                      all_reduce=args.all_reduce)  # fmt: skip
    return [simulate(spec, model, name, profile, opts) for name in _strategies(args, spec, model)]


def _png_paths(path: str, strategies: list[str]) -> list[Path]:
    """``--png F.png``: F.png for one strategy, ``F.<strategy>.png`` for each of several."""
    if len(strategies) == 1:
        return [Path(path)]
    p = Path(path)
    return [p.with_name(f"{p.stem}.{name}{p.suffix or '.png'}") for name in strategies]


def _write_outputs(args: argparse.Namespace, results: list[Any]) -> None:
    """``--trace``: one process per strategy, named by it; ``--png``: one chart per strategy;
    ``--csv``: one table with a strategy column."""
    from moesaic.sim.simulate import write_layer_csv
    from moesaic.trace import draw_timeline, write_chrome_trace

    names = [r.strategy for r in results]
    if args.trace:
        per = [[dataclasses.replace(s, rank=i) for s in r.spans] for i, r in enumerate(results)]
        write_chrome_trace(args.trace, per, process_names=dict(enumerate(names)))
    if args.png:
        paths = _png_paths(args.png, names)
        for path, r in zip(paths, results):
            draw_timeline(path, [r.spans], title=r.strategy)
        if len(paths) > 1:
            _note(f"--png: one chart per strategy: {', '.join(str(p) for p in paths)}")
    if args.csv:
        write_layer_csv(args.csv, {r.strategy: r.spans for r in results})


def run_simulate(args: argparse.Namespace) -> int:
    results = _results(args)
    _write_outputs(args, results)
    rows = [r.summary() for r in results]
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else rows))
        return 0
    cols = ("iteration_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "overlap_ratio",
            "bound_ms", "wall_s")  # fmt: skip
    print(f"{'strategy':10s} {'ranks':>6s} " + " ".join(f"{c:>15s}" for c in cols))
    for row in rows:
        vals = " ".join(f"{row[c]:15.4g}" for c in cols)
        print(f"{row['strategy']:10s} {row['ranks']:6d} {vals}")
    return 0


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
        floor_s, scale = _load("links", args.links, links_from_cluster_check)
        source = f"measured matmul {size}^3 here; links from {args.links}"
    elif args.cluster:
        from moesaic.cluster.spec import ClusterSpec
        from moesaic.sim.calibrate import measure_links

        spec = _load("cluster", args.cluster, ClusterSpec.from_toml)
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
        for name, c in cal.collectives.items():
            print(f"{name}: median {c['median_s'] * 1e3:.2f} ms, link-load bound "
                  f"{c['bound_s'] * 1e3:.2f} ms ({c['bound_s'] / c['median_s']:.2f} of it)")  # fmt: skip
        print(f"one-sided puts: {cal.put_cpu_s * 1e6:.0f} us CPU per put + "
              f"{cal.put_cpu_per_byte_s * 1e9:.2f} ns per byte")  # fmt: skip
        for x in shares:
            print(f"{x.kind} {x.regime} {x.bytes_per_rank / 1e3:.0f} kB/rank: "
                  f"{x.measured_s * 1e3:.2f} ms, "
                  f"share {x.share:.2f} of the links")  # fmt: skip
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
