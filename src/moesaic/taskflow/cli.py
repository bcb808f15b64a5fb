"""``moesaic taskflow show | compile | check``: inspect, write and validate static plans.

``show`` compiles one rank's plan and prints its queues, events and thresholds (and draws it with
``--png``); ``compile`` writes plan files; ``check`` loads plan files (validating each), refuses
files of different worlds (``Plan.world_settings``), runs the cross-rank check for every direction
whose ranks are all given, and says which checks ran.

Size guard: ``show`` and ``compile`` count the tasks they would build from split propagation alone
(``moe_graphs.task_count``, nothing is built) and refuse more than ``--max-tasks`` (default
``DEFAULT_MAX_TASKS``, about 10 s of compiling and validating on one core of a shared 2-core
machine; the DeepSeek-like EP=64 world is 84k tasks) with one line naming the estimate and the
options that change it.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from pathlib import Path

from moesaic.checks import check_positive_int
from moesaic.taskflow.bucket import CompileOptions, ShapeBucket, slot_rows_for
from moesaic.taskflow.compile import compile_plan, compile_world
from moesaic.taskflow.moe_graphs import task_count
from moesaic.taskflow.plan import Plan

DEFAULT_MAX_TASKS = 250_000


def _shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", type=int, required=True, help="E, experts over all ranks")
    p.add_argument("--tokens", type=int, required=True, help="T, tokens per rank")
    p.add_argument("--hidden", type=int, required=True, help="H")
    p.add_argument("--ffn", type=int, required=True, help="F, expert hidden width")
    p.add_argument("--topk", type=int, required=True, help="K")
    p.add_argument("--ep", type=int, default=1, help="P, expert-parallel size (default 1)")
    p.add_argument("--tile-m", type=int, default=128, help="dispatch tile rows (default 128)")
    p.add_argument("--gmm-tile-m", type=int, default=None, help="GMM tile rows (default tile-m)")
    p.add_argument(
        "--slot-rows",
        type=int,
        default=None,
        help="S, rows per (expert, source rank) slot; default: the balanced load ceil(T*K/E) "
        "rounded up to a multiple of the GMM tile",
    )
    p.add_argument("--activation", choices=("swiglu", "gelu"), default="swiglu")
    p.add_argument("--backward", action="store_true", help="the backward plan")
    p.add_argument("--no-ratr", action="store_true", help="disable rank-aware task reordering")
    p.add_argument("--no-interleave", action="store_true", help="disable GMM interleaving")
    p.add_argument("--unsplit", nargs="*", default=[], metavar="OP", help="force one task")
    p.add_argument(
        "--max-tasks",
        type=int,
        default=DEFAULT_MAX_TASKS,
        help="refuse to build more tasks than this in all (estimated before building; "
        f"default {DEFAULT_MAX_TASKS:,})",
    )


def _bucket(args) -> ShapeBucket:
    tile = args.gmm_tile_m or args.tile_m
    slot = args.slot_rows
    if slot is None:
        if min(args.tokens, args.topk, args.experts, tile) <= 0:
            raise ValueError("tokens, topk, experts and tile sizes must be > 0")
        slot = slot_rows_for(
            math.ceil(args.tokens * args.topk / args.experts), tile, power_of_two_tiles=False
        )
    return ShapeBucket(
        tokens=args.tokens,
        hidden=args.hidden,
        ffn=args.ffn,
        experts=args.experts,
        top_k=args.topk,
        ep_size=args.ep,
        slot_rows=slot,
        tile_m=args.tile_m,
        gmm_tile_m=args.gmm_tile_m,
        activation=args.activation,
    )


def _options(args) -> CompileOptions:
    return CompileOptions(
        ratr=not args.no_ratr, interleave=not args.no_interleave, unsplit=tuple(args.unsplit)
    )


def _direction(args) -> str:
    return "backward" if args.backward else "forward"


def _about(n: int) -> str:
    return f"{n}" if n < 1_000_000 else f"{n:.2g}"


def _guard_size(args, bucket: ShapeBucket, direction: str, ranks: int) -> None:
    """Refuse a request whose task count (from split propagation) exceeds ``--max-tasks``."""
    limit = check_positive_int("--max-tasks", args.max_tasks)
    per_rank = task_count(bucket, direction, tuple(args.unsplit))
    total = per_rank * ranks
    if total <= limit:
        return
    b = bucket
    world = f" x {ranks} ranks" if ranks > 1 else ""
    raise ValueError(
        f"the {direction} plan would have about {_about(total)} tasks ({_about(per_rank)} per "
        f"rank{world}: --tokens {b.tokens} in token tiles of --tile-m {b.tile_m}, "
        f"{b.experts} experts x --slot-rows {b.slot_rows} in tiles of {b.gmm_rows}), more than "
        f"--max-tasks {limit}; use a larger --tile-m / --gmm-tile-m, fewer --tokens or a "
        "smaller --slot-rows, or pass --max-tasks N to build it anyway"
    )


def _task_line(plan: Plan, uid: int) -> str:
    t = plan.tasks[uid]
    wait = (
        "-"
        if t.dependent_event < 0
        else (f"ev{t.dependent_event}/{plan.events[t.dependent_event].threshold}")
    )
    trig = ",".join(
        f"ev{r.event}" if r.rank == plan.rank else f"r{r.rank}:ev{r.event}"
        for r in t.trigger_events
    )
    where = f"expert {t.expert}" if t.expert >= 0 else "all experts"
    if t.peer >= 0:
        where += f" -> rank {t.peer}"
    rows = "+".join(f"{r.buffer}[{r.start}:{r.stop}]" for r in t.outputs[:2])
    more = "+..." if len(t.outputs) > 2 else ""
    return (
        f"  {uid:>6}  {t.label:<22} {where:<22} wait {wait:<12} trigger {trig or '-':<14} "
        f"writes {rows}{more}"
    )


def _first(n: int, limit: int) -> str:
    return f", first {limit}" if n > limit else ""


def format_plan(plan: Plan, limit: int) -> str:
    """The text printed by ``show``."""
    b, s = plan.bucket, plan.summary()
    thr = Counter(ev.threshold for ev in plan.events)
    lines = [
        f"taskflow {plan.direction} plan, rank {plan.rank} of EP {b.ep_size} "
        f"(version {plan.version}, world {plan.world_fingerprint})",
        f"bucket: T={b.tokens} H={b.hidden} F={b.ffn} E={b.experts} K={b.top_k} "
        f"S={b.slot_rows} tile_m={b.tile_m} gmm_tile_m={b.gmm_rows} {b.activation}",
        f"options: ratr={plan.options.ratr} interleave={plan.options.interleave} "
        f"unsplit={list(plan.options.unsplit)}",
        "split propagation: "
        + ", ".join(f"{op} {n}" for op, n in plan.task_num.items())
        + f" (fell back: {', '.join(plan.fell_back) or '-'})",
        f"tasks {s['tasks']}: matrix queue {s['matrix_tasks']}, vector queue "
        f"{s['vector_tasks']}; events {s['events']}; remote writes {s['remote_writes']}; "
        f"triggers {s['triggers']}",
        "thresholds: " + ", ".join(f"{k} x{v}" for k, v in sorted(thr.items())),
    ]
    for name, q in plan.schedule.queues:
        lines.append(f"{name} queue ({len(q)} tasks{_first(len(q), limit)}):")
        lines += [_task_line(plan, uid) for uid in q[:limit]]
    lines.append(f"events ({len(plan.events)}{_first(len(plan.events), limit)}):")
    for ev in plan.events[:limit]:
        prods = Counter(p.op if p.rank == plan.rank else f"{p.op}@remote" for p in ev.producers)
        lines.append(
            f"  ev{ev.id:<5} threshold {ev.threshold:<5} producers "
            + ", ".join(f"{n} x {op}" for op, n in prods.items())
        )
    return "\n".join(lines)


def _show(args) -> int:
    bucket, options, direction = _bucket(args), _options(args), _direction(args)
    if not 0 <= args.rank < bucket.ep_size:
        raise ValueError(f"rank ({args.rank}) must be in [0, ep={bucket.ep_size})")
    _guard_size(args, bucket, direction, 1)
    plan = compile_plan(bucket, direction, args.rank, options)
    print(format_plan(plan, args.limit))
    if args.png:
        from moesaic.taskflow.draw import draw_plan

        # A whole-world simulation places remote arrivals honestly; skip it for big worlds.
        world = None
        if bucket.ep_size * len(plan.tasks) <= 50_000:
            world = compile_world(bucket, direction, options)
        out = draw_plan(plan, args.png, world=world)
        print(f"wrote {out}")
    return 0


def _compile(args) -> int:
    from moesaic.taskflow.plan_io import plan_filename, save_plan

    bucket, options, direction = _bucket(args), _options(args), _direction(args)
    _guard_size(args, bucket, direction, bucket.ep_size if args.rank is None else 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.rank is None:
        plans = compile_world(bucket, direction, options)
    else:
        plans = [compile_plan(bucket, direction, args.rank, options)]
    for p in plans:
        print(save_plan(p, out / plan_filename(p)))
    return 0


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _check(args) -> int:
    from moesaic.taskflow.plan_io import load_plan
    from moesaic.taskflow.validate import PlanError
    from moesaic.taskflow.validate_world import PlanWorldError, check_world, world_mismatch

    plans: list[Plan] = []
    for f in args.files:
        try:
            plans.append(load_plan(f))
        except PlanError as exc:
            raise type(exc)(f"{f}: {exc}") from None
    for f, p in zip(args.files, plans):
        print(
            f"{f}: ok ({p.direction}, rank {p.rank} of EP {p.bucket.ep_size}, "
            f"{len(p.tasks)} tasks, {len(p.events)} events, world {p.world_fingerprint})"
        )
    names = [Path(f).name for f in args.files]
    for name, p in zip(names[1:], plans[1:]):
        diff = world_mismatch(plans[0], p)
        if diff is not None:
            raise PlanWorldError(
                f"{names[0]} and {name} belong to different worlds: {diff}; the plans of one "
                "world are compiled with the same shapes and options"
            )
    n = len(plans)
    print(
        f"per-plan checks: {n} file{'s' if n > 1 else ''} ok (format, regions, events, "
        "schedule, no single-rank deadlock)"
    )
    P = plans[0].bucket.ep_size
    for direction in ("forward", "backward"):
        given: dict[int, str] = {}
        for name, p in zip(names, plans):
            if p.direction != direction:
                continue
            if p.rank in given:
                raise PlanWorldError(
                    f"rank {p.rank}'s {direction} plan is given twice ({given[p.rank]}, {name})"
                )
            given[p.rank] = name
        if not given:
            continue
        missing = sorted(set(range(P)) - set(given))
        if missing:
            print(
                f"cross-rank check ({direction}): NOT run, {_ranks(missing)} of {P} missing "
                "(give every rank's plan to check that puts match and no rank waits forever)"
            )
            continue
        check_world(sorted((p for p in plans if p.direction == direction), key=lambda p: p.rank))
        print(
            f"cross-rank check ({direction}): ok, ranks 0-{P - 1} (every put matches its "
            f"receiver's record, no deadlock of all {2 * P} queues)"
        )
    return 0


def add_subparser(subparsers) -> None:
    """Add ``taskflow show | compile | check`` to the top-level ``moesaic`` parser."""
    p = subparsers.add_parser("taskflow", help="compile, inspect and check static MoE taskflows")
    sub = p.add_subparsers(dest="taskflow_command", metavar="SUBCOMMAND", required=True)
    show = sub.add_parser("show", help="print (and draw) one rank's plan")
    _shape_args(show)
    show.add_argument("--rank", type=int, default=0)
    show.add_argument("--png", default=None, help="also draw the plan to this PNG")
    show.add_argument("--limit", type=int, default=40, help="tasks/events listed per table")
    show.set_defaults(func=_show)
    comp = sub.add_parser("compile", help="write plan files (every rank unless --rank)")
    _shape_args(comp)
    comp.add_argument("--rank", type=int, default=None)
    comp.add_argument("--out", required=True, help="directory for the plan files")
    comp.set_defaults(func=_compile)
    check = sub.add_parser("check", help="load and validate plan files")
    check.add_argument("files", nargs="+")
    check.set_defaults(func=_check)
