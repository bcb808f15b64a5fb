"""Where the host's time goes in a streamed layer step on a GPU: cProfile over ``--steps``
back-to-back forward + backward steps of the dropless layer (bf16, no synchronisation inside),
the top functions by their own time. For a host-bound step (the host issues it slower than the
GPU runs it: ``gpu_layer.py``'s ``host_ms`` near ``stream_ms``) this says what to cut.

``PYTHONPATH=src python3 benchmarks/gpu_host_profile.py [--config fine_grained_k2] [--top 30]``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from moesaic import MoEConfig, MoELayer

sys.path.insert(0, "benchmarks")
from gpu_layer import CONFIGS, make_step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="fine_grained_k2", choices=[c["name"] for c in CONFIGS])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    c = next(c for c in CONFIGS if c["name"] == args.config)
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=c["H"], ffn_hidden_size=c["F"], num_experts=c["E"], top_k=c["K"])
    layer = MoELayer(cfg).to(args.device, torch.bfloat16)
    x = torch.randn(c["T"], c["H"], device=args.device, dtype=torch.bfloat16)
    g = torch.randn_like(x)

    step = make_step(layer, x, g)  # gpu_layer's step: forward, backward of g, grads to None
    for _ in range(5):
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    host_ms = 1e3 * (time.perf_counter() - t0) / args.steps
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(f"{args.config}: host {host_ms:.3f} ms a step under cProfile")
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
