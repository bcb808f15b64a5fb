"""The old 85-point validation (``sim_validate.py``) re-run with the per-operation compute model
and the CPU contention model.

Usage::

    python benchmarks/sim_opcal_validate.py [--out benchmarks/results/sim_opcal_validation.json]

Every point is ``sim_validate.py``'s headline row (``MEASURED``: the run's own calibrated links,
loaded collective shares, put CPU and cores), simulated twice:

* "before": exactly as ``sim_validate.py`` does (compute fitted to the FlowMoE run's busy time,
  the HybridEP and taskflow benchmarks' own compute-only rates);
* "after": the same profile with the communication CPU (``comm_cpu_s``,
  ``comm_cpu_per_byte_s``: the calibration's put CPU, as ``calibrate --cluster`` now writes
  them) and, for the runs priced by the block pipeline (the FlowMoE run's schedules, the
  taskflow runs' dropless rows), the model's operations timed now on this machine
  (``measure_ops``: one thread, the run's experts per rank) instead of the fitted rate. The
  HybridEP rows (hybrid under vanilla: HybridEP's step, priced by the planning cost model) keep
  their rate and get the contention model only; the taskflow strategy keeps its own CPU floor.

The FlowMoE run's model pinned LayerNorm and learned positions (``flowmoe_cluster.MODEL``);
``measure_ops`` times the current defaults (RMSNorm, rotary positions): a difference of a
few elementwise ops per block. The committed runs were measured days earlier on the same
machine under other load; the operations are timed now (load average recorded).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import sim_validate as sv  # noqa: E402
from moesaic.bench.meta import run_metadata  # noqa: E402
from moesaic.measure.opmeasure import measure_ops  # noqa: E402
from moesaic.sim.model import ModelSpec  # noqa: E402
from moesaic.sim.opcal import OpCal  # noqa: E402
from moesaic.sim.profile import Profile  # noqa: E402
from moesaic.sim.simulate import simulate  # noqa: E402

# strategies priced by the block pipeline (their compute from the measured operations)
PIPELINED = ("vanilla", "moe-only", "flowmoe", "dropless", "padded")


class _After:
    """``simulate`` with the profile extended as the module docstring says; the operations of
    each model measured once."""

    def __init__(self) -> None:
        self.ops: dict[tuple[ModelSpec, int], OpCal] = {}

    def __call__(
        self, spec: Any, model: ModelSpec, strategy: str, profile: Profile, *a: Any
    ) -> Any:
        extra: dict[str, Any] = {
            "comm_cpu_s": profile.put_cpu_s,
            "comm_cpu_per_byte_s": profile.put_cpu_per_byte_s,
        }
        if strategy in PIPELINED:
            key = (model, spec.world_size)
            if key not in self.ops:
                self.ops[key] = measure_ops(model, world=spec.world_size, threads=1)
            extra["ops"] = self.ops[key]
        return simulate(spec, model, strategy, dataclasses.replace(profile, **extra), *a)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/sim_opcal_validation.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    load = {"before": os.getloadavg()}
    before = [r for name in sv.RUNS for r in sv.run_points(name, sv.MEASURED)]
    after_fn = _After()
    sv.simulate = after_fn  # the module's one call site of simulate
    try:
        after = [r for name in sv.RUNS for r in sv.run_points(name, sv.MEASURED)]
    finally:
        sv.simulate = simulate
    load["after"] = os.getloadavg()
    keep = ("source", "cluster", "point", "strategy", "measured_ms", "simulated_ms", "error")
    rows = []
    for b, a in zip(before, after):
        row = {k: b[k] for k in keep}
        row["after_ms"], row["after_error"] = a["simulated_ms"], a["error"]
        row["after_compute_model"] = a.get("compute_model", "")
        row["after_contention"] = a.get("contention")
        rows.append(row)
    summary = {"before": sv.report(before), "after": sv.report(after)}
    result = {
        "meta": run_metadata(),
        "notes": __doc__,
        "load_average_1_5_15": load,
        "wall_s": time.perf_counter() - t0,
        "summary": summary,
        "operations": {
            f"{m.name} world {w}": cal.to_dict() for (m, w), cal in after_fn.ops.items()
        },
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(
            f"{r['source']:28s} {r['point']:44s} meas {r['measured_ms']:8.1f} "
            f"before {r['simulated_ms']:8.1f} ({r['error']:+.1%}) "
            f"after {r['after_ms']:8.1f} ({r['after_error']:+.1%})"
        )
    for k, v in summary.items():
        print(
            k, json.dumps({x: v[x] for x in ("geomean_abs_error", "by_source_geomean_abs_error")})
        )
    print(json.dumps(load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
