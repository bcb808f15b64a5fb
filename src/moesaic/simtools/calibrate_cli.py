"""``moesaic calibrate``: measure this machine (and an emulated cluster's links) into a
simulator profile (:class:`moesaic.sim.profile.Profile`).

It measures this machine's matmul rate and op overhead (torch, under a second) and writes a
profile; ``--cluster`` brings the emulated cluster up and measures its links
(:mod:`moesaic.measure.calibrate`, needs root), ``--links`` takes the link figures from a committed
cluster check result instead (no network is built). ``--model`` times the model's own operations
on this machine (:mod:`moesaic.measure.opmeasure`, seconds) into the profile's ``ops``, from which
the simulator prices its compute (:mod:`moesaic.sim.opcal`); with ``--cluster`` too, its experts
are spread over the cluster's ranks and timed with the threads each rank trains with. A
training config's router is also run on its data for its first steps (:mod:`moesaic.train.routing_run`,
seconds): the profile's ``routing``, which the simulator prices instead of uniform routing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from moesaic.checks import check_int, check_non_negative, check_output_file, check_positive_int
from moesaic.measure.calibrate import ROUNDS as CLUSTER_ROUNDS
from moesaic.measure.cpuload import REPEATS as CPU_REPEATS
from moesaic.measure.syncwait import REPS as SYNC_REPS
from moesaic.planning.loads import describe_loads
from moesaic.simtools.cli_files import load_option

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
        "--contention-s",
        type=float,
        default=1.0,
        help="--cluster: seconds of each half of the communication-CPU measurement "
        "(compute alone, then beside an all-to-all stream; taken "
        f"{CPU_REPEATS} times, the median kept; default 1.0; 0: skip it)",
    )
    c.add_argument(
        "--sync-reps",
        type=int,
        default=SYNC_REPS,
        help="--cluster: rounds of each compute segment and call of the sync-wait measurement "
        f"(moesaic.sim.syncwait; default {SYNC_REPS}, about 15 s; 0: skip it)",
    )
    c.add_argument(
        "--rounds",
        type=int,
        default=CLUSTER_ROUNDS,
        help="--cluster: times the links, the collectives and the communication's CPU are "
        f"measured, the median of each figure kept (default {CLUSTER_ROUNDS}; 3 narrowed the "
        "spread of repeated calibrations' predictions from ~1.3x to ~1.17x, at 2.2x the time)",
    )
    c.add_argument(
        "--no-floor",
        action="store_true",
        help="--cluster: skip the unshaped pair (floor_s = 0)",
    )
    c.add_argument(
        "--model",
        metavar="M.toml",
        help="time this model's operations (a model file or training config) into the profile",
    )
    c.add_argument(
        "--threads",
        type=int,
        default=None,
        help="--model: torch threads per rank (default: CPU cores / the cluster's ranks, "
        "as moesaic train runs them; all cores without --cluster)",
    )
    c.add_argument(
        "--routing-steps",
        type=int,
        default=None,
        metavar="N",
        help="--model (a training config): train its model on its data for N steps in one "
        "process and keep the expert loads of those after the first 2 as the profile's "
        "routing (default 8; 0: do not, routing is then priced uniform)",
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
    print(
        f"call floors: all-to-all {cal.a2a_call_s * 1e3:.2f} ms a call, all-reduce "
        f"{cal.allreduce_call_s * 1e3:.2f} ms a call in a stream, "
        f"{cal.allreduce_alone_call_s * 1e3:.2f} ms alone, "
        f"{cal.allreduce_loaded_call_s * 1e3:.2f} ms alone beside compute"
    )
    for w in cal.sync_waits:
        print(
            f"sync wait after {w.compute_s * 1e3:.1f} ms of compute, "
            f"{w.bytes_per_rank / 1e3:.1f} kB/rank: {w.wait_s * 1e3:.2f} ms a call"
        )
    for x in shares:
        print(
            f"{x.kind} {x.regime} {x.bytes_per_rank / 1e3:.0f} kB/rank: "
            f"{x.measured_s * 1e3:.2f} ms, share {x.share:.2f} of the links"
        )
    for y in cal.level_shares:
        print(
            f"exchange inside level {y.level} {y.regime} {y.bytes_per_rank / 1e3:.0f} kB/rank: "
            f"{y.measured_s * 1e3:.2f} ms, share {y.share:.2f} of the links"
        )


def _comm_cpu_busy(args: argparse.Namespace, spec: Any, cpu: dict[str, Any]) -> float:
    """``--cluster``: the cores a rank's communication keeps busy beyond its measured CPU per
    call and byte (:mod:`moesaic.measure.cpuload`); 0 with ``--contention-s 0``."""
    if args.contention_s == 0:
        return 0.0
    from moesaic.cluster.netns import EmulatedCluster
    from moesaic.measure.cpuload import measure_comm_cpu

    with EmulatedCluster(spec) as cluster:
        found = measure_comm_cpu(
            cluster,
            cores_per_rank=cpu["cores"] / cpu["ranks_per_machine"] if cpu["cores"] else 1.0,
            comm_cpu_s=cpu["comm_cpu_s"],
            comm_cpu_per_byte_s=cpu["comm_cpu_per_byte_s"],
            seconds=args.contention_s,
            rounds=args.rounds,
        )
    print(
        f"compute beside an all-to-all stream: {found.slowdown:.2f}x slower, the communication "
        f"keeps {found.cores:.2f} cores busy ({found.busy:.2f} beyond its CPU per call and byte, "
        f"at {found.bytes_per_s / 1e6:.1f} MB/s)"
    )
    return found.busy


def _measure_model(args: argparse.Namespace, world: int) -> tuple[Any, dict[str, float]]:
    """``--model``'s operations timed (an ``OpCal``) and the taskflow runtime's CPU figures at
    its MoE layer (``measure.cpucal.tile_cpu_figures``); None and none without ``--model``."""
    if args.threads is not None:
        check_positive_int("--threads", args.threads)
    if args.model is None:
        if args.threads is not None:
            raise ValueError("--threads applies to --model only")
        return None, {}
    from moesaic.measure.cpucal import tile_cpu_figures
    from moesaic.measure.opmeasure import measure_ops
    from moesaic.train.model_files import load_model_spec

    model = load_option("model", args.model, load_model_spec)
    # the experts of one rank at the largest EP group that divides the world and the experts
    # (the world itself where it can: EP below it is `plan --ep`'s replicas)
    ep = math.gcd(model.experts, world)
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    ops = measure_ops(model, world=ep, threads=threads)
    at = "" if ep == world else f" (EP {ep}: {model.experts} experts do not spread over {world})"
    print(
        f"model {model.name!r}: {len(ops.fwd)} operations timed at {ops.tokens[0]} and "
        f"{ops.tokens[1]} tokens, {threads} thread(s), {ops.expert_count} experts per rank{at}; "
        f"speed reference {ops.reference_s * 1e3:.1f} ms (re-timed by simulate/plan --retime)"
    )
    tiles = tile_cpu_figures(model)
    print(
        f"taskflow runtime: {tiles['tile_cpu_s'] * 1e6:.1f} us of CPU per task, "
        f"{tiles['tile_elem_cpu_s'] * 1e9:.2f} ns per element of its vector tiles, "
        f"{tiles['copy_elem_cpu_s'] * 1e9:.2f} ns per element of a fresh copy"
    )
    return ops, tiles


@contextlib.contextmanager
def _held_output() -> Iterator[None]:
    """Standard output and error of this process and its children (file descriptors 1 and 2)
    go to a temporary file, written to standard error only if the block raises."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 1)
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            raise
        else:
            failed = False
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            if failed:
                held.seek(0)
                sys.stderr.write(held.read().decode(errors="replace"))
                sys.stderr.flush()


def _routing_steps(args: argparse.Namespace) -> int:
    """``--routing-steps`` checked before anything is measured: the steps ``train.routing_run``
    trains (8 when not given; 0: none, always without ``--model``)."""
    from moesaic.train.routing_run import ROUTING_SKIP, ROUTING_STEPS

    steps = args.routing_steps
    if args.model is None:
        if steps is not None:
            raise ValueError("--routing-steps applies to --model only")
        return 0
    steps = ROUTING_STEPS if steps is None else steps
    if steps != 0 and steps <= ROUTING_SKIP:
        raise ValueError(
            f"--routing-steps ({steps}) must be 0 or > {ROUTING_SKIP} (the loads of the steps "
            f"after the first {ROUTING_SKIP} are kept)"
        )
    return steps


def _measure_routing(args: argparse.Namespace, world: int, steps: int) -> Any:
    """``--model``'s routing on its data over ``steps`` steps (``train.routing_run``); None for a
    model file, without ``--model`` or with 0 steps."""
    if steps == 0:
        return None
    from moesaic.train.routing_run import measure_routing

    with _held_output():  # the run's own lines and summary: shown only if it fails
        routing = load_option(
            "model", args.model, lambda p: measure_routing(p, world=world, steps=steps)
        )
    if routing is None:
        print(f"routing: {args.model} is a model file (no data): routing is priced uniform")
        return None
    loads = describe_loads(routing.loads)
    print(f"routing: {routing.source}: the busiest expert {loads}, per MoE layer")
    return routing


def run_calibrate(args: argparse.Namespace) -> int:
    import torch

    from moesaic.measure.machine import default_matmul_size, measure
    from moesaic.sim.profile import Profile, links_from_cluster_check

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = default_matmul_size(device) if args.size is None else args.size
    check_positive_int("--size", size)
    check_output_file("--out", args.out)  # before the measurement, not after it
    check_non_negative("--contention-s", args.contention_s)
    check_int("--sync-reps", args.sync_reps, 0)
    check_positive_int("--rounds", args.rounds)
    routing_steps = _routing_steps(args)
    spec = None
    if args.cluster:
        from moesaic.cluster.spec import ClusterSpec

        spec = load_option("cluster", args.cluster, ClusterSpec.from_toml)
    world = 1 if spec is None else spec.world_size
    ops, tiles = _measure_model(args, world)
    routing = _measure_routing(args, world, routing_steps)
    measured = measure(size)
    floor_s, scale, source = 0.0, 1.0, f"measured matmul {size}^3 here; links as specified"
    links: tuple[Any, ...] = ()
    shares: tuple[Any, ...] = ()
    cpu: dict[str, Any] = {}
    if args.links:
        floor_s, scale = load_option("links", args.links, links_from_cluster_check)
        source = f"measured matmul {size}^3 here; links from {args.links}"
    elif spec is not None:
        from moesaic.measure.calibrate import measure_links

        cal = measure_links(
            spec,
            duration_s=args.duration_s,
            floor=not args.no_floor,
            sustain_s=args.sustain_s,
            sync_reps=args.sync_reps,
            rounds=args.rounds,
        )
        floor_s, scale, links, shares = cal.floor_s, cal.bandwidth_scale, cal.links, cal.shares
        # The emulated ranks all run on this machine and share its cores.
        cpu = {
            "put_cpu_s": cal.put_cpu_s,
            "put_cpu_per_byte_s": cal.put_cpu_per_byte_s,
            # a collective's CPU as the puts': per call and per byte sent (both sides)
            "comm_cpu_s": cal.put_cpu_s,
            "comm_cpu_per_byte_s": cal.put_cpu_per_byte_s,
            "cores": os.cpu_count() or 0,
            "ranks_per_machine": spec.world_size,
            "cluster": spec,  # what was measured: simulate checks it against its cluster
            "a2a_call_s": cal.a2a_call_s,
            "allreduce_call_s": cal.allreduce_call_s,
            "allreduce_loaded_call_s": cal.allreduce_loaded_call_s,
            "allreduce_alone_call_s": cal.allreduce_alone_call_s,
            "sync_waits": cal.sync_waits,
            "level_shares": cal.level_shares,
        }
        cpu["comm_cpu_busy"] = _comm_cpu_busy(args, spec, cpu)
        floor = "no floor" if args.no_floor else "floor from an unshaped pair"
        source = (
            f"measured matmul {size}^3 here; links measured on the emulated "
            f"{args.cluster} ({floor})"
        )
        _print_calibration(cal, shares)
    if ops is not None:
        source += f"; operations of model {ops.model.name!r} timed here ({ops.threads} threads)"
    gpu: dict[str, Any] = {}
    if measured["device"] == "cuda":
        from moesaic.measure.gpucal import measure_gpu

        gpu = measure_gpu(measured["half_flops_per_s"])
        effs = ", ".join(f"{int(r)}: {e:.2f}" for r, e in gpu["gemm_efficiency"])
        print(f"grouped GEMMs, fraction of the dense bf16 rate by rows per expert: {effs}")
        print(
            f"small kernels: {gpu['launch_s'] * 1e6:.2f} us each queued; "
            f"{gpu['layer_kernels']:.0f} per MoE layer forward + backward"
        )
    profile = Profile(
        flops_per_s=measured["flops_per_s"],
        half_flops_per_s=measured["half_flops_per_s"],
        task_overhead_s=measured["task_overhead_s"],
        mem_bytes_per_s=measured["mem_bytes_per_s"],
        device=measured["device"],
        floor_s=floor_s,
        bandwidth_scale=scale,
        source=source,
        links=links,
        collectives=shares,
        ops=ops,
        tile_cpu_s=tiles.get("tile_cpu_s", 0.0),
        tile_elem_cpu_s=tiles.get("tile_elem_cpu_s", 0.0),
        copy_elem_cpu_s=tiles.get("copy_elem_cpu_s", 0.0),
        routing=routing,
        **cpu,
        **gpu,
    )
    profile.save(args.out)
    print(json.dumps(profile.to_dict()))
    return 0
