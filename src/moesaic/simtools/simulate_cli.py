"""``moesaic simulate`` (and ``moesaic calibrate``, :mod:`moesaic.simtools.calibrate_cli`).

``simulate`` reads a cluster TOML (``moesaic cluster``'s format), a model TOML
(:class:`moesaic.sim.model.ModelSpec`, or a ``moesaic train --config`` training config:
:func:`moesaic.train.model_files.load_model_spec`) and optionally a profile (``calibrate``'s JSON), and
prints one iteration's summary per run, a strategy (``--strategy``) under a schedule
(``--schedule``), either of them ``all`` for every valid pair (:mod:`moesaic.sim.runs`);
``--json`` prints one JSON object (a list for several runs). ``--measured F.json`` simulates
every point of a measured result instead and prints simulated against measured
(:mod:`moesaic.simtools.compare`). Torch-free but for ``--png`` (matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from moesaic.checks import check_number
from moesaic.schedule_table import DEFAULT_SCHEDULE
from moesaic.simtools.calibrate_cli import add_calibrate
from moesaic.simtools.cli_files import (
    add_all_reduce_option,
    add_loads_option,
    add_retime_option,
    apply_loads,
    check_profile,
    load_option,
    retimed,
)
from moesaic.strategies.hybrid_options import SHARED_EXPERTS

__all__ = ["add_subparser"]

EPILOG = """\
strategies: dropless, padded, hybrid, taskflow; schedules: vanilla, moe-only, flowmoe
(taskflow runs vanilla only). The old mixed names vanilla, moe-only, flowmoe (dropless under
that schedule) and ep (hybrid with domains of 1 under vanilla) still work as --strategy, with a
deprecation note.

examples:
  moesaic simulate --cluster examples/clusters/flowmoe_2rank.toml \\
      --model examples/models/flowmoe_small.toml --strategy all --schedule all
  moesaic simulate --cluster examples/clusters/hybridep_2dc.toml \\
      --model examples/models/hybridep_small.toml --strategy hybrid --schedule flowmoe \\
      --json --trace t.json
  moesaic simulate --cluster examples/clusters/flowmoe_2rank.toml \\
      --model examples/train_tiny.toml --strategy dropless --schedule flowmoe
  moesaic simulate --cluster examples/clusters/flowmoe_2rank.toml \\
      --model examples/models/flowmoe_small.toml --profile P.json \\
      --measured benchmarks/results/flowmoe_cluster.json
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
    p.add_argument(
        "--strategy",
        metavar="NAME",
        help="dropless, padded, hybrid, taskflow or 'all' (default)",
    )
    p.add_argument(
        "--schedule",
        metavar="NAME",
        help="vanilla, moe-only, flowmoe or 'all' (default: all with --strategy all, else vanilla)",
    )
    p.add_argument(
        "--measured",
        metavar="F.json",
        help="simulate every point of a measured result (each with its own strategy, schedule, "
        "R, Sp, domains) and print simulated against measured",
    )
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
    add_retime_option(p)
    p.add_argument("--degree", type=int, default=2, metavar="R", help="pipeline degree R")
    p.add_argument("--sp-bytes", type=float, metavar="B", help="FlowMoE Sp (default G/16)")
    p.add_argument("--domains", metavar="S0,S1,..", help="hybrid domain sizes (default: planned)")
    p.add_argument("--prefetch", action="store_true", help="hybrid: prefetched gathers")
    p.add_argument(
        "--compression-ratio",
        type=float,
        default=1.0,
        metavar="CR",
        help="hybrid: SR compression of gathered experts (+Migration)",
    )
    p.add_argument(
        "--shared-every",
        type=int,
        default=1,
        metavar="N",
        help="hybrid: shared experts' all-reduce every N gathers",
    )
    p.add_argument(
        "--shared-expert",
        choices=SHARED_EXPERTS,
        default="domain",
        help="hybrid: what the shared expert of a compressed gather is the mean of",
    )
    add_all_reduce_option(p)
    add_loads_option(p)
    p.add_argument("--trace", metavar="F.json", help="write a Chrome trace (one process per run)")
    p.add_argument(
        "--png",
        metavar="F.png",
        help="draw the timeline (Gantt chart); several runs: F.<strategy>+<schedule>.png each",
    )
    p.add_argument(
        "--csv",
        metavar="F.csv",
        help="write compute/communication per run (strategy, schedule), block and phase",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_simulate)
    add_calibrate(subparsers)


def _note(line: str) -> None:
    """One line on stderr (stdout stays the summary, or the JSON with ``--json``)."""
    print(f"moesaic simulate: {line}", file=sys.stderr)


def _profile(args: argparse.Namespace, spec: Any) -> Any:
    """``--profile`` (checked against the cluster) with ``--flops-per-s`` as an override of its
    matmul rates, or a profile of ``--flops-per-s`` (default 1e11) alone."""
    import dataclasses

    from moesaic.sim.profile import Profile

    flops = args.flops_per_s
    if flops is not None:
        check_number("--flops-per-s", flops, 0.0, lo_open=True)
    if not args.profile:
        retimed(args, None, note=_note)  # refuses --retime without a profile
        return Profile(flops_per_s=1e11 if flops is None else flops, source="--flops-per-s")
    profile = load_option("profile", args.profile, Profile.load)
    check_profile(args, profile, spec, note=_note)
    profile = retimed(args, profile, note=_note)
    if flops is None:
        return profile
    half = f", bf16 {profile.half_flops_per_s:.3g}" if profile.half_flops_per_s else ""
    _note(
        f"--flops-per-s {flops:.3g} overrides the matmul rate of --profile {args.profile} "
        f"(fp32 {profile.flops_per_s:.3g}{half} FLOP/s) for every dtype; its other figures apply"
    )
    # half_flops_per_s = 0: a bf16 model runs at the given rate too (Profile.for_model).
    return dataclasses.replace(profile, flops_per_s=flops, half_flops_per_s=0.0)


def _runs(args: argparse.Namespace, spec: Any, model: Any, opts: Any) -> list[tuple[Any, Any]]:
    """``(run, options)`` to simulate: the pair named, or with ``all`` every valid pair that can
    simulate this cluster and model (the ones left out named in one line); an old mixed name
    with a deprecation note."""
    from moesaic.sim.runs import legacy_run, runs, unsupported_reason

    strategy = args.strategy or "all"
    legacy = legacy_run(strategy, spec.num_levels)
    if legacy is not None:
        return [_legacy(args, *legacy, opts)]
    schedule = args.schedule or ("all" if strategy == "all" else DEFAULT_SCHEDULE)
    try:
        chosen = runs(strategy, schedule)
    except ValueError as exc:
        raise ValueError(f"--strategy {strategy} --schedule {schedule}: {exc}") from None
    if "all" not in (strategy, schedule):
        return [(chosen[0], opts)]
    reasons = {run: unsupported_reason(spec, model, run) for run in chosen}
    skipped: dict[str, list[str]] = {}
    for run, reason in reasons.items():
        if reason is not None:
            skipped.setdefault(reason, []).append(run.name)
    flags = (("strategy", strategy), ("schedule", schedule))
    what = " ".join(f"--{k} all" for k, v in flags if v == "all")
    left_out = "; ".join(f"{', '.join(names)} ({reason})" for reason, names in skipped.items())
    kept = [(run, opts) for run, reason in reasons.items() if reason is None]
    if not kept:
        raise ValueError(f"{what}: no run can simulate this cluster and model: {left_out}")
    if left_out:
        _note(f"{what}: skipping {left_out}")
    return kept


def _legacy(args: argparse.Namespace, run: Any, domains: Any, opts: Any) -> tuple[Any, Any]:
    """An old mixed ``--strategy`` name read as ``run`` (and ``domains``), with a deprecation
    note."""
    flags = f"--strategy {run.strategy} --schedule {run.schedule}"
    if domains is not None:
        opts = dataclasses.replace(opts, domain_sizes=domains)
        flags += " --domains " + ",".join(map(str, domains))
    if args.schedule is not None:
        raise ValueError(
            f"--strategy {args.strategy} is the old name of {flags}: with --schedule, give a "
            "strategy (dropless, padded, hybrid, taskflow)"
        )
    _note(
        f"--strategy {args.strategy} is deprecated (strategy and schedule are separate options "
        f"now): read as {flags}"
    )
    return run, opts


def _options(args: argparse.Namespace) -> Any:
    from moesaic.sim.simulate import SimOptions

    domains = None
    if args.domains:
        try:
            domains = tuple(int(x) for x in args.domains.split(","))
        except ValueError:
            raise ValueError(f"--domains ({args.domains!r}) must be integers: S0,S1,..") from None
    return SimOptions(
        degree=args.degree,
        sp_bytes=args.sp_bytes,
        domain_sizes=domains,
        prefetch=args.prefetch,
        compression_ratio=args.compression_ratio,
        shared_expert_every=args.shared_every,
        shared_expert=args.shared_expert,
        all_reduce=args.all_reduce,
    )


def _inputs(args: argparse.Namespace) -> tuple[Any, Any, Any, Any, Any]:
    """The cluster, the model, the profile, the options the flags give and the routing prior
    the model's loads come from (None: known loads)."""
    from moesaic.cluster.spec import ClusterSpec
    from moesaic.train.model_files import load_model_spec

    spec = load_option("cluster", args.cluster, ClusterSpec.from_toml)
    model = load_option("model", args.model, load_model_spec)
    profile = _profile(args, spec)
    # --measured re-simulates measured points as their files give them: no routing prior
    world = None if args.measured else spec.world_size
    model, prior = apply_loads(args, model, note=_note, profile=profile, world=world)
    return spec, model, profile, _options(args), prior


def _png_paths(path: str, names: list[str]) -> list[Path]:
    """``--png F.png``: F.png for one run, ``F.<strategy>+<schedule>.png`` for each of several."""
    if len(names) == 1:
        return [Path(path)]
    p = Path(path)
    return [p.with_name(f"{p.stem}.{name}{p.suffix or '.png'}") for name in names]


def _write_outputs(args: argparse.Namespace, results: list[Any]) -> None:
    """``--trace``: one process per run, named by it; ``--png``: one chart per run; ``--csv``:
    one table with strategy and schedule columns."""
    from moesaic.sim.runs import Run
    from moesaic.sim.simulate import write_layer_csv
    from moesaic.trace import draw_timeline, write_chrome_trace

    names = [r.name for r in results]
    if args.trace:
        per = [[dataclasses.replace(s, rank=i) for s in r.spans] for i, r in enumerate(results)]
        write_chrome_trace(args.trace, per, process_names=dict(enumerate(names)))
    if args.png:
        paths = _png_paths(args.png, names)
        for path, r in zip(paths, results):
            draw_timeline(path, [r.spans], title=r.name)
        if len(paths) > 1:
            _note(f"--png: one chart per run: {', '.join(str(p) for p in paths)}")
    if args.csv:
        write_layer_csv(args.csv, {Run(r.strategy, r.schedule): r.spans for r in results})


COLUMNS = (
    "iteration_ms",
    "compute_ms",
    "comm_ms",
    "exposed_comm_ms",
    "overlap_ratio",
    "bound_ms",
    "wall_s",
)


def run_simulate(args: argparse.Namespace) -> int:
    """``moesaic simulate``: the runs' summaries (a table, or JSON), and their outputs."""
    if args.measured:
        return _run_measured(args)
    from moesaic.sim.simulate import simulate
    from moesaic.sim.uncertainty import prediction_range

    spec, model, profile, opts, prior = _inputs(args)
    jobs = _runs(args, spec, model, opts)
    results = [simulate(spec, model, r.strategy, profile, o, schedule=r.schedule) for r, o in jobs]
    spread = (
        []
        if prior is None
        else [dataclasses.replace(model, measured_loads=prior.rows(i)) for i in (0, 2)]
    )
    for line in dict.fromkeys(x for r in results for x in r.details.get("extrapolated", ())):
        _note(f"--profile: {line}")  # the profile's operations were measured on another model
    _write_outputs(args, results)
    rows = [r.summary() for r in results]
    for row, (run, o) in zip(rows, jobs):  # the range: the error band (and the prior's spread)
        ends = [simulate(spec, m, run.strategy, profile, o, schedule=run.schedule) for m in spread]
        point = row["iteration_ms"]
        ms = [e.iteration_s * 1e3 for e in ends]
        row["range_ms"] = list(prediction_range(run.strategy, run.schedule, point, *ms))
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else rows))
        return 0
    head = " ".join(f"{c:>15s}" for c in COLUMNS)
    print(f"{'strategy':9s} {'schedule':9s} {'ranks':>6s} {head} range_ms")
    for row in rows:
        vals = " ".join(f"{row[c]:15.4g}" for c in COLUMNS)
        lo, hi = row["range_ms"]
        print(
            f"{row['strategy']:9s} {row['schedule']:9s} {row['ranks']:6d} {vals} {lo:.4g}-{hi:.4g}"
        )
    for row in rows:  # moesaic.sim.memory (sim.simulate.memory_details)
        peak = row.get("peak_bytes_per_rank")
        print(
            f"memory   {row['name']}: predicted peak {peak / 2**20:.1f} MiB per rank "
            f"(unsharded, EP = {row['ranks']})"
            if peak is not None
            else f"memory   {row['name']}: {row['memory_note']}"
        )
    return 0


def _run_measured(args: argparse.Namespace) -> int:
    """``--measured F.json``: every point simulated with its own run and knobs, against its
    measured time (:mod:`moesaic.simtools.compare`)."""
    from moesaic.simtools.compare import compare, geomean_abs_error, load_measured

    given = [f"--{k}" for k in ("strategy", "schedule") if getattr(args, k) is not None]
    given += [f"--{k}" for k in ("trace", "png", "csv") if getattr(args, k)]
    if given:
        raise ValueError(
            f"--measured simulates each point of the file with its own strategy and schedule "
            f"and prints the comparison only: leave out {', '.join(given)}"
        )
    spec, model, profile, opts, _ = _inputs(args)
    points = load_option("measured", args.measured, lambda path: load_measured(path, spec))
    rows = compare(spec, model, profile, points, opts)
    if args.json:
        print(json.dumps(rows))
        return 0
    width = max(len("point"), *(len(r["point"]) for r in rows))
    head = f"{'R':>2s} {'measured_ms':>12s} {'simulated_ms':>12s} {'error':>8s}"
    print(f"{'point':{width}s} {'run':18s} {head}")
    for r in rows:
        print(
            f"{r['point']:{width}s} {r['name']:18s} {r.get('degree', 1):2d} "
            f"{r['measured_ms']:12.1f} {r['simulated_ms']:12.1f} {100 * r['error']:+7.1f}%"
        )
    print(f"geometric-mean |error| over {len(rows)} points: {100 * geomean_abs_error(rows):.1f}%")
    return 0
