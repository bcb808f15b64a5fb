"""The persistent taskflow layer (one launch per direction) against the fused multi-kernel
``dropless`` layer on one device, and V = 2, 4 virtual ranks in one launch (issue 53).

``PYTHONPATH=src python3 benchmarks/gpu_persistent.py --out OUT.json``
(``--device cpu --quick``: toy sizes under Triton's interpreter, the smoke test: no figures.)

Sweep (FlashDMoE's Tables 6.3-6.5 as far as one device goes): tokens 1k, 4k, 16k x experts 8,
16, 64, H 2048, F 1024, top-2, bf16. Per point:

* ``dropless`` (``kernels="auto"``: the fused multi-kernel layer) and ``taskflow`` (its default
  on CUDA: the persistent kernel at EP 1): one training step each (``gpu_layer.make_step``),
  ``step_ms`` / ``stream_ms`` / ``host_ms`` (``gpu_timing.step_times``), kernel time and
  launches per step (``gpu_timing.kernel_profile``), and ``dropless stream_ms / taskflow
  stream_ms`` (the goal: >= 1.5 where dropless is host-bound, >= 0.9 elsewhere);
* ``virtual-V``: the T tokens split over V virtual ranks (T / V each), the world's forward and
  backward plans in one launch each (``run_virtual``, no autograd), host included;
* the dense-GEMM bound (``gpu_timing.dense_gemm_tflops``: the step's 9 expert GEMMs at one dense
  GEMM's rate) beside each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_layer import expert_flops, make_step
from gpu_timing import dense_gemm_tflops, kernel_profile, step_times
from moesaic import MoEConfig, MoELayer
from moesaic.bench.meta import run_metadata
from moesaic.bench.options import write_json

TOKENS, EXPERTS = (1024, 4096, 16384), (8, 16, 64)
SHAPE = {"H": 2048, "F": 1024, "K": 2}
QUICK = {"T": (16,), "E": (4,), "H": 16, "F": 16, "K": 2}


def _layer(c: dict, dispatcher: str, device, dtype) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(
        hidden_size=c["H"],
        ffn_hidden_size=c["F"],
        num_experts=c["E"],
        top_k=c["K"],
        dispatcher=dispatcher,
        options={"tile_m": c["tile_m"]} if dispatcher == "taskflow" else None,
        kernels="triton" if dispatcher == "taskflow" and device.type == "cpu" else "auto",
    )
    return MoELayer(cfg).to(device=device, dtype=dtype)


def _virtual_step(c: dict, V: int, device, dtype):
    """One forward and one backward launch of V virtual ranks with T / V tokens each."""
    from moesaic.placement import ExpertPlacement
    from moesaic.routing import build_plan
    from moesaic.taskflow import ShapeBucket, slot_rows_for
    from moesaic.taskflow.compile import compile_world
    from moesaic.taskflow.lower import lower_world
    from moesaic.taskflow.runtime.persistent import run_virtual
    from moesaic.taskflow.runtime.sequential import SAVED

    T, E, H, F, K = c["T"] // V, c["E"], c["H"], c["F"], c["K"]
    e = E // V
    g = torch.Generator().manual_seed(V)
    placement = ExpertPlacement.contiguous(E, V)
    routings = []
    for _ in range(V):
        w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K)
        routings.append(build_plan(ids, w, placement))
    load = max(int(r.counts_E.max()) for r in routings)
    bucket = ShapeBucket(
        tokens=T,
        hidden=H,
        ffn=F,
        experts=E,
        top_k=K,
        ep_size=V,
        slot_rows=slot_rows_for(load, c["tile_m"]),
        tile_m=c["tile_m"],
    )
    fwd, bwd = compile_world(bucket, "forward"), compile_world(bucket, "backward")
    wf, wb = lower_world(fwd), lower_world(bwd)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(device, dtype)

    ws = [{"w1": rand(e * H, F), "w3": rand(e * H, F), "w2": rand(e * F, H)} for _ in range(V)]
    xs = [rand(T, H) for _ in range(V)]

    def step() -> None:
        out, _ = run_virtual(wf, fwd, [{"x_TH": x, **w} for x, w in zip(xs, ws)], routings)
        ins = [{"dy_TH": x, **w, **{k: o[k] for k in SAVED}} for x, w, o in zip(xs, ws, out)]
        run_virtual(wb, bwd, ins, routings)

    return step


def run_point(c: dict, device, dtype, args) -> dict:
    flops = expert_flops(c)
    rate = dense_gemm_tflops(c, device, dtype) if device.type == "cuda" else 0.0
    bound_ms = 1e3 * flops / (rate * 1e12) if rate else None
    row: dict = {**c, "dense_gemm_bound_ms": bound_ms, "modules": {}}
    x = torch.randn(c["T"], c["H"], device=device, dtype=dtype)
    g = torch.randn(c["T"], c["H"], device=device, dtype=dtype)
    steps = {d: make_step(_layer(c, d, device, dtype), x, g) for d in ("dropless", "taskflow")}
    for V in (2, 4):
        if c["E"] % V == 0:
            steps[f"virtual-{V}"] = _virtual_step(c, V, device, dtype)
    for name, step in steps.items():
        try:
            r = step_times(step, device, args.iters, args.warmup, args.stream)
            r.update(kernel_profile(step, device, None))
            r.pop("top_kernels", None)
        except Exception as exc:
            r = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        row["modules"][name] = r
        print(
            f"T {c['T']:6d} E {c['E']:3d} {name:12s} "
            + " ".join(f"{k} {v:.3f}" for k, v in r.items() if isinstance(v, float))
            + (f" bound {bound_ms:.3f}" if bound_ms else ""),
            flush=True,
        )
    base, mine = row["modules"]["dropless"], row["modules"]["taskflow"]
    if "stream_ms" in base and "stream_ms" in mine:
        row["dropless_over_taskflow"] = base["stream_ms"] / mine["stream_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="toy sizes (the CPU smoke test)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stream", type=int, default=10)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
        args.iters, args.warmup, args.stream = 1, 0, 1
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    grid = QUICK if args.quick else {"T": TOKENS, "E": EXPERTS, **SHAPE}
    shape = {k: grid[k] for k in ("H", "F", "K")}
    tile_m = 16 if args.quick else 128
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-interpreter"
    doc: dict = {"meta": {**run_metadata(), "device": name, "time": time.time()}, "rows": []}
    for T in grid["T"]:
        for E in grid["E"]:  # written after each point: a run cut short keeps what it measured
            doc["rows"].append(
                run_point({"T": T, "E": E, **shape, "tile_m": tile_m}, device, dtype, args)
            )
            write_json(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
