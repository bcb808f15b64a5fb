"""What the simulator's commands (``simulate``, ``calibrate``, ``plan``) share: reading the files
they are given (errors that name the option and the file), checking a ``--profile`` against
the ``--cluster``, and the ``--all-reduce`` and ``--retime`` options. Torch-free (``--retime``
imports torch when given)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from moesaic.planning.loads import describe_loads, model_loads

__all__ = [
    "add_all_reduce_option",
    "add_loads_option",
    "add_retime_option",
    "apply_loads",
    "check_profile",
    "load_option",
    "retimed",
]


def load_option(option: str, path: str, load: Callable[[str], Any]) -> Any:
    """``load(path)`` with its errors naming ``--option`` (and the file)."""
    try:
        return load(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"--{option}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"--{option} {path}: {exc}") from None


def add_all_reduce_option(parser: argparse.ArgumentParser) -> None:
    """``--all-reduce``: the gradient all-reduce's algorithm (``SimOptions.all_reduce``)."""
    from moesaic.sim.collectives import ALL_REDUCE_ALGORITHMS

    parser.add_argument(
        "--all-reduce",
        choices=ALL_REDUCE_ALGORITHMS,
        default="best",
        help="gradient all-reduce algorithm: the faster of ring and hierarchical per size, as "
        "NCCL picks (default), or gloo's ring",
    )


def add_loads_option(parser: argparse.ArgumentParser) -> None:
    """``--loads RUN/metrics.jsonl``: price the experts' loads a run measured."""
    parser.add_argument(
        "--loads",
        default=None,
        metavar="METRICS",
        help="a moesaic train run's metrics.jsonl: price the expert loads it measured (each "
        "MoE layer's routing, summed over the steps after the first 2) instead of the "
        "profile's routing (calibrate --model on a training config) or the routing prior",
    )
    parser.add_argument(
        "--routing",
        choices=("prior", "uniform"),
        default="prior",
        help="the expert loads when none are measured (no --loads, measured_loads, "
        "routing_skew or profile routing): the routing prior of a fresh router on a "
        "byte-level corpus (default; its 10th-90th percentile gives the range), or uniform "
        "(a layer fed random activations, a router balanced by its loss)",
    )


def apply_loads(
    args: argparse.Namespace,
    model: Any,
    *,
    note: Callable[[str], None],
    profile: Any = None,
    world: int | None = None,
) -> tuple[Any, Any]:
    """``model`` with expert loads, the first of: ``--loads`` (a run's), the model's own
    ``measured_loads`` or ``routing_skew``, the ``profile``'s (``calibrate --model`` ran the
    job's router on its data) when they have the model's experts, else the routing prior
    (:mod:`moesaic.sim.prior`, at its 50th percentile; ``world`` ranks' tokens per step),
    unless ``--routing uniform``, ``world`` is None or the model is ``layer_only`` (a layer
    timed alone on random activations: uniform). Says which it used. Returns the model and
    the prior (None when it is not used)."""
    import dataclasses

    if getattr(args, "loads", None) is not None:
        from moesaic.sim.model import measured_loads

        loads = load_option("loads", args.loads, measured_loads)
        if len(loads[0]) != model.experts:
            raise ValueError(
                f"--loads {args.loads}: the run had {len(loads[0])} experts, the model "
                f"{model.experts}: the loads must have one entry per expert of --model"
            )
        note(f"--loads: expert loads of {args.loads}: the busiest expert {describe_loads(loads)}")
        return dataclasses.replace(model, measured_loads=loads), None
    uniform = getattr(args, "routing", "prior") == "uniform"
    return model_loads(model, note=note, profile=profile, world=world, uniform=uniform)


def add_retime_option(p: argparse.ArgumentParser) -> None:
    """``--retime``: time the profile's speed reference now and rescale its compute."""
    p.add_argument(
        "--retime",
        action="store_true",
        help="time --profile's speed reference here now (about a second) and rescale its "
        "compute to the machine's speed (a shared machine's drifts); CPU profiles with "
        "operations measured by calibrate --model",
    )


def retimed(args: argparse.Namespace, profile: Any, *, note: Callable[[str], None]) -> Any:
    """``profile`` re-timed when ``--retime`` was given (:mod:`moesaic.measure.retime`), with a
    line (``note``) saying by how much; unchanged otherwise."""
    if not getattr(args, "retime", False):
        return profile
    if not args.profile:
        raise ValueError("--retime re-times a --profile; give one")
    from moesaic.measure.retime import retime

    out, factor = retime(profile)
    note(
        f"--retime: the machine runs {factor:.2f}x the time of --profile {args.profile}'s "
        f"calibration (its reference {profile.ops.reference_s * 1e3:.1f} ms then, "
        f"{out.ops.reference_s * 1e3:.1f} ms now); compute and CPU figures rescaled, network "
        "figures as measured"
    )
    return out


def check_profile(
    args: argparse.Namespace, profile: Any, spec: Any, *, note: Callable[[str], None]
) -> None:
    """Refuses a profile measured on another cluster unless ``--allow-profile-mismatch``; says
    in one line (``note``) when the profile does not record its cluster, or what is extrapolated.
    ``args`` has ``profile``, ``cluster`` and ``allow_profile_mismatch``."""
    from moesaic.sim.profile import describe_cluster

    if profile.cluster is None:
        if profile.cluster_bound:
            note(
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
    note(
        f"--allow-profile-mismatch: extrapolating the collective shares and link rates of "
        f"{describe_cluster(profile.cluster)} to {describe_cluster(spec)} ({'; '.join(diff)})"
    )
