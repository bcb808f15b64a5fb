"""How far the CPU layer step can go: its GEMMs alone against the bound, and the fused variants.

``python benchmarks/layer_ceiling.py [--rounds 30] [--out benchmarks/results/layer_ceiling.json]``

Issue 13 asks for ``dropless`` at >= 90% of the single-thread GEMM bound and >= 1.1x torchtitan's
MoE, which runs the same grouped GEMMs. This script measures, interleaved round by round in one
single-threaded process (EP 1, the ``moesaic bench layer`` shape and routings, freed memory
retained as the bench does), what bounds those goals:

* ``gemm_bound``: the bench's bound, the expert FLOPs of a step at the rate of one hot
  ``rows x H x F`` GEMM (rows = the mean expert load), measured every round;
* ``gemms_only``: the nine grouped GEMMs of a step (three forward, six backward) on the step's
  own loads and operands, nothing else: the floor of any implementation that runs them;
* ``expert_ffn``: the library's expert FFN forward + backward (grouped GEMMs + eager SwiGLU);
* ``tiled_ffn``: the same FFN as one autograd Function looping over experts (every GEMM writes
  its slice with ``out=``, activations recomputed per expert from cache-sized blocks) -- the
  cache-blocked variant;
* ``swiglu_eager`` / ``swiglu_compiled``: the SwiGLU forward + backward alone on the step's
  [rows, F], eager and as one inductor kernel (when ``torch.compile`` works here);
* ``layer``: the whole ``dropless`` step (route, permute, experts, combine, aux loss), and
  ``layer_tiled`` the same step with its experts computed by ``tiled_ffn``;
* ``torchtitan``: its MoE step, when installed (``moesaic.bench.peers``); the whole steps are
  interleaved with each other only, after the parts.

``best_case_vs_torchtitan`` = torchtitan / (gemms_only + swiglu_compiled): our speedup if the
step did nothing but its GEMMs and a fused activation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moesaic import experts as experts_module
from moesaic.bench import layer as bl
from moesaic.bench.allocator import retain_freed_memory
from moesaic.bench.meta import run_metadata
from moesaic.bench.peer_names import peer_installed
from moesaic.experts import expert_ffn


class TiledFFN(torch.autograd.Function):
    """SwiGLU experts, one expert's rows at a time, GEMMs writing their output slices."""

    @staticmethod
    def forward(ctx, x_MH, w1_eHF, w3_eHF, w2_eFH, counts_e):
        M, Fh = x_MH.shape[0], w1_eHF.shape[2]
        a_MF, b_MF = x_MH.new_empty(M, Fh), x_MH.new_empty(M, Fh)
        y_MH = x_MH.new_empty(x_MH.shape)
        for i, (r0, r1) in enumerate(_bounds(counts_e)):
            xi = x_MH[r0:r1]
            torch.mm(xi, w1_eHF[i], out=a_MF[r0:r1])
            torch.mm(xi, w3_eHF[i], out=b_MF[r0:r1])
            torch.mm(F.silu(a_MF[r0:r1]).mul_(b_MF[r0:r1]), w2_eFH[i], out=y_MH[r0:r1])
        ctx.save_for_backward(x_MH, w1_eHF, w3_eHF, w2_eFH, a_MF, b_MF)
        ctx.counts_e = counts_e
        return y_MH

    @staticmethod
    def backward(ctx, dy_MH):
        x_MH, w1, w3, w2, a_MF, b_MF = ctx.saved_tensors
        dy_MH = dy_MH.contiguous()
        dx = torch.empty_like(x_MH)
        # Every slice is written by an ``out=`` GEMM (zeros for an expert with no rows).
        dw1, dw3, dw2 = torch.empty_like(w1), torch.empty_like(w3), torch.empty_like(w2)
        for i, (r0, r1) in enumerate(_bounds(ctx.counts_e)):
            xi, ai, bi, dyi = x_MH[r0:r1], a_MF[r0:r1], b_MF[r0:r1], dy_MH[r0:r1]
            silu = F.silu(ai)
            torch.mm((silu * bi).t(), dyi, out=dw2[i])
            dh = torch.mm(dyi, w2[i].t())
            db = dh * silu
            da = torch.ops.aten.silu_backward(dh.mul_(bi), ai)
            torch.mm(xi.t(), da, out=dw1[i])
            torch.mm(xi.t(), db, out=dw3[i])
            torch.mm(da, w1[i].t(), out=dx[r0:r1])
            dx[r0:r1].addmm_(db, w3[i].t())
        return dx, dw1, dw3, dw2, None


def _bounds(counts_e: list[int]) -> list[tuple[int, int]]:
    out, r0 = [], 0
    for c in counts_e:
        out.append((r0, r0 + c))
        r0 += c
    return out


def _agreement(ref, other, params, dy) -> float:
    """Largest relative difference of the output and every gradient of ``other`` vs ``ref``."""
    results = []
    for fn in (ref, other):
        for p in params:
            p.grad = None
        y = fn()
        y.backward(dy)
        results.append([y.detach()] + [p.grad.clone() for p in params])
    return max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(*results))


def _swiglu(a, b):
    return F.silu(a) * b


def _measure(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _interleaved(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median ms of each case over ``rounds`` interleaved rounds (after 2 warm-up rounds)."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(rounds + 2):
        for name, fn in cases.items():
            dt = min(_measure(fn) for _ in range(5)) if name == "hot_gemm" else _measure(fn)
            if r >= 2:
                times[name].append(dt)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def _with_tiled_experts(fn: Callable[[], object]) -> None:
    """Run ``fn`` with the layer's experts computed by ``TiledFFN`` (SwiGLU only)."""
    original = experts_module.expert_ffn

    def tiled(x_MH, counts_e, w1, w3, w2):
        return TiledFFN.apply(x_MH, w1, w3, w2, counts_e)

    experts_module.expert_ffn = tiled
    try:
        fn()
    finally:
        experts_module.expert_ffn = original


def _routing_loads(bench: bl.LayerBench, routing: str) -> list[int]:
    """The dropless layer's expert loads on the bench's inputs of ``routing``."""
    layer = bl._layer(bench, "dropless", routing)
    x, _ = bl._inputs(bench, routing, 0)
    with torch.no_grad():
        layer(x)
    return [int(c) for c in layer.stats.counts_E.tolist()]


def measure(bench: bl.LayerBench, routing: str, rounds: int, compiled) -> dict:
    counts = _routing_loads(bench, routing)
    M, H, Fh, E = sum(counts), bench.hidden_size, bench.ffn_hidden_size, bench.num_experts
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    x = rnd(M, H)
    w1, w3, w2 = rnd(E, H, Fh, scale=H**-0.5), rnd(E, H, Fh, scale=H**-0.5), rnd(E, Fh, H)
    dy_MH, dh_MF = torch.randn(M, H, generator=gen), torch.randn(M, Fh, generator=gen)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    xd, w1d, w3d, w2d = (t.detach() for t in (x, w1, w3, w2))
    h_MF = torch.randn(M, Fh, generator=gen)

    def gemms_only():
        gmm = torch._grouped_mm
        gmm(xd, w1d, offs=offs), gmm(xd, w3d, offs=offs), gmm(h_MF, w2d, offs=offs)
        gmm(dy_MH, w2d.transpose(-2, -1), offs=offs), gmm(h_MF.t(), dy_MH, offs=offs)
        gmm(dh_MF, w1d.transpose(-2, -1), offs=offs), gmm(dh_MF, w3d.transpose(-2, -1), offs=offs)
        gmm(xd.t(), dh_MF, offs=offs), gmm(xd.t(), dh_MF, offs=offs)

    def ffn(fn):
        def run():
            for t in (x, w1, w3, w2):
                t.grad = None
            fn().backward(dy_MH)

        return run

    a_MF, b_MF = rnd(M, Fh), rnd(M, Fh)

    def act(fn):
        def run():
            a_MF.grad = b_MF.grad = None
            fn(a_MF, b_MF).backward(dh_MF)

        return run

    rows = max(1, M // E)
    ga, gb = torch.randn(rows, H, generator=gen), torch.randn(H, Fh, generator=gen)
    layer = bl._layer(bench, "dropless", routing)
    lx, lg = bl._inputs(bench, routing, 0)
    cases = {
        "hot_gemm": lambda: ga @ gb,
        "gemms_only": gemms_only,
        "expert_ffn": ffn(lambda: expert_ffn(x, counts, w1, w3, w2)),
        "tiled_ffn": ffn(lambda: TiledFFN.apply(x, w1, w3, w2, counts)),
        "swiglu_eager": act(_swiglu),
        "layer": lambda: bl._train_step(layer, lx, lg),
        "layer_tiled": lambda: _with_tiled_experts(lambda: bl._train_step(layer, lx, lg)),
    }
    if compiled is not None:
        cases["swiglu_compiled"] = act(compiled)
    if peer_installed("torchtitan"):
        from moesaic.bench.peers import build_peer

        # torchtitan's counterpart is dropless itself (same top-k, normalised weights).
        titan = build_peer("torchtitan", bl._layer(bench, "dropless", routing))
        cases["torchtitan"] = lambda: bl._train_step(titan, lx, lg)
    agreement = _agreement(
        lambda: expert_ffn(x, counts, w1, w3, w2),
        lambda: TiledFFN.apply(x, w1, w3, w2, counts),
        (x, w1, w3, w2),
        dy_MH,
    )
    # Two interleaved groups: the whole steps, then the parts, so a whole step is timed next to
    # the other whole steps only (as in ``moesaic bench layer``).
    steps = {
        name: cases.pop(name) for name in ("layer", "layer_tiled", "torchtitan") if name in cases
    }
    med = {**_interleaved(steps, rounds), **_interleaved(cases, rounds)}
    flops = 2 * 3 * 3 * H * Fh * M
    rate = 2 * rows * H * Fh / (med.pop("hot_gemm") / 1e3)
    out = {
        "routing": routing,
        "loads": counts,
        "tiled_vs_expert_ffn_max_rel_diff": agreement,
        "median_ms": med,
        "hot_gemm_gflops": rate / 1e9,
        "gemm_bound_ms": flops / rate * 1e3,
    }
    out["fraction_of_bound"] = {k: out["gemm_bound_ms"] / v for k, v in med.items()}
    out["gemms_only_gflops"] = flops / med["gemms_only"] / 1e6
    out["non_gemm_ms"] = {
        k: med[k] - med["gemms_only"] for k in ("layer", "torchtitan") if k in med
    }
    if "torchtitan" in med:
        floor = med["gemms_only"] + med.get("swiglu_compiled", med["swiglu_eager"])
        out["best_case_vs_torchtitan"] = med["torchtitan"] / floor
        out["layer_vs_torchtitan"] = med["torchtitan"] / med["layer"]
        out["layer_tiled_vs_torchtitan"] = med["torchtitan"] / med["layer_tiled"]
    return out


def _compiled_swiglu():
    try:
        fn = torch.compile(_swiglu, dynamic=True)
        a = torch.randn(8, 16, requires_grad=True)
        fn(a, torch.randn(8, 16)).sum().backward()
        return fn
    except Exception as err:  # no C++ compiler, no inductor: report and go on without it
        print(f"torch.compile unavailable here ({type(err).__name__}): skipping", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/layer_ceiling.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    retain_freed_memory()
    bench = bl.LayerBench()
    compiled = _compiled_swiglu()
    result = {
        "benchmark": "layer_ceiling",
        "meta": run_metadata(),
        "shape": {"H": bench.hidden_size, "F": bench.ffn_hidden_size, "E": bench.num_experts},
        "rounds": args.rounds,
        "rows": [measure(bench, r, args.rounds, compiled) for r in bl.ROUTINGS],
    }
    for row in result["rows"]:
        med = row["median_ms"]
        print(f"{row['routing']}: bound {row['gemm_bound_ms']:.1f} ms", end="")
        for k, v in med.items():
            print(f" | {k} {v:.1f} ({row['fraction_of_bound'][k]:.2f})", end="")
        print(f" | best case vs torchtitan {row.get('best_case_vs_torchtitan', float('nan')):.2f}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
