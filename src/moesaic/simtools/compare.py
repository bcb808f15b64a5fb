"""Simulated against measured: every point of a measured JSON simulated with its own run and
knobs (``moesaic simulate --measured F.json``).

A measured file holds points in one of three layouts:

* ``{"results": {label: point, ...}, ...}``: the layout of the emulated-cluster benchmarks
  (``benchmarks/flowmoe_cluster.py``'s ``flowmoe_cluster.json``);
* ``{"points": [point, ...]}`` or a list of points (each may name itself: ``label``);
* one point.

A point's fields (anything else is ignored):

* the time, one of ``step_time_s`` (seconds) or ``iteration_ms``: a number or a summary with
  a ``median``;
* ``strategy`` (or ``dispatcher``, a training config's name for it; default ``dropless``) and
  ``schedule`` (default ``vanilla``); an old mixed name as ``strategy`` with no ``schedule``
  (``flowmoe``, ``ep``, ...) is read as its pair (``runs.LEGACY_NAMES``);
* ``pipeline_degree`` (or ``degree``): R; default 1 under vanilla, else ``--degree``;
* ``sp_bytes``: flowmoe's Sp (ignored when 0 or under another schedule); default ``--sp-bytes``;
* ``domain_sizes`` (or ``domains``): hybrid's; default ``--domains`` (or planned).

Each point's error is ``simulated / measured - 1``; the summary is the geometric mean of
``|error|``, as ``benchmarks/sim_validate.py`` reports it. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moesaic.cluster.spec import ClusterSpec
from moesaic.schedule_table import DEFAULT_SCHEDULE
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import Profile
from moesaic.sim.runs import Run, check_run, legacy_run
from moesaic.sim.simulate import SimOptions, simulate

__all__ = ["MeasuredPoint", "compare", "geomean_abs_error", "load_measured"]


@dataclass(kw_only=True, slots=True, frozen=True)
class MeasuredPoint:
    """One measured step and the run and knobs it was measured with (None: not recorded)."""

    label: str
    run: Run
    measured_ms: float
    degree: int | None = None
    sp_bytes: float | None = None
    domain_sizes: tuple[int, ...] | None = None

    def options(self, base: SimOptions) -> SimOptions:
        """``base`` with the knobs this point recorded (``ep``: every domain of size 1)."""
        changes: dict[str, Any] = {}
        if self.degree is not None:
            changes["degree"] = self.degree
        if self.sp_bytes is not None and self.run.traits.reduce_in_backward:
            changes["sp_bytes"] = self.sp_bytes
        if self.domain_sizes is not None:
            changes["domain_sizes"] = self.domain_sizes
        return dataclasses.replace(base, **changes)


def _time_ms(label: str, raw: Mapping[str, Any]) -> float:
    for key, scale in (("step_time_s", 1e3), ("iteration_ms", 1.0)):
        if key in raw:
            value = raw[key]
            value = value.get("median") if isinstance(value, Mapping) else value
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"point {label!r}: {key} ({value!r}) must be a number > 0")
            return float(value) * scale
    raise ValueError(f"point {label!r} has no time: give step_time_s (seconds) or iteration_ms")


def _run(label: str, raw: Mapping[str, Any], levels: int) -> tuple[Run, Any]:
    """The point's run and domain sizes (an old mixed name's, else the point's)."""
    strategy = raw.get("strategy", raw.get("dispatcher", "dropless"))
    domains = raw.get("domain_sizes", raw.get("domains"))
    legacy = None if "schedule" in raw else legacy_run(strategy, levels)
    if legacy is not None:
        run, fixed = legacy
        return run, domains if fixed is None else fixed
    try:
        return check_run(strategy, raw.get("schedule", DEFAULT_SCHEDULE)), domains
    except ValueError as exc:
        raise ValueError(f"point {label!r}: {exc}") from None


def _point(label: str, raw: Any, levels: int) -> MeasuredPoint:
    if not isinstance(raw, Mapping):
        raise ValueError(f"point {label!r} must be a JSON object, got {type(raw).__name__}")
    run, domains = _run(label, raw, levels)
    degree = raw.get("pipeline_degree", raw.get("degree"))
    if not run.traits.pipelined:
        degree = 1
    sp = raw.get("sp_bytes")
    return MeasuredPoint(
        label=label,
        run=run,
        measured_ms=_time_ms(label, raw),
        degree=None if degree is None else int(degree),
        sp_bytes=float(sp) if isinstance(sp, (int, float)) and sp > 0 else None,
        domain_sizes=None if domains is None else tuple(int(d) for d in domains),
    )


def load_measured(path: str | Path, spec: ClusterSpec) -> list[MeasuredPoint]:
    """The points of the measured JSON at ``path`` (layouts in the module docstring); errors
    name the file and the point."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON: {exc}") from None
    raw: Sequence[tuple[str, Any]]
    if isinstance(data, Mapping) and isinstance(data.get("results"), Mapping):
        raw = list(data["results"].items())
    else:
        items = data.get("points", [data]) if isinstance(data, Mapping) else data
        if not isinstance(items, list):
            raise ValueError(f"{str(path)!r}: points must be a list")
        raw = [(_label(i, p), p) for i, p in enumerate(items)]
    try:
        points = [_point(label, p, spec.num_levels) for label, p in raw]
    except ValueError as exc:
        raise ValueError(f"{str(path)!r}: {exc}") from None
    if not points:
        raise ValueError(f"{str(path)!r} holds no measured point")
    return points


def _label(i: int, raw: Any) -> str:
    if isinstance(raw, Mapping) and isinstance(raw.get("label"), str):
        return raw["label"]
    return f"#{i}"


def compare(
    spec: ClusterSpec,
    model: ModelSpec,
    profile: Profile,
    points: Sequence[MeasuredPoint],
    base: SimOptions | None = None,
) -> list[dict[str, Any]]:
    """Every point simulated with its run and knobs (the rest from ``base``): one row each with
    the point, the run, ``measured_ms``, ``simulated_ms``, ``error`` (simulated / measured - 1)
    and the simulation's summary."""
    base = base or SimOptions()
    rows = []
    for p in points:
        r = simulate(spec, model, p.run.strategy, profile, p.options(base), schedule=p.run.schedule)
        summary = {k: v for k, v in r.summary().items() if k != "iteration_ms"}
        simulated = r.iteration_s * 1e3
        rows.append(
            {
                "point": p.label,
                **summary,
                "measured_ms": p.measured_ms,
                "simulated_ms": simulated,
                "error": simulated / p.measured_ms - 1,
            }
        )
    return rows


def geomean_abs_error(rows: Sequence[Mapping[str, Any]]) -> float:
    """Geometric mean of ``|error|`` over ``rows`` (0 if one is exact)."""
    errors = [abs(r["error"]) for r in rows]
    if any(e == 0 for e in errors):
        return 0.0
    return math.exp(math.fsum(math.log(e) for e in errors) / len(errors))
