"""A whole training step on one GPU: ``moesaic train`` of a transformers Qwen3-MoE in bf16 against
torchtitan's trainer step on the same model configuration and batch (issue 56 item 2).

``PYTHONPATH=src python3 benchmarks/gpu_train_step.py --out OUT.json [--layers 4]``
(``--device cpu --quick``: a tiny config, a few steps, the CPU smoke test; no figures.)

The model: Qwen3-30B-A3B's decoder layer (``QWEN3_30B_A3B``: width 2048, 32 query and 4 KV
heads of 128, 128 experts of width 768, top-8, vocabulary 151936) with ``--layers`` of them
(48 in the real model; 4 by default: about 3.1 billion parameters, 50 GB of fp32 weights,
gradients and AdamW state, the rest of an H200's memory left to the batch's activations).

* ``moesaic``: the training job itself (``python -m moesaic.train``'s worker, in this process as
  rank 0 of a world of one on NCCL, EP 1): ``--hf-config`` of that file, ``--dtype bf16``
  (autocast, fp32 master weights), the default strategy (``dropless``, fused kernels), AdamW,
  gradient clipping at 1.0, byte data (tokens 0-255 of the 151936-row vocabulary: the head is
  the full size). Its ``tokens_per_s`` per step (the loop's clock around the step, its host
  statistics included) after ``--warmup`` steps; the host syncs per step from the end of the
  warm-up's last optimizer step to the run's end (``torch.cuda.set_sync_debug_mode("warn")``,
  armed by an optimizer step hook), their sites; the device's peak memory beside the
  simulator's (``moesaic.sim.memory.predict_memory`` of the run's model record: ``MoEGPT``'s
  activation model, the transformers blocks' differ).
* ``torchtitan``: torchtitan's own Qwen3 model, init and per-block ``torch.compile`` on the same
  configuration, its trainer's one-GPU step (``_titan_step``: autocast bf16, its loss, clipping,
  AdamW) on random token ids of the same batch shape.

Model FLOPs utilisation: ``flops_per_token`` (6 x the active non-embedding parameters, the head
included, + 12 x layers x heads x head dim x sequence: torchtitan's formula) x tokens per second
over the device's bf16 dense peak (``--peak-tflops``, 989 for an H100/H200 SXM), one formula
for both.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moesaic.bench.meta import run_metadata
from moesaic.bench.options import write_json
from moesaic.testing import SYNC_WARNING

# Qwen/Qwen3-30B-A3B's config.json (layers cut to --layers).
QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "use_cache": False,
}
QUICK = {"layers": 2, "batch": 2, "seq": 32, "steps": 3, "warmup": 1}


def model_config(layers: int, quick: bool) -> dict[str, Any]:
    c = {**QWEN3_30B_A3B, "num_hidden_layers": layers}
    if quick:  # a tiny one with the same structure
        c.update(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            vocab_size=512,
            max_position_embeddings=256,
        )
    return c


def flops_per_token(c: dict[str, Any], seq_len: int) -> tuple[float, float]:
    """(active parameters per token without the embedding, training FLOPs per token)."""
    h, layers, hd = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    q, kv = c["num_attention_heads"], c["num_key_value_heads"]
    attn = h * hd * (2 * q + 2 * kv) + 2 * hd  # q, k, v, o projections, q/k norms
    experts = c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]
    per_layer = attn + experts + h * c["num_experts"] + 2 * h  # router, two norms
    active = layers * per_layer + h + h * c["vocab_size"]  # final norm, head
    return active, 6.0 * active + 12.0 * layers * q * hd * seq_len


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _StepWatch:
    """Watches the optimizer steps of whatever trains in this process (``torch.optim``'s global
    step hook: the training job's own optimizer, torchtitan's; no change to either loop):
    steps ``syncs[0]`` + 1 to ``syncs[1]`` for host syncs (``set_sync_debug_mode("warn")``, the
    warnings' sites), and with ``profile`` steps ``profile[0]`` + 1 to ``profile[1]`` for the
    device's kernels (``torch.profiler``, CUDA activity only; ``gpu_timing.device_summary``).
    The profiler syncs the device when it stops, so the profiled steps come after the timed
    ones."""

    def __init__(self, syncs: tuple[int, int], profile: tuple[int, int] | None = None) -> None:
        self.syncs, self.profile = syncs, profile
        self.steps, self.caught, self.summary = 0, [], None
        self._handle = self._prof = self._opt = None
        self.armed_at = self.disarmed_at = None

    def __enter__(self) -> _StepWatch:
        self._warnings = warnings.catch_warnings(record=True)
        self.caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        cuda = torch.cuda.is_available()

        def hook(opt: Any, _args: Any, _kwargs: Any) -> None:
            # One optimizer's steps: torchtitan's container steps its inner AdamW, and both
            # fire the global hook (at 95d5b35 its watched window was one step, not two).
            if self._opt is None:
                self._opt = opt
            if opt is not self._opt:
                return
            self.steps += 1
            if not cuda:
                return
            if self.steps == self.syncs[0]:
                self.armed_at = len(self.caught)
                torch.cuda.set_sync_debug_mode("warn")
            if self.steps == self.syncs[1] and self.armed_at is not None:
                self.disarmed_at = len(self.caught)
                torch.cuda.set_sync_debug_mode("default")
            if self.profile is not None and self.steps == self.profile[0]:
                from torch.profiler import ProfilerActivity, profile

                self._prof = profile(activities=[ProfilerActivity.CUDA])
                self._prof.__enter__()
            if self.profile is not None and self.steps == self.profile[1]:
                self._stop_profile()

        self._handle = register_optimizer_step_post_hook(hook)
        return self

    def _stop_profile(self) -> None:
        if self._prof is None or self.profile is None:
            return
        from gpu_timing import device_summary

        torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        self.summary = device_summary(self._prof, self.profile[1] - self.profile[0], top=40)
        self._prof = None

    def __exit__(self, *exc: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
            self._stop_profile()
        assert self._handle is not None
        self._handle.remove()
        self._warnings.__exit__(*exc)

    def sites(self) -> list[str] | None:
        if self.armed_at is None:
            return None
        return [
            f"{w.filename}:{w.lineno}"
            for w in self.caught[self.armed_at : self.disarmed_at]
            if SYNC_WARNING in str(w.message)
        ]

    def site_counts(self) -> list[tuple[str, int]]:
        counts: dict[str, int] = {}
        for s in self.sites() or []:
            counts[s] = counts.get(s, 0) + 1
        return sorted(counts.items(), key=lambda kv: -kv[1])[:12]


def moesaic_run(
    c: dict[str, Any], args: argparse.Namespace, device: torch.device, compile: bool = False
) -> dict:
    """The training job on this process (rank 0 of one), its figures; ``compile``: with
    ``--compile`` (the blocks' dense parts compiled, as torchtitan's trainer compiles its
    blocks)."""
    from moesaic.sim.memory import predict_memory
    from moesaic.train.__main__ import main as worker
    from moesaic.train.flags import add_train_arguments, config_from_args

    work = Path(tempfile.mkdtemp(prefix="gpu_train_step_"))
    hf_path = work / "qwen3_moe.json"
    hf_path.write_text(json.dumps(c))
    run_dir = work / "run"
    steps = args.warmup + args.steps + args.profile_steps
    argv = ["--hf-config", str(hf_path), "--dtype", "bf16", "--ep", "1", "--steps", str(steps)]
    argv += ["--batch-size", str(args.batch), "--seq-len", str(args.seq), "--run-dir", str(run_dir)]
    argv += ["--eval-every", "0", "--ckpt-every", "0", "--no-save-final", "--no-progress"]
    argv += ["--warmup-steps", "1", "--timeout-s", "600"]
    argv += ["--backend", "nccl" if device.type == "cuda" else "gloo"]
    if args.data:
        argv += ["--data", args.data]
    if compile:
        argv += ["--compile"]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        # Syncs over the timed steps; the profile (the run's last steps) after them.
        timed = (args.warmup, args.warmup + args.steps)
        profiled = (timed[1], steps) if args.profile_steps > 0 else None
        with _StepWatch(timed, profiled) as watch:
            rc = worker(argv)
    finally:  # this process is rank 0 of a world of one for the run only
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out: dict[str, Any] = {"rc": rc, "argv": argv}
    if rc != 0:
        logs = sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []
        out["log_tail"] = logs[0].read_text()[-3000:] if logs else None
        return out
    rows = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    timed = [r["tokens_per_s"] for r in train[args.warmup : args.warmup + args.steps]]
    out |= {
        "steps": len(train),
        "loss_first": train[0]["loss"],
        "loss_last": train[-1]["loss"],
        "tokens_per_s": statistics.median(timed),
        "tokens_per_s_spread": [min(timed), max(timed)],
    }
    sites = watch.sites()
    if sites is not None:
        out["host_syncs_per_step"] = len(sites) / args.steps
        out["host_sync_sites"] = watch.site_counts()
    if watch.summary is not None:
        out["device_profile"] = watch.summary
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    cfg = config_from_args(parser.parse_args(argv))  # the run's record, as the worker made it
    pred = predict_memory(cfg.model, batch_size=args.batch, ep=1, compute_bytes=2)
    out["predicted_peak_gib"] = pred.peak / 2**30
    out["predicted"] = pred.to_dict()
    return out


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    """A side's figures for the log: the memory prediction's detail left out, the profile cut
    to its totals and ten kernels."""
    out = {k: v for k, v in r.items() if k != "predicted"}
    if "device_profile" in out:
        prof = dict(out["device_profile"])
        prof["top_kernels"] = prof["top_kernels"][:10]
        out["device_profile"] = prof
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="tiny config (CPU smoke test)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="steps after the timed ones with their kernels profiled (CUDA), each side",
    )
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--data", default="", help="moesaic's --data (default: its own)")
    p.add_argument("--only", default="", help="moesaic or torchtitan (default both)")
    p.add_argument(
        "--moesaic",
        default="eager",
        help="moesaic's runs, comma-separated: eager (the default job), compile (--compile)",
    )
    p.add_argument("--commit", default="")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_train_step: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    c = model_config(args.layers, args.quick)
    active, fpt = flops_per_token(c, args.seq)
    meta = run_metadata()
    if args.commit:
        meta["commit"] = args.commit
    if device.type == "cuda":
        meta["device"] = torch.cuda.get_device_name(device)
    result: dict[str, Any] = {"meta": meta, "argv": sys.argv[1:], "model": c}
    result |= {"batch": args.batch, "seq_len": args.seq, "steps": args.steps}
    result |= {"active_params": active, "flops_per_token": fpt, "peak_tflops": args.peak_tflops}

    def mfu(tokens_per_s: float | None) -> float | None:
        return None if tokens_per_s is None else fpt * tokens_per_s / (args.peak_tflops * 1e12)

    ours_keys = []
    for variant in args.moesaic.split(","):
        if args.only not in ("", "moesaic") or not variant:
            continue
        if variant not in ("eager", "compile"):
            p.error(f"--moesaic takes eager and compile, got {variant!r}")
        key = "moesaic" if variant == "eager" else "moesaic_compile"
        try:
            r = moesaic_run(c, args, device, compile=variant == "compile")
        except Exception as exc:  # recorded: the other side still runs
            r = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        r["mfu"] = mfu(r.get("tokens_per_s"))
        result[key] = r
        ours_keys.append(key)
        print(key, json.dumps(_brief(r)), flush=True)
        write_json(result, args.out)
    if args.only in ("", "torchtitan"):
        from _titan_step import titan_available, titan_train_step_bench

        why = titan_available()
        if why is not None:
            r = {"error": why}
        else:
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                # Its optimizer steps: warm-up, the synced steps, the streamed ones, then
                # the profiled ones (extra_steps).
                end = args.warmup + 2 * args.steps
                profiled = (end, end + args.profile_steps) if args.profile_steps > 0 else None
                with _StepWatch((end, end + args.profile_steps), profiled) as watch:
                    r = titan_train_step_bench(
                        c,
                        batch_size=args.batch,
                        seq_len=args.seq,
                        steps=args.steps,
                        warmup=args.warmup,
                        device=device,
                        compile=device.type == "cuda",
                        extra_steps=args.profile_steps,
                    )
                if watch.summary is not None:
                    r["device_profile"] = watch.summary
                    r["host_syncs_profiled_steps"] = watch.site_counts()
            except Exception as exc:
                r = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        r["mfu_same_formula"] = mfu(r.get("tokens_per_s"))
        result["torchtitan"] = r
        print("torchtitan", json.dumps(_brief(r)), flush=True)
    theirs = result.get("torchtitan", {}).get("tokens_per_s")
    for key in ours_keys:
        ours = result[key].get("tokens_per_s")
        if ours and theirs:
            name = "speedup" if key == "moesaic" else f"speedup_{key.split('_', 1)[1]}"
            result[name] = ours / theirs
            print(f"{key} / torchtitan tokens per second: {result[name]:.3f}", flush=True)
    write_json(result, args.out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
