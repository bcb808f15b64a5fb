"""The taskflow handlers' CPU, measured on one rank with no network: ``tile_elem_cpu_s``.

The simulator priced a taskflow elementwise, reduction or put tile at 10 FLOPs per element at
the profile's matmul rate (``flops_per_s``, ~90 GFLOP/s here): 0.1 ms for the 16 SwiGLU tiles
of a step. Their handlers (``taskflow.runtime.handlers``) are memory-bound torch calls on a
tile (SwiGLU: split, silu, multiply, write; its gradient: five passes; puts: a row gather or
copy), measured at ~14 ms of thread CPU per step on one rank.

:func:`measure` runs, in a world of one process (every put is a copy: no gloo, no subscriber),
the ``taskflow_cluster.py`` layer as ``compute only`` (dropless) and as the static taskflow
executor (pipelined order), with every handler call timed by its thread's CPU clock
(``time.thread_time``, so the other queue's thread and the GIL hand-offs are not counted), and
returns per step the medians of the wall and process CPU seconds and the handlers' thread CPU
seconds per task type. :func:`elem_cpu_s` divides the non-GMM handlers' CPU by the elements the
simulator counts for them (:func:`moesaic.sim.taskflow.tile_elements`): the profile's
``tile_elem_cpu_s``. The same worker times a 64 MiB copy into fresh memory
(``copy_elem_cpu_s``, 1.3-1.4 ns per element here), which prices the forward's copies of its
receive window, whole buckets (:func:`moesaic.sim.taskflow.saved_window_elements`), and which
:func:`tile_cpu_figures` takes out of the per-task residual. Nothing here reads an
emulated-cluster iteration time.

Usage: ``python -m moesaic.measure.cpucal [--tile 512 128] [--steps 9] [--out F.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from moesaic.checks import check_positive_int

__all__ = ["VARIANTS", "elem_cpu_s", "measure", "non_gmm_elements", "tile_cpu_figures"]

VARIANTS = ("compute only", "taskflow static")
WARMUP = 3


def _layer(dispatcher: str, tile: int, model: Any) -> Any:
    import torch

    from moesaic import MoEConfig, MoELayer

    cfg = MoEConfig(
        hidden_size=model.hidden,
        ffn_hidden_size=model.ffn_hidden,
        num_experts=model.experts,
        top_k=model.top_k,
        dispatcher=dispatcher,
        options={"executor": "static", "tile_m": tile} if dispatcher == "taskflow" else None,
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
    )
    torch.manual_seed(0)
    return MoELayer(cfg)


def _worker(rank: int, world: int, model: Any, tile: int, steps: int) -> dict[str, Any]:
    import torch

    from moesaic.taskflow.runtime import concurrent

    torch.set_num_threads(1)
    handler_s: dict[str, float] = defaultdict(float)
    lock = threading.Lock()
    launch = concurrent._Step.launch

    def timed(self: Any, t: Any) -> None:  # this spawned process only
        c0 = time.thread_time()
        launch(self, t)
        c = time.thread_time() - c0
        with lock:
            handler_s[t.task_type] += c

    concurrent._Step.launch = timed  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(model.tokens, model.hidden, generator=gen)
    g = torch.randn(model.tokens, model.hidden, generator=gen)
    layers = {
        "compute only": _layer("dropless", tile, model),
        "taskflow static": _layer("taskflow", tile, model),
    }
    wall: dict[str, list[float]] = {n: [] for n in VARIANTS}
    cpu: dict[str, list[float]] = {n: [] for n in VARIANTS}
    per_type: dict[str, list[float]] = defaultdict(list)
    for i in range(WARMUP + steps):
        for name in VARIANTS:  # round-robin: drift on the shared machine hits both alike
            handler_s.clear()
            c0, t0 = time.process_time(), time.perf_counter()
            xi = x.clone().requires_grad_()
            layers[name](xi).backward(g)
            if i >= WARMUP:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                for k, v in handler_s.items():
                    per_type[k].append(v)
    bucket = next(iter(layers["taskflow static"].strategy.runtime._plans))
    return {
        "copy_elem_cpu_s": _copy_elem_cpu_s(),
        "wall_s": {n: statistics.median(v) for n, v in wall.items()},
        "cpu_s": {n: statistics.median(v) for n, v in cpu.items()},
        "handler_cpu_s": {k: statistics.median(v) for k, v in sorted(per_type.items())},
        "slot_rows": bucket.slot_rows,
        "tile_m": bucket.tile_m,
    }


# Elements of the fresh copy :func:`_copy_elem_cpu_s` times: 64 MiB of fp32, above glibc's
# largest mmap threshold (32 MiB), so every copy gets fresh pages whatever was freed before, as
# the forward's copies of a skewed bucket's receive buffers (33.5 MB each measured at 1.3-1.7 ns
# per element in training). Below the threshold a copy may reuse freed memory and measure ~10x
# less (0.19 ns once at 32 MiB); small copies stay in cache, but then they cost little.
COPY_ELEMENTS = 1 << 24


def _copy_elem_cpu_s(reps: int = 5) -> float:
    """Thread CPU seconds per element of ``clone()`` of a ``COPY_ELEMENTS`` fp32 tensor into
    fresh memory (page faults included: what the taskflow forward's copies of its receive
    window cost), the median of ``reps``."""
    import torch

    x = torch.ones(COPY_ELEMENTS)
    times = []
    for _ in range(reps):
        c0 = time.thread_time()
        y = x.clone()
        times.append(time.thread_time() - c0)
        del y
    return statistics.median(times) / COPY_ELEMENTS


def measure(model: Any, tile: int, steps: int = 9) -> dict[str, Any]:
    """One rank (a world of one, one torch thread) running ``model``'s layer (a layer-only
    ``ModelSpec``) at ``taskflow``'s ``tile_m`` = ``tile``, forward and backward, ``steps`` times
    after a warm-up: per-step medians of the wall and process CPU seconds of
    :data:`VARIANTS`, of the static executor's handlers' thread CPU seconds per task type
    (``handler_cpu_s``), the bucket's ``slot_rows`` and ``tile_m``, and the CPU per element of
    a large fresh tensor copy (``copy_elem_cpu_s``)."""
    from moesaic.comm.world import run_world

    check_positive_int("tile", tile)
    check_positive_int("steps", steps)
    return run_world(_worker, 1, model, tile, steps, timeout_s=600.0)[0]


def non_gmm_elements(model: Any, tile_m: int, slot_rows: int) -> dict[str, float]:
    """Per task type, the elements the simulator counts for one rank's non-GMM tasks of one
    forward and one backward in a world of one (``tile_elements``, uniform routing)."""
    from moesaic.sim.taskflow import model_bucket, tile_elements
    from moesaic.taskflow.bucket import CompileOptions
    from moesaic.taskflow.compile import compile_world
    from moesaic.taskflow.moe_graphs import TASK_TYPES

    bucket = model_bucket(model, ep_size=1, slot_rows=slot_rows, tile_m=tile_m)
    load = model.tokens * model.top_k / model.experts
    out: dict[str, float] = defaultdict(float)
    for d in ("forward", "backward"):
        for t in compile_world(bucket, d, CompileOptions(pipeline=True))[0].tasks:
            kind = TASK_TYPES[t.task_type]
            if kind.put or kind.cost_class != "gmm":
                out[t.task_type] += tile_elements(t, model, slot_rows, load)
    return dict(out)


def elem_cpu_s(model: Any, measured: dict[str, Any]) -> float:
    """CPU seconds per element of the non-GMM handlers of ``measured`` (:func:`measure`):
    their thread CPU over the elements the simulator counts for them."""
    elems = non_gmm_elements(model, measured["tile_m"], measured["slot_rows"])
    cpu = sum(measured["handler_cpu_s"].get(k, 0.0) for k in elems)
    return cpu / sum(elems.values())


def tile_cpu_figures(model: Any, steps: int = 5) -> dict[str, float]:
    """The profile's taskflow CPU figures for ``model`` (a ``ModelSpec``; its MoE layer alone,
    at the simulator's default tiles, ``moesaic calibrate --model``):

    * ``tile_elem_cpu_s``: :func:`elem_cpu_s`;
    * ``copy_elem_cpu_s``: CPU seconds per element of a large copy into fresh memory
      (:func:`_copy_elem_cpu_s`), which the simulator charges the forward's copies of its
      receive window (``sim.taskflow.saved_window_elements``: whole buckets, so they grow
      with the busiest slot under skewed routing, 22-28 ms a forward at 67 MB measured);
    * ``tile_cpu_s``: the runtime's own CPU per task: the step's process CPU less every
      handler's thread CPU and those copies, over the tasks of its forward and backward plans
      (it also holds the layer's router and routing plan, which the simulator prices in the
      attention stage too: a few percent of a step here)."""
    import dataclasses

    from moesaic.sim.taskflow import default_tiles, model_bucket, saved_window_elements
    from moesaic.taskflow.bucket import CompileOptions
    from moesaic.taskflow.compile import compile_world

    layer = dataclasses.replace(model, layer_only=True)
    measured = measure(layer, default_tiles(layer)[0], steps)
    bucket = model_bucket(
        layer, ep_size=1, slot_rows=measured["slot_rows"], tile_m=measured["tile_m"]
    )
    plans = [
        compile_world(bucket, d, CompileOptions(pipeline=True))[0] for d in ("forward", "backward")
    ]
    tasks = sum(len(p.tasks) for p in plans)
    copy_s = sum(saved_window_elements(p) for p in plans) * measured["copy_elem_cpu_s"]
    runtime_s = (
        measured["cpu_s"]["taskflow static"] - sum(measured["handler_cpu_s"].values()) - copy_s
    )
    return {
        "tile_cpu_s": max(0.0, runtime_s) / tasks,
        "tile_elem_cpu_s": elem_cpu_s(layer, measured),
        "copy_elem_cpu_s": measured["copy_elem_cpu_s"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tile", type=int, nargs="+", default=[512, 128])
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--model", default="examples/models/taskflow_layer.toml")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from moesaic.bench.meta import run_metadata
    from moesaic.sim.model import ModelSpec

    model = ModelSpec.from_toml(args.model)
    rows = []
    for tile in args.tile:
        m = measure(model, tile, args.steps)
        m["non_gmm_elements"] = non_gmm_elements(model, m["tile_m"], m["slot_rows"])
        m["tile_elem_cpu_s"] = elem_cpu_s(model, m)
        rows.append(m)
        print(json.dumps(m, indent=1), flush=True)
    if args.out:
        out = {
            "meta": run_metadata(),
            "config": {
                "model": args.model,
                "steps": args.steps,
                "warmup": WARMUP,
                "world": 1,
                "torch_threads": 1,
            },
            "points": rows,
        }
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
