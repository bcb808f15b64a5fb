"""SR encode and decode time per gather (issue 54 item 2, HybridEP Fig. 15), beside the gather's
communication time the compression saves.

**The rule that chooses the configurations** (fixed on 2026-12-04 at 04:15 UTC and committed
before anything was measured; nothing in it may change after the first measurement):

* Expert sizes (H x F, SwiGLU: w1, w3 H x F and w2 F x H, fp32): ``moesaic train``'s default
  expert (128 x 256: 98k parameters) and the two of the paper's Table II, P_E = 2.1M parameters
  (Llama-Tiny, H 512: F = 1368) and 4.7M (Mistral-Small, H 768: F = 2040).
* Compression ratios 1 (exact: the weights go as they are), 10 and 50.
* One gather of one layer as ``hybrid`` runs it at EP 4 with domains of 2 (the training runs of
  ``hybridep_training.py``): e = 2 local experts encoded (:func:`moesaic.strategies.migration.
  encode_experts`, the three matrices), the domain's S * e = 4 gathered rows decoded
  (``decode_experts``), and the shared expert's local part (the sum over the e local experts;
  its all-reduce is communication, priced below).
* One torch thread (a rank's share when two ranks run on this machine's two cores).
* Timing: the functions the gather calls, timed round-robin over all nine configurations,
  ``PASSES`` passes of ``REPS`` calls each; reported per configuration: the median over passes
  of each pass's median call.

**Before and after** the encoder's top-k change (``placement.compress.top_k_positions``: the
exact top-k of a sampled candidate set instead of ``torch.topk`` over every entry): with
``--before-src DIR`` (a checkout of the commit before it, ``be9400b``), the same script first
runs under ``PYTHONPATH=DIR/src`` in a subprocess, then here, in one ``quiet`` call; both rows
go in the result.

**Communication it saves**, priced (not measured) at two stated link speeds, 0.1 Gbit/s (the
inter-datacenter link of ``examples/clusters/hybridep_2dc.toml``, HybridEP's setting) and
10 Gbit/s: the domain all-gather of 2 ranks sends each rank's bundle once, so the gather takes
``bundle bytes / bandwidth``; the compression saves ``(dense - compressed bytes) / bandwidth``
and adds the shared expert's all-reduce (2 ranks: its message once each way, ``3 H F x 4 bytes
/ bandwidth``) every ``shared_expert_every`` gathers (1, the paper's rule, and 4, ours).
"Net" is saved minus the shared all-reduce minus encode minus decode (the critical-path view:
none of it hidden behind other work).

Usage::

    mkdir -p /tmp/t54b/before && git archive be9400b src | tar -x -C /tmp/t54b/before
    quiet python benchmarks/seeds/hybridep_codec_time.py --before-src /tmp/t54b/before
                                                                  # -> seeds_hybridep_codec.json
    python benchmarks/seeds/hybridep_codec_time.py --quick        # smoke: 1 pass, 2 reps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from moesaic.placement.compress import compressed_nbytes
from moesaic.strategies.migration import decode_experts, encode_experts

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "benchmarks" / "results" / "seeds_hybridep_codec.json"

SIZES = [("default", 128, 256), ("llama-tiny", 512, 1368), ("mistral-small", 768, 2040)]
RATIOS = [1.0, 10.0, 50.0]
E_LOCAL, DOMAIN = 2, 2
PASSES, REPS = 5, 5
LINKS_GBPS = [0.1, 10.0]
SHARED_EVERY = [1, 4]


def _weights(H: int, F: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(E_LOCAL, H, F, generator=g) / H**0.5,
        torch.randn(E_LOCAL, H, F, generator=g) / H**0.5,
        torch.randn(E_LOCAL, F, H, generator=g) / F**0.5,
    ]


def _case(H: int, F: int, cr: float):
    """The three timed calls of one configuration (encode, decode, shared sum)."""
    ws = _weights(H, F)
    shared = [w.mean(dim=0) for w in ws]
    payloads = [encode_experts(w, sh, cr) for w, sh in zip(ws, shared)]
    gathered = [torch.cat([p] * DOMAIN) for p in payloads]  # S * e rows, as the gather gives

    def encode() -> None:
        for w, sh in zip(ws, shared):
            encode_experts(w, sh, cr)

    def decode() -> None:
        for rows, sh, w in zip(gathered, shared, ws):
            decode_experts(rows, sh, tuple(w.shape[1:]), w.dtype, cr)

    def shared_sum() -> None:
        torch.cat([w.sum(dim=0).reshape(-1) for w in ws])

    nbytes = sum(p.numel() * p.element_size() for p in payloads)
    dense = sum(w.numel() * w.element_size() for w in ws)
    assert nbytes == E_LOCAL * sum(compressed_nbytes(w[0].numel(), cr, 4) for w in ws)
    return {"encode": encode, "decode": decode, "shared_sum": shared_sum}, nbytes, dense


def _time(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke: 1 pass of 2 calls, no file")
    ap.add_argument("--before-src", default=None, help="a checkout to time first (its src/)")
    ap.add_argument("--rows-to", default=None, help=argparse.SUPPRESS)  # the subprocess's rows
    args = ap.parse_args()
    before = None
    if args.before_src:
        tmp = RESULT.with_suffix(".before.tmp")
        env = {**os.environ, "PYTHONPATH": str(Path(args.before_src) / "src")}
        cmd = [sys.executable, __file__, "--rows-to", str(tmp)] + (["--quick"] * args.quick)
        print(f"before: {args.before_src}", flush=True)
        subprocess.run(cmd, check=True, env=env)
        before = json.loads(tmp.read_text())
        tmp.unlink()
        print("after: this tree", flush=True)
    passes, reps = (1, 2) if args.quick else (PASSES, REPS)
    torch.set_num_threads(1)
    cases = {}
    for name, H, F in SIZES:
        for cr in RATIOS:
            cases[(name, H, F, cr)] = _case(H, F, cr)
    samples: dict = {key: {k: [] for k in ("encode", "decode", "shared_sum")} for key in cases}
    for _ in range(passes):
        for key, (fns, _, _) in cases.items():
            for what, fn in fns.items():
                samples[key][what].append(_time(fn, reps))
    rows = []
    for (name, H, F, cr), (_, nbytes, dense) in cases.items():
        t = {k: statistics.median(v) for k, v in samples[(name, H, F, cr)].items()}
        shared_bytes = 3 * H * F * 4
        row = {
            "expert": name,
            "H": H,
            "F": F,
            "params_per_expert": 3 * H * F,
            "compression_ratio": cr,
            "encode_s": t["encode"] if cr > 1 else 0.0,
            "decode_s": t["decode"] if cr > 1 else 0.0,
            "shared_sum_s": t["shared_sum"] if cr > 1 else 0.0,
            "bundle_bytes": nbytes,
            "dense_bundle_bytes": dense,
            "links": {},
        }
        for gbps in LINKS_GBPS:
            bw = gbps * 1e9 / 8
            link = {"gather_s": nbytes / bw, "saved_s": (dense - nbytes) / bw}
            for every in SHARED_EVERY:
                ar = shared_bytes / bw / every if cr > 1 else 0.0
                link[f"net_s_every{every}"] = (
                    link["saved_s"] - ar - row["encode_s"] - row["decode_s"] - row["shared_sum_s"]
                )
            row["links"][f"{gbps:g}"] = link
        rows.append(row)
        print(
            f"{name:13s} CR {cr:4g}: encode {row['encode_s'] * 1e3:8.3f} ms  decode "
            f"{row['decode_s'] * 1e3:8.3f} ms  shared sum {row['shared_sum_s'] * 1e3:7.3f} ms  "
            f"bundle {nbytes / 2**20:7.3f} MiB (dense {dense / 2**20:.3f}); at 0.1 Gbit/s "
            f"gather {row['links']['0.1']['gather_s']:.3f} s saves "
            f"{row['links']['0.1']['saved_s']:.3f} s",
            flush=True,
        )
    if args.rows_to:
        import moesaic

        Path(args.rows_to).write_text(json.dumps({"src": moesaic.__file__, "rows": rows}))
        return
    if args.quick:
        return
    out = {
        "rule": "benchmarks/seeds/hybridep_codec_time.py docstring",
        "command": "quiet python benchmarks/seeds/hybridep_codec_time.py",
        "threads": 1,
        "passes": passes,
        "reps": reps,
        "e_local": E_LOCAL,
        "domain": DOMAIN,
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "cpu": os.cpu_count(),
        "rows": rows,
        "before": before,
    }
    RESULT.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
