"""The MoE layer's training step on one GPU, beside torchtitan's MoE and the transformers
Mixtral block with the same weights: where the step's time goes and how far it is from the
dense-GEMM bound.

``PYTHONPATH=src python3 benchmarks/gpu_layer.py --out OUT.json [--traces DIR]``
(``--device cpu --quick``: every part at toy sizes, the CPU smoke test.)

For each layer shape (bf16 on a GPU; ``CONFIGS``) and each module (``dropless`` with the
default kernels, its ``VARIANTS`` of ``MoEConfig.kernels``, ``padded`` at capacity factor 1.25,
``dropless`` with the whole step in one CUDA graph, torchtitan's ``MoE`` when installed, the
transformers ``MixtralSparseMoeBlock``; ``--modules`` picks some):

* agreement with ``dropless`` on one forward + backward on fresh random inputs (the output's
  and the input gradient's norm-relative and max-relative errors; for torchtitan its expert
  weight gradients too); padded drops tokens and the graphed step is dropless itself: neither
  is checked;
* ``step_ms``: median of single synchronised steps (forward, backward of the upstream
  gradient g with the aux loss each library adds, grads set to None), the host clock around
  each; ``dropless[(y*g).sum()]`` is dropless with the earlier runs' step, which
  backpropagated the loss ``(y g).sum()`` (the same gradients plus the loss's kernels);
* ``stream_ms``: ``--stream`` steps back to back and one synchronisation, per step (what a
  training loop sees: the host runs ahead of the GPU unless something syncs it); ``host_ms``:
  the host's time to issue each of them;
* ``kernel_ms`` and ``busy_ms``: the GPU's kernel time per step (torch.profiler over 3
  back-to-back steps), summed and as a union, the GPU idle time inside those steps
  (``gap_ms``: the host gaps) and the top kernels;
* ``host_syncs``: operations that made the host wait for the GPU in one step
  (``torch.cuda.set_sync_debug_mode("warn")``);
* with ``--profile`` (``moesaic calibrate``'s, measured on the same GPU first): the simulator's
  prediction of the layer step alone (vanilla schedule, one rank, ``gpu_check.simulated``)
  beside the measured ``dropless`` step.

The dense-GEMM bound: the step's expert GEMM FLOPs (9 GEMMs of 2 H F per routed row, forward
and backward) at the rate of one dense ``T K x H @ H x F`` GEMM of the same dtype measured in
the same run. ``fraction_of_dense_bound`` = bound / ``stream_ms``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moesaic import MoEConfig, MoELayer, aux_loss
from moesaic.bench.meta import run_metadata
from moesaic.bench.options import write_json
from moesaic.bench.peer_names import peer_installed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import dense_gemm_tflops, host_syncs, kernel_profile, step_times

CONFIGS = [
    # Mixtral 8x7B's width and expert shape at 8k tokens per step.
    {"name": "mixtral_like", "H": 2048, "F": 4096, "E": 8, "K": 2, "T": 8192},
    # Fine-grained: each Mixtral expert split in 4 (F / 4, K x 4, E 64), the same FLOPs.
    {"name": "fine_grained", "H": 2048, "F": 1024, "E": 64, "K": 8, "T": 8192},
    # E 64, F 1024 at top-2 (the shape of the earlier H100 run, F 1408 -> 1024).
    {"name": "fine_grained_k2", "H": 2048, "F": 1024, "E": 64, "K": 2, "T": 16384},
]
QUICK = [{"name": "tiny", "H": 64, "F": 128, "E": 8, "K": 2, "T": 256}]


def expert_flops(c: dict) -> float:
    return 9 * 2.0 * c["H"] * c["F"] * c["T"] * c["K"]


# ------------------------------------------------------------------------------- the modules
def _loss_terms(module) -> torch.Tensor | None:
    if isinstance(module, MoELayer):
        return aux_loss(module)
    terms = getattr(module, "loss_terms", None)
    return terms() if terms is not None else None


def _backward(module, x: torch.Tensor, g: torch.Tensor) -> None:
    """The layer's forward and backward with upstream gradient ``g`` (``y.backward(g)``), the
    aux loss its library adds backpropagated with it."""
    y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    extra = _loss_terms(module)
    if extra is None:
        y.backward(g)
    else:
        torch.autograd.backward([y, extra], [g, torch.ones_like(extra)])


def _summed_loss_backward(module, x: torch.Tensor, g: torch.Tensor) -> None:
    """The step of the earlier runs (issue 27: the first H200 session, the second's call 1):
    the loss ``(y * g).sum()`` plus the aux loss, backpropagated: the same gradients, plus the
    loss's own elementwise kernels (a product, a sum and their backward: about 80 us of
    kernels in an 8k-token Mixtral-like step on an H200)."""
    y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    loss = (y * g).sum()
    extra = _loss_terms(module)
    (loss if extra is None else loss + extra.to(loss.device)).backward()


def make_step(module, x: torch.Tensor, g: torch.Tensor, backward=_backward) -> Callable[[], None]:
    """One training step of ``module``: forward, backward of ``g``, grads set to None."""

    def step() -> None:
        backward(module, x.detach().requires_grad_(), g)
        module.zero_grad(set_to_none=True)

    return step


def summed_loss_step(module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    """``make_step`` with the earlier runs' summed loss (``_summed_loss_backward``)."""
    return make_step(module, x, g, _summed_loss_backward)


def graphed_step(module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    """The same step captured once in a CUDA graph (static input, output and gradients),
    replayed per call: what the step costs with no host work at all."""
    static_x = x.detach().clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def body() -> None:
        _backward(module, static_x, g)

    with torch.cuda.stream(side):
        for _ in range(3):
            module.zero_grad(set_to_none=True)
            static_x.grad = None
            body()
    torch.cuda.current_stream().wait_stream(side)
    module.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph.replay


# Variants of dropless: other values of MoEConfig.kernels ("dropless" itself is the default,
# "auto": "fused" on a GPU).
VARIANTS: dict[str, dict[str, str]] = {
    "dropless[kernels=torch]": {"kernels": "torch"},
    "dropless[kernels=triton]": {"kernels": "triton"},
}


def build_modules(c: dict, device, dtype, wanted: Callable[[str], bool]) -> tuple[dict, dict]:
    """``{name: (module, step)}`` of the ``wanted`` modules (dropless always: the others are
    checked against it) and the agreement of each with dropless."""
    from moesaic.bench.layer import _check_step
    from moesaic.bench.peers import _rel, build_peer, compare

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(c["T"], c["H"], generator=gen).to(device, dtype)
    g = torch.randn(c["T"], c["H"], generator=gen).to(device, dtype)

    def layer(**kw) -> MoELayer:
        torch.manual_seed(0)  # the same weights for every module
        cfg = MoEConfig(
            hidden_size=c["H"], ffn_hidden_size=c["F"], num_experts=c["E"], top_k=c["K"], **kw
        )
        return MoELayer(cfg).to(device, dtype)

    ours = layer(dispatcher="dropless")
    modules: dict = {"dropless": (ours, make_step(ours, x, g))}
    checks: dict = {}
    gen2 = torch.Generator().manual_seed(2)  # fresh inputs for the agreement checks
    xc = torch.randn(c["T"], c["H"], generator=gen2).to(device, dtype)
    gc = torch.randn(c["T"], c["H"], generator=gen2).to(device, dtype)
    y_o, dx_o = _check_step(ours, xc, gc)

    def agreement(module) -> dict[str, float]:
        """``module`` against dropless on the fresh inputs: output and input gradient."""
        y, dx = _check_step(module, xc, gc)
        return {
            "norm_rel_y": _norm_rel(y, y_o),
            "norm_rel_dx": _norm_rel(dx, dx_o),
            "max_rel_y": _rel(y, y_o),
            "max_rel_dx": _rel(dx, dx_o),
        }

    def add(name: str, build: Callable[[], Any], step=make_step, check: bool = True) -> None:
        """Time ``build()`` as ``name`` (its agreement first); a failure is recorded."""
        try:
            module = build()
            if check:
                checks[name] = agreement(module)
            modules[name] = (module, step(module, x, g))
        except Exception as exc:
            checks[name] = {
                "error": f"{type(exc).__name__}: {exc}"[:1000],
                "where": traceback.format_exc()[-3000:],
            }

    for name, kw in VARIANTS.items():
        if wanted(name) and ("triton" not in kw.values() or device.type == "cuda"):
            add(name, lambda kw=kw: layer(dispatcher="dropless", **kw))
    if wanted("padded-cf1.25"):  # drops tokens: not the same function as dropless
        add("padded-cf1.25", lambda: layer(dispatcher="padded", capacity_factor=1.25), check=False)
    if wanted("dropless[(y*g).sum()]"):  # the earlier runs' step: the same function
        add("dropless[(y*g).sum()]", lambda: layer(dispatcher="dropless"), summed_loss_step, False)
    if device.type == "cuda" and wanted("dropless+cuda-graph"):
        add("dropless+cuda-graph", lambda: layer(dispatcher="dropless"), graphed_step, False)
    if wanted("torchtitan"):
        if peer_installed("torchtitan"):
            add("torchtitan", lambda: build_peer("torchtitan", ours).to(device, dtype))
            if "torchtitan" in modules:  # its expert weight gradients too
                peer = modules["torchtitan"][0]
                checks["torchtitan"]["max_rel_dw"] = compare(
                    peer, ours, xc, gc, _check_step
                ).max_rel_dw
        else:
            checks["torchtitan"] = {"error": "not installed"}
    if device.type == "cuda" and wanted("dropless+compile"):
        add("dropless+compile", lambda: compiled(layer(dispatcher="dropless"), fullgraph=False))
    if device.type == "cuda" and wanted("torchtitan+compile") and peer_installed("torchtitan"):
        add(
            "torchtitan+compile",
            lambda: compiled(build_peer("torchtitan", ours).to(device, dtype), fullgraph=True),
        )
    if wanted("transformers-mixtral"):
        from moesaic.interop.hf import mixtral_block_from_layer

        add(
            "transformers-mixtral",
            lambda: _Flat(mixtral_block_from_layer(ours).to(device, dtype).train()),
        )
    return modules, checks


def compiled(module: torch.nn.Module, fullgraph: bool) -> torch.nn.Module:
    """``module`` compiled in place the way torchtitan's trainer compiles its blocks
    (``torchtitan.distributed.compile.apply_compile``: scalar outputs captured for the MoE's
    data-dependent shapes, ``module.compile(fullgraph=True)``). Ours compiles with graph
    breaks allowed (``fullgraph=False``): its compute is one graph (its Triton kernels custom
    ops), its bookkeeping after it eager (one break); torchtitan's MoE compiles whole. A peer
    compiles its library's module
    (``PeerModule.inner``), not our calling-convention wrapper around it."""
    torch._dynamo.config.capture_scalar_outputs = True
    getattr(module, "inner", module).compile(fullgraph=fullgraph)
    return module


class _Flat(torch.nn.Module):
    """A ``[B, S, H]`` block behind ``forward(x [T, H]) -> y [T, H]``."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x.view(1, *x.shape))
        y = y[0] if isinstance(y, tuple) else y
        return y.view(x.shape)


def _norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: a few tokens routed differently (bf16 near-ties) move the max error,
    not this."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_config(c: dict, device, dtype, args) -> dict:
    flops = expert_flops(c)
    rate = dense_gemm_tflops(c, device, dtype) if device.type == "cuda" else 0.0
    bound_ms = 1e3 * flops / (rate * 1e12) if rate else None
    row: dict = {**c, "expert_gflop_per_step": flops / 1e9, "dense_gemm_tflops": rate}
    row["dense_gemm_bound_ms"] = bound_ms
    chosen = set(filter(None, args.modules.split(",")))
    modules, checks = build_modules(
        c, device, dtype, lambda name: not chosen or name == "dropless" or name in chosen
    )
    row["agreement"] = checks
    if args.profile is not None:
        from gpu_check import simulated
        from moesaic.sim.profile import Profile

        pred = simulated(
            {**c, "dtype": "bf16" if dtype == torch.bfloat16 else "fp32"},
            Profile.load(args.profile),
        )
        row["simulated_ms"] = pred["iteration_ms"]
    row["modules"] = {}
    passes = timed_passes(c, modules, device, args)
    for name, (_module, step) in modules.items():
        try:
            r = passes[name]
            if "error" in r:
                raise RuntimeError(r["error"])
            where = host_syncs(step, device)
            r["host_syncs"] = None if where is None else len(where)
            r["host_sync_sites"] = where
            trace = None
            if args.traces is not None and name in (
                "dropless",
                "torchtitan",
                "dropless+cuda-graph",
            ):
                trace = args.traces / f"{c['name']}_{name}.json.gz"
            r.update(kernel_profile(step, device, trace))
            if bound_ms:
                r["fraction_of_dense_bound"] = bound_ms / r["stream_ms"]
                r["fraction_of_dense_bound_sync"] = bound_ms / r["step_ms"]
            r["expert_tflops"] = flops / (r["stream_ms"] * 1e-3) / 1e12
            if device.type == "cuda":
                r["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                torch.cuda.reset_peak_memory_stats(device)
        except Exception as exc:
            r = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        row["modules"][name] = r
        print(_line(c, name, r, bound_ms), flush=True)
        if name == "dropless" and "simulated_ms" in row and "error" not in r:
            row["simulated_error"] = row["simulated_ms"] / r["stream_ms"] - 1.0
            print(
                f"{c['name']:16s} simulated {row['simulated_ms']:.3f} ms "
                f"({row['simulated_error']:+.1%} of dropless stream_ms)",
                flush=True,
            )
    row["race"] = race(row["modules"])
    if row["race"]:
        print(f"{c['name']:16s} race {row['race']}", flush=True)
    del modules
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def timed_passes(c: dict, modules: dict, device, args) -> dict[str, dict]:
    """``args.passes`` rounds over the modules, one ``step_times`` of each per round
    (interleaved: a clock or thermal drift falls on every module alike); per module the
    median of each figure over the rounds, every round's ``stream_ms`` and its spread, or the
    first error."""
    rounds: dict[str, list[dict]] = {name: [] for name in modules}
    errors: dict[str, dict] = {}
    for i in range(args.passes):
        for name, (_module, step) in modules.items():
            if name in errors:
                continue
            if name == "transformers-mixtral" and c["E"] > 16 and not args.quick:
                iters, stream = 3, 3  # a Python loop over 64 experts: a few steps say enough
            else:
                iters, stream = args.iters, args.stream
            try:
                warmup = args.warmup if i == 0 else 1
                rounds[name].append(step_times(step, device, iters, warmup, stream))
            except Exception as exc:
                errors[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    out: dict[str, dict] = {}
    for name, runs in rounds.items():
        if name in errors:
            out[name] = errors[name]
            continue
        r = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        r["step_ms_min"] = min(run["step_ms_min"] for run in runs)
        r["passes"] = len(runs)
        r["passes_stream_ms"] = [run["stream_ms"] for run in runs]
        r["stream_ms_spread"] = [min(r["passes_stream_ms"]), max(r["passes_stream_ms"])]
        out[name] = r
    return out


def race(modules: dict[str, dict]) -> dict:
    """Ours against the better torchtitan (eager or compiled): each one's better median
    ``stream_ms`` and the ratio (torchtitan / ours: above 1, ours is faster)."""

    def best(names: tuple[str, ...]) -> tuple[str, float] | None:
        ok = [(modules[n]["stream_ms"], n) for n in names if "stream_ms" in modules.get(n, {})]
        return None if not ok else (min(ok)[1], min(ok)[0])

    ours = best(("dropless", "dropless+compile"))
    theirs = best(("torchtitan", "torchtitan+compile"))
    if ours is None or theirs is None:
        return {}
    return {
        "ours": ours[0],
        "ours_ms": ours[1],
        "torchtitan": theirs[0],
        "torchtitan_ms": theirs[1],
        "speedup": theirs[1] / ours[1],
    }


def _line(c: dict, name: str, r: dict, bound_ms) -> str:
    if "error" in r:
        return f"{c['name']:16s} {name:22s} ERROR {r['error'][:300]}"
    frac = r.get("fraction_of_dense_bound")
    return (
        f"{c['name']:16s} {name:22s} step {r['step_ms']:7.3f} ms  stream {r['stream_ms']:7.3f} ms"
        f"  host {r.get('host_ms', float('nan')):6.3f}  busy {r.get('busy_ms', float('nan')):6.3f}"
        f"  kernels {r.get('kernel_ms', float('nan')):7.3f}  gaps {r.get('gap_ms', float('nan')):6.3f}"
        f"  syncs {r.get('host_syncs')}  bound {bound_ms or float('nan'):.3f}"
        f"  frac {frac if frac is not None else float('nan'):.2f}"
        f"  spread {r.get('stream_ms_spread')}"
    )


def repredict(result_path: Path, profile_path: Path | None, out: Path) -> int:
    """``result_path`` with each layer's ``repredicted_ms`` / ``repredicted_error`` (against
    the measured dropless ``stream_ms``) from the simulator as it is now."""
    import json

    from moesaic.sim.profile import Profile

    if profile_path is None:
        print("gpu_layer: --repredict needs --profile", file=sys.stderr)
        return 2
    from gpu_check import simulated

    result = json.loads(result_path.read_text())
    profile = Profile.load(profile_path)
    dtype = "bf16" if "bfloat16" in result["dtype"] else "fp32"
    for c in result["configs"]:
        shape = {k: c[k] for k in ("name", "H", "F", "E", "K", "T")}
        c["repredicted_ms"] = simulated({**shape, "dtype": dtype}, profile)["iteration_ms"]
        c["repredicted_error"] = c["repredicted_ms"] / c["modules"]["dropless"]["stream_ms"] - 1
        print(
            f"{c['name']:16s} measured {c['modules']['dropless']['stream_ms']:.3f} ms, "
            f"predicted {c['repredicted_ms']:.3f} ms ({c['repredicted_error']:+.1%})"
        )
    result["repredicted_with"] = {"profile": str(profile_path), "argv": sys.argv[1:]}
    write_json(result, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--traces", type=Path, help="folder for gzipped Chrome traces")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--stream", type=int, default=20)
    p.add_argument("--passes", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--profile", type=Path, help="moesaic calibrate's profile: simulate too")
    p.add_argument("--only", default="", help="comma list of config names")
    p.add_argument("--modules", default="", help="comma list of modules to time (default all)")
    p.add_argument("--commit", default="")
    p.add_argument(
        "--repredict",
        type=Path,
        help="no measuring: this script's earlier result, with --profile: the simulator's "
        "prediction of each layer again (the code as it is now), written to --out",
    )
    args = p.parse_args(argv)
    if args.repredict is not None:
        return repredict(args.repredict, args.profile, args.out)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_layer: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.traces is not None:
        args.traces.mkdir(parents=True, exist_ok=True)
    meta = run_metadata()
    if args.commit:
        meta["commit"] = args.commit
    if device.type == "cuda":
        meta["cuda"] = torch.version.cuda
        meta["device"] = torch.cuda.get_device_name(device)
    result: dict = {"meta": meta, "argv": sys.argv[1:], "dtype": str(dtype), "configs": []}
    only = set(filter(None, args.only.split(",")))
    for c in QUICK if args.quick else CONFIGS:
        if only and c["name"] not in only:
            continue
        result["configs"].append(run_config(c, device, dtype, args))
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
