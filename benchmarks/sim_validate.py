"""Simulated vs measured iteration times for every committed emulated-cluster run.

Usage::

    python benchmarks/sim_validate.py [--out benchmarks/results/sim_validation.json]

No new measurement: the measured side is the committed results of ``flowmoe_cluster.py``
(``flowmoe_cluster.json``: vanilla, moe-only R = 1, 2, 4, flowmoe R = 2, 4 with Sp = G, G/16 and
tuned) and ``hybridep_cluster.py`` (``hybridep_2dc.json``, ``hybridep_2dc2.json``,
``hybridep_4dc.json``: classic EP, Partition and +Migration (SR compression 16, the shared
experts' all-reduce every 4 gathers, prefetched gathers) at 7 sizes each) and
``taskflow_cluster.py`` (``taskflow_cluster.json``, ``taskflow_cluster_tile128.json``: dropless
and the static executor in both queue orders).

Profiles (what each prediction is allowed to know):

* links: the cluster of the run (its result's ``cluster``, or the taskflow point's 2-rank link),
  with the link figures of one of the three modes below;
* FlowMoE run: compute rate and per-task overhead fitted to the *compute* busy time the run
  measured for moe-only R = 1 and R = 4 (two equations, two unknowns); iteration times of all
  ten configurations are then predicted;
* HybridEP runs: the compute rate the benchmark itself calibrated in each point's rounds
  (``flops_per_s_rounds``, from its compute-only step), no per-task overhead.
* taskflow runs: likewise the compute rate of each point's ``compute only`` variant (the same
  layer with every expert local: no byte moves), no per-task overhead; the bucket (tile and slot
  rows) the run recorded.

* links, measured (the headline, ``rows``): ``moesaic calibrate --cluster`` on each
  run's cluster (``sim_profile_<cluster>.json``; the taskflow runs' 2-rank links as
  ``sim_cluster_taskflow_<G>gbps.toml``): point-to-point bandwidth and latency per level, the
  latency floor, the all-to-all's and the all-reduce's shares of the links at three sizes, the
  CPU of a one-sided put (per put and per byte) and the cores per rank; the per-tile CPU of the
  taskflow runtime is the static executor's measured overhead (``taskflow_sched.json``) and
  its handlers' CPU per element of a non-GMM tile, measured on one rank with no network
  (``taskflow_handler_cpu.json``, ``python -m moesaic.measure.cpucal``).
  Nothing is fitted to the iteration times predicted. ``rows_measured_without_taskflow_cpu_model``
  drops the CPU figures (before/after of the taskflow CPU model);
* links, fitted (secondary, ``rows_fitted``): the bandwidth share fitted leave one run out: for
  each of the six runs, the share that best fits the *other five* (``cross_validated``)
  predicts it; ``rows_links_as_checked`` keeps the predictions with the cluster check's share.

Each point's error is ``simulated / measured - 1``; the summary is the geometric mean of
``|error|`` (and of ``max(ratio, 1/ratio) - 1``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "src"))

from moesaic.bench.meta import run_metadata  # noqa: E402
from moesaic.cluster.spec import ClusterSpec, Level  # noqa: E402
from moesaic.sim.model import ModelSpec  # noqa: E402
from moesaic.sim.pipelined import Costs  # noqa: E402
from moesaic.sim.profile import Profile, links_from_cluster_check  # noqa: E402
from moesaic.sim.simulate import SimOptions, simulate  # noqa: E402

FLOWMOE = {  # result key -> (strategy, R, Sp: "all" = G, "fixed" = G/16, "tuned" = chosen)
    "vanilla": ("vanilla", 1),
    "moe-only R=1 (vanilla, traced)": ("moe-only", 1),
    "moe-only R=2": ("moe-only", 2),
    "moe-only R=4": ("moe-only", 4),
    "flowmoe R=2 Sp=G": ("flowmoe", 2),
    "flowmoe R=4 Sp=G": ("flowmoe", 4),
    "flowmoe R=2 Sp=G/16": ("flowmoe", 2),
    "flowmoe R=4 Sp=G/16": ("flowmoe", 4),
    "flowmoe R=2 Sp tuned": ("flowmoe", 2),
    "flowmoe R=4 Sp tuned": ("flowmoe", 4),
}


# HybridEP variants: (result name, strategy, options as hybridep_cluster.py ran them)
VARIANTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("classic EP", "ep", {"hybrid_step": "benchmark"}),  # "ep" is hybrid at domains (1, ..)
    ("Partition", "hybrid", {"hybrid_step": "benchmark"}),
    ("+Migration", "hybrid", {"prefetch": True, "compression_ratio": 16.0,
                              "shared_expert_every": 4, "hybrid_step": "benchmark"}),
)  # fmt: skip


def _links() -> tuple[float, float]:
    return links_from_cluster_check(RESULTS / "cluster_check.json")


# The ``scale`` values that ask for the run's own calibrated profile: with the taskflow CPU
# model and the collectives' loaded shares (the headline), without the CPU model, and with the
# idle shares instead of the loaded ones (the calibration before the loaded regime). Suffixed
# with ``@`` and a calibration's file suffix (``CALIBRATIONS``), they read that calibration.
MEASURED = "measured"
MEASURED_NO_CPU = "measured, no CPU model"
MEASURED_IDLE = "measured, idle collectives"
# Independent calibrations of every cluster: ``sim_profile_<cluster><suffix>.json``.
CALIBRATIONS = ("", "_cal2", "_cal3")


def static_task_overhead_s() -> float:
    """The static executor's measured per-task overhead (no-op tasks, median;
    ``taskflow_sched.json``, ``benchmarks/taskflow_sched.py``): the profile's ``tile_cpu_s``."""
    data = json.loads((RESULTS / "taskflow_sched.json").read_text())
    row = next(r for r in data["overhead"] if r["rows_per_task"] == "no-op")
    return row["static"]["overhead_us"]["median"] * 1e-6


def handler_elem_cpu_s(tile_m: int) -> float:
    """The taskflow handlers' CPU seconds per element of their non-GMM tiles at ``tile_m``,
    measured on one rank with no network (``taskflow_handler_cpu.json``,
    ``python -m moesaic.measure.cpucal``): the profile's ``tile_elem_cpu_s``."""
    data = json.loads((RESULTS / "taskflow_handler_cpu.json").read_text())
    row = next((r for r in data["points"] if r["tile_m"] == tile_m), None)
    if row is None:
        raise ValueError(f"taskflow_handler_cpu.json has no point of tile_m {tile_m}")
    return float(row["tile_elem_cpu_s"])


def _link_fields(cluster: str, scale: float | str | None) -> dict[str, Any]:
    """The link fields of a point's profile: ``MEASURED``: the links, floor, collective shares,
    put CPU and cores ``moesaic calibrate --cluster`` measured on the run's cluster
    (``sim_profile_<cluster>.json``) and the static executor's per-task overhead;
    ``MEASURED_NO_CPU``: the same links without the CPU figures; ``MEASURED_IDLE``: with the
    collectives' idle shares only; each with ``@<suffix>`` reads calibration ``<suffix>``;
    else the cluster check's floor with ``scale`` as the bandwidth share (``None``: the
    check's)."""
    mode, _, suffix = scale.partition("@") if isinstance(scale, str) else ("", "", "")
    if mode in (MEASURED, MEASURED_NO_CPU, MEASURED_IDLE):
        measured = Profile.load(RESULTS / f"sim_profile_{cluster}{suffix}.json")
        shares = measured.collectives
        if mode == MEASURED_IDLE:
            shares = tuple(x for x in shares if x.regime == "idle")
        links = {"floor_s": measured.floor_s, "bandwidth_scale": measured.bandwidth_scale,
                 "links": measured.links, "collectives": shares}  # fmt: skip
        if mode == MEASURED_NO_CPU:
            return links
        return {**links, "tile_cpu_s": static_task_overhead_s(), "put_cpu_s": measured.put_cpu_s,
                "put_cpu_per_byte_s": measured.put_cpu_per_byte_s, "cores": measured.cores,
                "ranks_per_machine": measured.ranks_per_machine}  # fmt: skip
    floor_s, checked = _links()
    return {"floor_s": floor_s, "bandwidth_scale": checked if scale is None else scale}


def _fit_compute(
    spec: ClusterSpec, model: ModelSpec, measured: dict[str, Any]
) -> tuple[float, float]:
    """(flops_per_s, task_overhead_s) from moe-only R=1 and R=4's measured compute busy time."""
    probe = Profile(flops_per_s=1.0)
    from moesaic.sim.collectives import LinkModel

    link = LinkModel(spec=spec)
    eqs = []
    for key, R in (("moe-only R=1 (vanilla, traced)", 1), ("moe-only R=4", 4)):
        c = Costs(model, link, probe, R)
        L = model.layers
        flops = 3 * R * L * (c.at_s + c.e_s) + 3 * R * c.head_s + c.optimizer_s
        tasks = 2 * R * L * 2 + 2 * R + 1
        eqs.append((flops, tasks, measured[key]["busy_compute_s"]["median"]))
    (f1, n1, t1), (f2, n2, t2) = eqs
    # t = f / rate + n * overhead; solve the 2x2 system
    det = f1 * n2 - f2 * n1
    inv_rate = (t1 * n2 - t2 * n1) / det
    overhead = (f1 * t2 - f2 * t1) / det
    return 1.0 / inv_rate, max(overhead, 0.0)


def flowmoe_points(scale: float | str | None = None) -> list[dict[str, Any]]:
    """Every schedule of the FlowMoE run; ``scale``: the links' bandwidth share, or
    ``MEASURED`` (:func:`_link_fields`)."""
    data = json.loads((RESULTS / "flowmoe_cluster.json").read_text())
    spec = ClusterSpec.from_dict(data["cluster"])
    model = ModelSpec.from_toml(ROOT / "examples" / "models" / "flowmoe_small.toml")
    res = data["results"]
    rate, overhead = _fit_compute(spec, model, res)
    profile = Profile(flops_per_s=rate, task_overhead_s=overhead, **_link_fields(spec.name, scale),
                      source="flowmoe_cluster.json compute fit")  # fmt: skip
    out = []
    for key, (strategy, R) in FLOWMOE.items():
        r = res[key]
        sp = r["sp_bytes"] or None
        sim = simulate(spec, model, strategy, profile, SimOptions(degree=R, sp_bytes=sp))
        row = _row("flowmoe_cluster.json", spec.name, key, r["step_time_s"]["median"], sim)
        out.append({**row, "profile": profile.to_dict(), "model": dataclasses.asdict(model)})
    return out


def hybridep_points(name: str, scale: float | str | None = None) -> list[dict[str, Any]]:
    """Every point of one HybridEP result; ``scale`` as :func:`flowmoe_points`'."""
    data = json.loads((RESULTS / name).read_text())
    spec = ClusterSpec.from_dict(data["cluster"])
    cfg = data["config"]
    link_fields = _link_fields(spec.name, scale)
    out = []
    for point in data["points"]:
        T, F = point["tokens_per_rank"], point["ffn_hidden_size"]
        model = ModelSpec(name=f"hybridep_T{T}_F{F}", layers=cfg["blocks"], batch=T // cfg["seq_len"]
                          if cfg["seq_len"] <= T else 1, seq_len=min(T, cfg["seq_len"]),
                          hidden=cfg["hidden_size"], ffn_hidden=F, experts=cfg["num_experts"],
                          top_k=cfg["top_k"], heads=cfg["heads"])  # fmt: skip
        profile = Profile(flops_per_s=point["flops_per_s_rounds"], **link_fields,
                          source=f"{name} flops_per_s_rounds")  # fmt: skip
        for variant, strategy, options in VARIANTS:
            domains = point["domains"][variant]
            opts = SimOptions(domain_sizes=tuple(domains) if domains else None, **options)
            sim = simulate(spec, model, strategy, profile, opts)
            label = f"{variant} T={T} F={F}"
            row = _row(name, spec.name, label, point["variants"][variant]["measured_s"], sim)
            out.append({**row, "profile": profile.to_dict(), "model": dataclasses.asdict(model),
                        "options": options})  # fmt: skip
    return out


def _row(source: str, cluster: str, label: str, measured_s: float, sim: Any) -> dict[str, Any]:
    return {
        "source": source,
        "cluster": cluster,
        "point": label,
        "strategy": sim.strategy,
        "schedule": sim.schedule,
        "measured_ms": measured_s * 1e3,
        "simulated_ms": sim.iteration_s * 1e3,
        "error": sim.iteration_s / measured_s - 1,
        **{k: v for k, v in sim.details.items()},
    }


# taskflow_cluster.py variants: (result name, strategy, SimOptions fields)
TASKFLOW_VARIANTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("dropless", "vanilla", {"degree": 1}),
    ("taskflow static", "taskflow", {"taskflow_pipeline": True}),
    ("taskflow static, kernel order", "taskflow", {"taskflow_pipeline": False}),
)


def taskflow_points(name: str, scale: float | str | None = None) -> list[dict[str, Any]]:
    """Every bandwidth of one ``taskflow_cluster.py`` result: dropless and the static executor
    in both queue orders; ``scale`` as :func:`flowmoe_points`' (``MEASURED``: the profile of
    a 2-rank cluster of the point's bandwidth and latency, ``sim_profile_taskflow_<G>gbps``)."""
    data = json.loads((RESULTS / name).read_text())
    cfg = data["config"]
    model = ModelSpec.from_toml(ROOT / "examples" / "models" / "taskflow_layer.toml")
    want = (model.hidden, model.ffn_hidden, model.experts, model.top_k, model.tokens)
    got = tuple(cfg[k] for k in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k",
                                 "tokens_per_rank"))  # fmt: skip
    if want != got:
        raise ValueError(f"{name}: config {got} is not taskflow_layer.toml's {want}")
    # One torch thread per rank: its compute-only FLOPs (gate and experts, forward + backward).
    flops = 3 * (model.attention_flops(model.tokens) + model.expert_flops(model.tokens * 2))
    out = []
    for point in data["points"]:
        spec = ClusterSpec(levels=(Level(name="node", size=point["ranks"],
                                         bandwidth_gbps=point["gbps"],
                                         latency_ms=cfg["latency_ms"]),),
                           name=f"taskflow_{point['gbps']:g}gbps")  # fmt: skip
        rate = flops / point["median_s"]["compute only"]
        bucket = point["bucket"]
        fields = _link_fields(spec.name, scale)
        if "tile_cpu_s" in fields:  # the CPU model: the handlers' measured per-element CPU
            fields["tile_elem_cpu_s"] = handler_elem_cpu_s(bucket["tile_m"])
        profile = Profile(flops_per_s=rate, **fields, source=f"{name} compute only")
        tiles = {"taskflow_tile_m": bucket["tile_m"], "taskflow_slot_rows": bucket["slot_rows"]}
        for variant, strategy, options in TASKFLOW_VARIANTS:
            opts = {**options, **(tiles if strategy == "taskflow" else {})}
            sim = simulate(spec, model, strategy, profile, SimOptions(**opts))
            label = f"{variant} {point['gbps']:g} Gbit/s tile {bucket['tile_m']}"
            row = _row(name, spec.name, label, point["median_s"][variant], sim)
            row.pop("plans", None)
            # Not used by the prediction: the CPU the step needed on its busiest rank (the
            # measured step cannot be shorter on 2 ranks sharing 2 cores), and the sim's parts.
            cpu_ms = max(r[variant] for r in point["cpu_s_per_rank"]) * 1e3
            out.append({**row, "profile": profile.to_dict(), "model": dataclasses.asdict(model),
                        "options": opts, "cluster_spec": spec.to_dict(),
                        "measured_cpu_ms_busiest_rank": cpu_ms,
                        "simulated_compute_ms": sim.compute_s * 1e3,
                        "simulated_comm_ms": sim.comm_s * 1e3})  # fmt: skip
    return out


HYBRIDEP = ("hybridep_2dc.json", "hybridep_2dc2.json", "hybridep_4dc.json")
TASKFLOW = ("taskflow_cluster.json", "taskflow_cluster_tile128.json")
RUNS = ("flowmoe_cluster.json", *HYBRIDEP, *TASKFLOW)
SCALES = [0.40 + 0.01 * i for i in range(61)]  # bandwidth shares searched: 0.40 .. 1.00


def run_points(name: str, scale: float | str | None = None) -> list[dict[str, Any]]:
    if name in TASKFLOW:
        return taskflow_points(name, scale)
    return flowmoe_points(scale) if name == RUNS[0] else hybridep_points(name, scale)


def cross_validated() -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Leave one run out: the links' bandwidth share that fits the other runs best
    (geometric-mean |error|), then the held-out run predicted with it."""
    rows: list[dict[str, Any]] = []
    fitted = {}
    for held in RUNS:
        others = [n for n in RUNS if n != held]

        def fit_error(scale: float, others: list[str] = others) -> float:
            return geomean_abs([r["error"] for n in others for r in run_points(n, scale)])

        best = min(SCALES, key=fit_error)
        fitted[held] = round(best, 2)
        rows += [
            {**r, "bandwidth_scale_fitted_on_other_runs": best} for r in run_points(held, best)
        ]
    return rows, fitted


def report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Overall, per run, without the taskflow runs, the taskflow runs and their variants."""
    by_source: dict[str, list[float]] = {}
    for r in rows:
        by_source.setdefault(r["source"], []).append(r["error"])
    errors = [r["error"] for r in rows]
    return {
        **_summary(rows),
        "median_abs_error": statistics.median(abs(e) for e in errors),
        "max_abs_error": max(abs(e) for e in errors),
        "by_source_geomean_abs_error": {k: geomean_abs(v) for k, v in by_source.items()},
        "without_taskflow": _summary([r for r in rows if r["source"] not in TASKFLOW]),
        "taskflow_runs": _summary([r for r in rows if r["source"] in TASKFLOW]),
        "taskflow_runs_by_variant": {
            v: _summary([r for r in rows if r["source"] in TASKFLOW and r["point"].startswith(v)])
            for v in ("dropless", "taskflow static ", "taskflow static, kernel order")
        },
    }


def _summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    errors = [r["error"] for r in rows]
    return {
        "points": len(rows),
        "geomean_abs_error": geomean_abs(errors),
        "geomean_ratio_error": math.exp(statistics.fmean(abs(math.log(1 + e)) for e in errors)) - 1,
        "mean_signed_error": statistics.fmean(errors),
    }


def geomean_abs(errors: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(max(abs(e), 1e-6)) for e in errors))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "sim_validation.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    spec_rows = [r for name in RUNS for r in run_points(name)]
    measured = [r for name in RUNS for r in run_points(name, MEASURED)]
    measured_no_cpu = [r for name in RUNS for r in run_points(name, MEASURED_NO_CPU)]
    measured_idle = [r for name in RUNS for r in run_points(name, MEASURED_IDLE)]
    per_cal: dict[str, dict[str, float]] = {}
    for suffix in CALIBRATIONS:
        per_cal[suffix or "_cal1"] = {
            regime: _summary([r for n in RUNS for r in run_points(n, f"{mode}@{suffix}")])[
                "geomean_abs_error"
            ]
            for regime, mode in (("loaded", MEASURED), ("idle", MEASURED_IDLE))
        }
    spread = {
        regime: {
            f: fn(c[regime] for c in per_cal.values())
            for f, fn in (("min", min), ("median", statistics.median), ("max", max))
        }
        for regime in ("loaded", "idle")
    }
    rows, fitted = cross_validated()
    summary = {
        "measured_calibration": report(measured),
        "measured_calibration_idle_collectives": report(measured_idle),
        "calibrations_geomean_abs_error": per_cal,
        "calibrations_spread": spread,
        "measured_calibration_without_taskflow_cpu_model": report(measured_no_cpu),
        "fitted_share_leave_one_run_out": {
            **report(rows),
            "bandwidth_scale_fitted_leave_one_run_out": fitted,
        },
        "links_as_checked": report(spec_rows),
        "wall_s": time.perf_counter() - t0,
    }
    out = {
        "meta": run_metadata(),
        "summary": summary,
        "rows": measured,
        "rows_measured_without_taskflow_cpu_model": measured_no_cpu,
        "rows_measured_idle_collectives": measured_idle,
        "rows_fitted": rows,
        "rows_links_as_checked": spec_rows,
        "notes": __doc__,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    fit = {(r["source"], r["point"]): r for r in rows}
    idle = {(r["source"], r["point"]): r for r in measured_idle}
    for r in measured:
        f, i = fit[(r["source"], r["point"])], idle[(r["source"], r["point"])]
        print(f"{r['source']:28s} {r['point']:44s} meas {r['measured_ms']:8.1f} "
              f"sim {r['simulated_ms']:8.1f} err {r['error']:+.1%} (idle {i['error']:+.1%}, "
              f"fitted {f['error']:+.1%})")  # fmt: skip
    brief = {k: {kk: v[kk] for kk in ("geomean_abs_error", "geomean_ratio_error",
                                       "by_source_geomean_abs_error", "without_taskflow",
                                       "taskflow_runs_by_variant")}
             for k, v in summary.items() if isinstance(v, dict) and "geomean_abs_error" in v}  # fmt: skip
    print(json.dumps(brief, indent=1))
    print(json.dumps({"per_calibration": per_cal, "spread": spread}, indent=1))


if __name__ == "__main__":
    main()
