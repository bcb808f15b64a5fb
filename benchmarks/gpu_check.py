"""The layer, the simulator and training on a GPU: correctness, speed against the GEMM bound,
the simulator's prediction from a GPU profile, and a short NCCL training run.

``PYTHONPATH=src python3 benchmarks/gpu_check.py --device cuda --out OUT.json
[--profile sim_profile.json] [--train-steps 40 --train-log train_log.txt]``

``--device cpu --quick`` runs every part at toy sizes (the CPU smoke test uses it).

0. ``tests``: ``pytest tests/gpu -m gpu`` in a subprocess (NCCL at world size 1 with the
   single-rank shortcuts off, several ranks sharing the GPU over gloo, the host-sync check, a
   few ``moesaic train`` steps on NCCL per schedule), before the benchmark: counts per
   outcome, the failed tests and the output's tail. Exit 1 if any failed. Without CUDA every
   one skips.
1. ``correctness``: every strategy that builds at EP = 1, fp32 and bf16, forward output and the
   gradients of the input and every parameter against ``moesaic.reference`` on the same device
   (fp64 truth, same-dtype reference), by the relative rule ``err <= 2 * err_ref + 4 eps
   scale`` (``moesaic.testing.assert_close_to_ref``, with eps of the dtype); records whether
   ``torch._grouped_mm`` (the fast path) passed its self-check and was used. Exit 1 on a miss.
2. ``speed``: forward + backward (loss = (y * g).sum() + aux) of ``dropless`` and ``padded``,
   median of ``--iters`` after warm-up, synchronised; the hot-GEMM bound = the step's expert
   GEMM FLOPs at the rate of one dense ``rows x H x F`` GEMM (rows = the mean expert load) of
   the same dtype measured in the same run, and the fraction of that bound reached.
3. ``simulator``: the vanilla schedule of the same layer alone (``layer_only``) on a one-rank
   cluster under the given profile (``moesaic calibrate``'s, else ``measure.machine.measure``),
   predicted step vs measured ``dropless`` step. Nothing is tuned to the measurement.
4. ``train``: ``torchrun --standalone --nproc_per_node 1 -m moesaic.train`` (backend auto), loss
   first / last and step time from its metrics.jsonl; a failure is recorded, not raised.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moesaic import MoEConfig, MoELayer, aux_loss
from moesaic import experts as experts_module
from moesaic.bench.meta import run_metadata, summarize, time_calls
from moesaic.bench.options import write_json
from moesaic.reference import ReferenceMoE
from moesaic.strategies import strategy_names
from moesaic.testing import ref_errors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Speed configs: the bench_layer default and two GPU-sized layers (Mixtral-like: few wide
# experts; DeepSeek-like: many narrow ones), bf16 as GPUs train.
SPEED_FULL = [
    {"name": "bench_default", "H": 256, "F": 512, "E": 8, "K": 2, "T": 1024, "dtype": "fp32"},
    {"name": "bench_default", "H": 256, "F": 512, "E": 8, "K": 2, "T": 1024, "dtype": "bf16"},
    {"name": "mixtral_like", "H": 2048, "F": 4096, "E": 8, "K": 2, "T": 8192, "dtype": "bf16"},
    {"name": "fine_grained", "H": 2048, "F": 1408, "E": 64, "K": 2, "T": 16384, "dtype": "bf16"},
]
SPEED_QUICK = [
    {"name": "tiny", "H": 64, "F": 128, "E": 4, "K": 2, "T": 128, "dtype": "fp32"},
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, iters: int, warmup: int) -> list[float]:
    """Seconds of ``iters`` synchronised calls of ``fn`` after ``warmup`` untimed ones."""
    return time_calls(lambda: (fn(), _sync(device)), iters, warmup)


def _fast_path(device: torch.device, dtype: torch.dtype) -> dict:
    """Whether torch._grouped_mm passed its self-check here (torch's backward / ours)."""
    return {
        "native_backward": experts_module._fast_path_ok(device, dtype, native=True),
        "explicit_backward": experts_module._fast_path_ok(device, dtype, False),
    }


# ------------------------------------------------------------------------------------ 0. tests
ROOT = Path(__file__).resolve().parents[1]


def gpu_tests(timeout_s: float, workers: int = 0, log_path: Path | None = None) -> dict:
    """``pytest tests/gpu -m gpu`` in a subprocess (the CPU twins there run in the normal
    suite); its outcome counts from a JUnit report, the failed tests, the output's tail."""
    path = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    with tempfile.TemporaryDirectory(prefix="gpu_check_tests_") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-rs"]
        cmd += ["-p", "no:cacheprovider", f"--junitxml={junit}"]
        if workers > 0:  # pytest-xdist: the spawned worlds start in parallel
            cmd += ["-n", str(workers)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd,
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
            rc, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, log = 124, f"timed out after {exc.timeout} s"
        out: dict = {
            "command": " ".join(c for c in cmd[1:] if "junitxml" not in c),
            "rc": rc,
            "wall_s": time.perf_counter() - t0,
        }
        out.update(_junit_counts(junit))
    if log_path is not None:
        log_path.write_text(log)
    # pytest's closing line ("3 failed, 57 passed, 1 warning in 68.63s"), not what plugins
    # print after it
    lines = [s for s in log.strip().splitlines() if _SUMMARY.search(s)]
    out["summary"] = lines[-1].strip(" =") if lines else ""
    out["log_tail"] = log[-4000:]
    return out


def _junit_counts(path: Path) -> dict:
    """Passed / failed / errors / skipped and the failed tests' ids of a JUnit report."""
    import xml.etree.ElementTree as ET

    if not path.is_file():
        return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failed_tests": []}
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed = []
    for case in ET.parse(path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        outcome = next((o for t, o in _OUTCOMES if t in tags), "passed")
        counts[outcome] += 1
        if outcome in ("failed", "errors"):
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    return {**counts, "failed_tests": failed}


_SUMMARY = re.compile(r"\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s")

# A JUnit test case's child element -> its outcome (a case without one passed).
_OUTCOMES = (("failure", "failed"), ("error", "errors"), ("skipped", "skipped"))


# ------------------------------------------------------------------------------ 1. correctness
def _layer_step(layer: MoELayer, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = layer(x)
    (y * g).sum().backward()
    layer.take_aux_terms()  # the aux loss is the router's own business, compared elsewhere
    out = {"y": y.detach(), "x.grad": x.grad}
    out.update({f"{n}.grad": p.grad for n, p in layer.named_parameters()})
    return out


def _ref_step(cfg, sd, x, g, dtype) -> dict[str, torch.Tensor]:
    ref = ReferenceMoE.from_full_state_dict(cfg, sd).to(x.device, dtype)
    xr = x.detach().to(dtype).requires_grad_()
    yr, _ = ref(xr)
    (yr * g.to(dtype)).sum().backward()
    out = {"y": yr.detach(), "x.grad": xr.grad}
    out.update({f"{n}.grad": p.grad for n, p in ref.named_parameters()})
    return out


def check_one(dispatcher: str, dtype_name: str, device: torch.device, quick: bool) -> dict:
    """One strategy and dtype: the layer's output and gradients vs the reference."""
    dtype = DTYPES[dtype_name]
    T = 64 if quick else 256
    extra = {"capacity_factor": 1.0} if dispatcher == "padded" else {}  # some tokens dropped
    cfg = MoEConfig(
        hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2, init_std=0.5,
        dispatcher=dispatcher, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    try:
        layer = MoELayer(cfg)
    except ValueError as exc:  # needs a plan or a cluster it was not given: not an EP = 1 layer
        return {"dispatcher": dispatcher, "dtype": dtype_name, "skipped": str(exc)}
    layer = layer.to(device, dtype)
    sd = {k: v.double() for k, v in layer.full_state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, 64, generator=gen).to(device, dtype)
    g = torch.randn(T, 64, generator=gen).to(device, dtype)
    # The self-check probes first, under the key grouped_mm uses (x.device: cuda:0, not cuda).
    fast_path = _fast_path(x.device, dtype)
    calls = []
    fast_op = experts_module._grouped_mm_op
    experts_module._grouped_mm_op = lambda *a: calls.append(1) or fast_op(*a)
    try:
        got = _layer_step(layer, x, g)
    finally:
        experts_module._grouped_mm_op = fast_op
    ref = _ref_step(cfg, sd, x, g, dtype)
    truth = _ref_step(cfg, sd, x, g, torch.float64)
    errors = {name: ref_errors(got[name], ref[name], truth[name], dtype) for name in truth}
    return {
        "dispatcher": dispatcher,
        "dtype": dtype_name,
        "tokens": T,
        "config": {"H": 64, "F": 128, "E": 8, "K": 2, **extra},
        "grouped_mm_fast_path": fast_path,
        "grouped_mm_fast_calls": len(calls),  # torch._grouped_mm forwards in the checked step
        "errors": errors,
        "ok": all(e["ok"] for e in errors.values()),
    }


# ------------------------------------------------------------------------------------ 2. speed
def _expert_flops(c: dict) -> float:
    """fwd+bwd FLOPs of the SwiGLU experts: 3 GEMMs of 2*H*F per routed row, x3 with backward."""
    return 9 * 2.0 * c["H"] * c["F"] * c["T"] * c["K"]


def _gemm_rate(c: dict, device, dtype, iters: int, rows: int) -> float:
    """FLOP/s of one dense ``rows x H @ H x F`` GEMM."""
    a = torch.randn(rows, c["H"], device=device, dtype=dtype)
    b = torch.randn(c["H"], c["F"], device=device, dtype=dtype)
    reps = 20  # several back-to-back GEMMs per timed call: a single small one is launch-bound
    times = _timed(lambda: [a @ b for _ in range(reps)], device, iters, 3)
    return reps * 2.0 * rows * c["H"] * c["F"] / statistics.median(times)


def _train_step(layer: MoELayer, x: torch.Tensor, g: torch.Tensor) -> None:
    x = x.detach().requires_grad_()
    y = layer(x)
    ((y * g).sum() + aux_loss(layer)).backward()
    layer.zero_grad(set_to_none=True)


def speed_one(c: dict, device: torch.device, iters: int, warmup: int) -> dict:
    """Step times of dropless and padded at one config, with the hot-GEMM bound beside them."""
    dtype = DTYPES[c["dtype"]]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(c["T"], c["H"], generator=gen).to(device, dtype)
    g = torch.randn(c["T"], c["H"], generator=gen).to(device, dtype)
    rows = max(c["T"] * c["K"] // c["E"], 1)
    rate = _gemm_rate(c, device, dtype, iters, rows)
    bound_ms = 1e3 * _expert_flops(c) / rate
    # All routed rows in one GEMM: the rate a perfect grouped GEMM approaches (no launch or
    # tail cost per expert); on a GPU the per-expert GEMM can be launch-bound and slower.
    dense_rate = _gemm_rate(c, device, dtype, iters, c["T"] * c["K"])
    row = {
        **c,
        "gemm_rows": rows,
        "expert_gflop_per_step": _expert_flops(c) / 1e9,
        "hot_gemm_tflops": rate / 1e12,
        "hot_gemm_bound_ms": bound_ms,
        "dense_gemm_rows": c["T"] * c["K"],
        "dense_gemm_tflops": dense_rate / 1e12,
        "dense_gemm_bound_ms": 1e3 * _expert_flops(c) / dense_rate,
        "grouped_mm_fast_path": _fast_path(device, dtype),
        "strategies": {},
    }
    for dispatcher in ("dropless", "padded"):
        torch.manual_seed(0)
        cfg = MoEConfig(
            hidden_size=c["H"], ffn_hidden_size=c["F"], num_experts=c["E"], top_k=c["K"],
            dispatcher=dispatcher,
        )  # fmt: skip
        layer = MoELayer(cfg).to(device, dtype)
        times = _timed(lambda layer=layer: _train_step(layer, x, g), device, iters, warmup)
        s = summarize(times)
        s["fraction_of_bound"] = bound_ms / s["median_ms"]
        s["fraction_of_dense_bound"] = row["dense_gemm_bound_ms"] / s["median_ms"]
        if device.type == "cuda":
            try:
                s["gpu_kernel_ms"] = _kernel_ms(lambda layer=layer: _train_step(layer, x, g))
            except (RuntimeError, AttributeError) as exc:  # a profiler without CUPTI
                s["gpu_kernel_error"] = repr(exc)
        s["expert_tflops_achieved"] = _expert_flops(c) / (s["median_ms"] * 1e-3) / 1e12
        if device.type == "cuda":
            s["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        row["strategies"][dispatcher] = s
        del layer
    return row


def _kernel_ms(step, steps: int = 3) -> float:
    """GPU kernel time of one step (torch.profiler, summed over kernels, mean of ``steps``):
    well under the step's wall time means the step waits on the host (launches, syncs)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / 1e3 / steps


# -------------------------------------------------------------------------------- 3. simulator
def simulated(c: dict, profile) -> dict:
    """The vanilla schedule of the layer alone on one rank under ``profile``."""
    from moesaic.cluster.spec import ClusterSpec, Level
    from moesaic.sim.model import ModelSpec
    from moesaic.sim.simulate import simulate

    width = 4 if c["dtype"] == "fp32" else 2
    model = ModelSpec(
        name=f"{c['name']}_{c['dtype']}", layers=1, batch=1, seq_len=c["T"], hidden=c["H"],
        ffn_hidden=c["F"], experts=c["E"], top_k=c["K"], act_bytes=width, param_bytes=width,
        layer_only=True,
    )  # fmt: skip
    spec = ClusterSpec(levels=(Level(name="gpu", size=1, bandwidth_gbps=100.0, latency_ms=0.0),))
    return simulate(spec, model, "dropless", profile, schedule="vanilla").summary()


def sim_rows(speed: list[dict], profile) -> list[dict]:
    """Predicted vs measured dropless step: under ``profile`` as given, and with its matmul
    rate replaced by the dense GEMM rate of the layer's own dtype and shape (measured in this
    run, apart from the layer) to separate the rate from the rest of the model."""
    from dataclasses import replace

    rows = []
    for c in speed:
        measured = c["strategies"]["dropless"]["median_ms"]
        pred = simulated(c, profile)
        rate = c["dense_gemm_tflops"] * 1e12
        gemm_profile = replace(profile, flops_per_s=rate, half_flops_per_s=rate)
        pred_gemm = simulated(c, gemm_profile)
        rows.append(
            {
                "name": c["name"],
                "dtype": c["dtype"],
                "measured_dropless_ms": measured,
                "predicted_ms": pred["iteration_ms"],
                "error": pred["iteration_ms"] / measured - 1.0,
                "predicted_ms_dense_gemm_rate": pred_gemm["iteration_ms"],
                "error_dense_gemm_rate": pred_gemm["iteration_ms"] / measured - 1.0,
            }
        )
    return rows


# ------------------------------------------------------------------------------------ 4. train
def train_run(steps: int, device: torch.device, log_path: Path | None, quick: bool) -> dict:
    """A short ``moesaic.train`` under torchrun on one process; its losses and step time."""
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_train_"))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        "-m", "moesaic.train", "--config", "examples/train_tiny.toml", "--ep", "1",
        "--steps", str(steps), "--warmup-steps", str(min(10, steps)), "--eval-every", "0",
        "--ckpt-every", "0", "--run-dir", str(run_dir), "--no-progress", "--backend", "auto",
    ]  # fmt: skip
    if quick:
        cmd += ["--data-max-bytes", "200000", "--eval-batches", "1", "--threads", "1"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, log = 124, f"timed out after {exc.timeout} s"
    wall = time.perf_counter() - t0
    if log_path is not None:
        log_path.write_text(log[-20000:])
    out: dict = {"command": " ".join(cmd[1:]), "rc": rc, "wall_s": wall, "log_tail": log[-1500:]}
    metrics = run_dir / "metrics.jsonl"
    if rc != 0 or not metrics.is_file():
        return out
    lines = [json.loads(s) for s in metrics.read_text().splitlines() if s.strip()]
    train = [r for r in lines if r.get("kind") == "train"]
    vals = [r for r in lines if r.get("kind") == "val"]
    cfg = {"batch_size": 8, "seq_len": 64}  # examples/train_tiny.toml
    tok_s = [r["tokens_per_s"] for r in train[len(train) // 2 :] if r.get("tokens_per_s")]
    step_ms = 1e3 * cfg["batch_size"] * cfg["seq_len"] / statistics.median(tok_s)
    out.update(
        {
            "steps": len(train),
            "loss_first": train[0]["loss"],
            "loss_last": train[-1]["loss"],
            "val_loss_last": vals[-1]["val_loss"] if vals else None,
            "median_step_ms_second_half": step_ms,
            "backend": "nccl" if device.type == "cuda" else "gloo",
            "model": "examples/train_tiny.toml (d_model 64, 2 layers, E 4, K 2, F 128)",
        }
    )
    return out


# ------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="toy sizes (CPU smoke test)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--profile", type=Path, help="moesaic calibrate's profile (else measured)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=0, help="0: no training run")
    p.add_argument("--train-log", type=Path)
    p.add_argument("--skip", default="", help="comma list of parts to skip: tests,speed,sim")
    p.add_argument("--tests-timeout-s", type=float, default=1800.0, help="bound on tests/gpu")
    p.add_argument("--tests-log", type=Path, help="write tests/gpu's whole output here")
    p.add_argument("--tests-workers", type=int, default=0, help="pytest-xdist workers (0: none)")
    p.add_argument("--commit", default="", help="commit of the copy (no .git on a device)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    skip = set(filter(None, args.skip.split(",")))
    meta = run_metadata()
    if args.commit:
        meta["commit"] = args.commit
    result: dict = {"meta": meta, "argv": sys.argv[1:]}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        result["meta"]["cuda"] = torch.version.cuda
        result["meta"]["gpu_memory_gib"] = props.total_memory / 2**30
        result["meta"]["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32

    if "tests" not in skip:
        result["tests"] = gpu_tests(args.tests_timeout_s, args.tests_workers, args.tests_log)
        t = result["tests"]
        print(f"tests/gpu rc {t['rc']}: {t['summary']}")
        write_json(result, args.out)

    checks = [
        check_one(d, dt, device, args.quick) for d in strategy_names() for dt in ("fp32", "bf16")
    ]
    result["correctness"] = checks
    for c in checks:
        state = "skipped" if "skipped" in c else ("ok" if c["ok"] else "FAIL")
        worst = max((e["max_rel_err"] for e in c.get("errors", {}).values()), default=0.0)
        print(f"correctness {c['dispatcher']:9s} {c['dtype']}: {state} (worst rel {worst:.2e})")
    write_json(result, args.out)

    if "speed" not in skip:
        configs = SPEED_QUICK if args.quick else SPEED_FULL
        iters, warmup = (3, 1) if args.quick else (args.iters, args.warmup)
        result["speed"] = []
        for c in configs:
            row = speed_one(c, device, iters, warmup)
            result["speed"].append(row)
            for name, s in row["strategies"].items():
                print(
                    f"speed {c['name']:13s} {c['dtype']} {name:8s}: {s['median_ms']:8.3f} ms, "
                    f"bound {row['hot_gemm_bound_ms']:.3f} ms ({s['fraction_of_bound']:.0%}), "
                    f"dense bound {row['dense_gemm_bound_ms']:.3f} ms "
                    f"({s['fraction_of_dense_bound']:.0%}), kernels {s.get('gpu_kernel_ms', -1):.3f} ms"
                )
            write_json(result, args.out)
        if "sim" not in skip:
            from moesaic.measure.machine import measure
            from moesaic.sim.profile import Profile

            if args.profile is not None:
                profile = Profile.load(args.profile)
                source = str(args.profile)
            else:
                profile = Profile(**measure(device=args.device), source="gpu_check measure")
                source = "moesaic.measure.machine.measure"
            result["simulator"] = {
                "profile": {
                    "source": source,
                    "flops_per_s": profile.flops_per_s,
                    "half_flops_per_s": profile.half_flops_per_s,
                    "task_overhead_s": profile.task_overhead_s,
                },
                "rows": sim_rows(result["speed"], profile),
            }
            for r in result["simulator"]["rows"]:
                print(
                    f"sim {r['name']:13s} {r['dtype']}: measured {r['measured_dropless_ms']:.3f} "
                    f"ms, predicted {r['predicted_ms']:.3f} ms ({r['error']:+.0%}), with the "
                    f"dense GEMM rate {r['predicted_ms_dense_gemm_rate']:.3f} ms "
                    f"({r['error_dense_gemm_rate']:+.0%})"
                )
            write_json(result, args.out)

    if args.train_steps > 0:
        result["train"] = train_run(args.train_steps, device, args.train_log, args.quick)
        t = result["train"]
        print(f"train rc {t['rc']}: loss {t.get('loss_first')} -> {t.get('loss_last')}")
        write_json(result, args.out)

    failed = [f"{c['dispatcher']}/{c['dtype']}" for c in checks if c.get("ok") is False]
    if failed:
        print(f"gpu_check: outside tolerance: {', '.join(failed)}", file=sys.stderr)
    tests = result.get("tests")
    if tests is not None and tests["rc"] != 0:
        # pytest's 1: tests failed; 5: none ran; anything else: the run itself broke
        what = ", ".join(tests["failed_tests"]) or tests["summary"]
        print(f"gpu_check: tests/gpu failed (rc {tests['rc']}): {what}", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
