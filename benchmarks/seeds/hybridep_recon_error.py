"""SR compression's relative reconstruction error on trained expert weights (issue 54 item 2),
from the final checkpoints of ``hybridep_training.py``'s runs.

**The rule** (fixed on 2026-12-04 at 04:32 UTC and committed before any checkpoint was read):

* Weights: every MoE layer's experts (w1, w3, w2 of all 8 experts, 4 layers) of the final
  checkpoint of ``cr1`` (trained with exact gathers) and of every compressed run (trained with
  its own compression: the weights its gathers actually encoded at the end).
* Per weight matrix and expert: ``||w - decode(encode(w))|| / ||w||``
  (:func:`moesaic.placement.compress.sr_roundtrip`) at ratios 10 and 50, against three shared
  experts: "domain" (the mean of the expert's domain: experts 0-3 or 4-7, EP 4 with domains of
  2 ranks and 2 experts per rank), "all" (the mean of all 8) and "none" (zeros: top-k of the
  weight itself). The ``cr1`` checkpoint gets every (ratio, shared) pair; a compressed run its
  own pair. Reported: mean and max over the 96 (layer, matrix, expert) weights, and the mean
  residual norm ``||w - shared|| / ||w||`` (what the top-k has to keep).
* Beside it, the same at initialisation (seed 0, the runs' model: ``moesaic train``'s init of
  the experts, the Gaussian of 1/sqrt(fan_in)), the case the earlier 0.21 at ratio 50 came from.

Usage: ``python benchmarks/seeds/hybridep_recon_error.py`` (busy: a few seconds) ->
``benchmarks/results/seeds_hybridep_recon.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from moesaic.placement.compress import sr_roundtrip
from moesaic.train.checkpoint import load_model_for_inference
from moesaic.train.ckpt_choice import latest_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybridep_training import EXTRA, RUNS, RUNS_DIR

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "benchmarks" / "results" / "seeds_hybridep_recon.json"
RATIOS = [10.0, 50.0]
SCOPES = ["domain", "all", "none"]
DOMAIN_EXPERTS = 4  # 2 ranks x 2 experts


def _experts(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """(name, [E, *X]) of every expert weight matrix."""
    return [(k, v.detach().double()) for k, v in state.items() if ".moe.experts.w" in k]


def _shared(w_EX: torch.Tensor, g: int, scope: str) -> torch.Tensor:
    if scope == "none":
        return torch.zeros_like(w_EX[0])
    if scope == "all":
        return w_EX.mean(dim=0)
    d = g // DOMAIN_EXPERTS
    return w_EX[d * DOMAIN_EXPERTS : (d + 1) * DOMAIN_EXPERTS].mean(dim=0)


def errors(state: dict[str, torch.Tensor], cr: float, scope: str) -> dict:
    errs, res = [], []
    for _, w_EX in _experts(state):
        for g in range(w_EX.shape[0]):
            sh = _shared(w_EX, g, scope)
            _, stats = sr_roundtrip(w_EX[g], sh, cr)
            errs.append(stats.rel_error)
            res.append(float((w_EX[g] - sh).norm() / w_EX[g].norm()))
    return {
        "rel_error_mean": statistics.fmean(errs),
        "rel_error_max": max(errs),
        "residual_norm_mean": statistics.fmean(res),
        "weights": len(errs),
    }


def main() -> None:
    table = {**RUNS, **EXTRA}
    out: dict = {"rule": "benchmarks/seeds/hybridep_recon_error.py docstring", "checkpoints": {}}
    # initialisation: the cr1 run's model config, freshly initialised with seed 0
    cr1 = latest_checkpoint(str(RUNS_DIR / "cr1"))
    if cr1 is None:
        raise SystemExit(f"no checkpoint of cr1 under {RUNS_DIR}: run hybridep_training.py first")
    model, _ = load_model_for_inference(cr1)
    torch.manual_seed(0)
    init = type(model)(model.config).state_dict()
    trained = model.state_dict()
    for label, state in (("init (seed 0)", init), ("cr1 (trained exact)", trained)):
        out["checkpoints"][label] = {
            f"cr{cr:g}-{scope}": errors(state, cr, scope) for cr in RATIOS for scope in SCOPES
        }
    for name, (cr, scope, _) in table.items():
        if cr == 1.0:
            continue
        path = latest_checkpoint(str(RUNS_DIR / name))
        if path is None:
            continue
        state = load_model_for_inference(path)[0].state_dict()
        out["checkpoints"][f"{name} (own)"] = {f"cr{cr:g}-{scope}": errors(state, cr, scope)}
    RESULT.write_text(json.dumps(out, indent=1) + "\n")
    for label, rows in out["checkpoints"].items():
        for key, r in rows.items():
            print(
                f"{label:22s} {key:12s} rel err mean {r['rel_error_mean']:.3f} max "
                f"{r['rel_error_max']:.3f}  ||w - shared||/||w|| {r['residual_norm_mean']:.3f}"
            )


if __name__ == "__main__":
    main()
