"""The routing prior's measurements (issue 55 item 1): how unevenly a freshly initialised MoEGPT's
routers spread a step's tokens over the experts, before any data of the job is seen.

What is measured: for every cell of a grid over the routed experts E, the top-k K, the tokens of
one step T (the world's, summed over ranks: what the busiest expert receives in a step), the
residual width H and the router's init std, ``SEEDS`` models are built from fresh seeds (2 blocks,
both MoE, 4 heads, expert width H, the training defaults otherwise) and each runs one forward,
without gradients, on T tokens of the default training corpus (the standard library's source, in
windows of 128 bytes at seeded random offsets: what ``moesaic train`` trains on without
``--data``). Each MoE layer's expert loads (``take_stats().counts_E``) are one sample: its
imbalance (max / mean) and its sorted shares. A fresh router hardly moves in a job's first
steps (the learning rate warms up), so these are the loads the first steps of a job see; the
validation measures its steps 3-8.

Recorded per cell: the 10th, 50th and 90th percentiles over the samples of the imbalance, and of
each sorted share (the per-expert load distribution, busiest first). ``moesaic.sim.prior`` fits
its rule on this file (``benchmarks/results/sim_routing_prior.json``).

Usage::

    python benchmarks/sim_routing_prior.py [--out benchmarks/results/sim_routing_prior.json]
        [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from typing import Any

import torch

from moesaic.models.config import MoEGPTConfig
from moesaic.models.gpt import MoEGPT
from moesaic.train.data import load_corpus

EXPERTS = (4, 8, 16, 32, 64)
TOP_K = (1, 2, 4)
TOKENS = (512, 2048, 8192)
HIDDEN = (64, 128, 256)
INIT_STD = (0.02, 0.1)  # the default, and a wider router
SEEDS = 5
SEQ, BLOCKS, HEADS = 128, 2, 4
CORPUS_BYTES = 4 << 20


def quantiles(xs: list[float]) -> list[float]:
    """10th, 50th and 90th percentiles (inclusive method)."""
    qs = statistics.quantiles(xs, n=10, method="inclusive")
    return [qs[0], statistics.median(xs), qs[-1]]


def cell(corpus: torch.Tensor, E: int, K: int, T: int, H: int, std: float) -> dict[str, Any]:
    imbalance: list[float] = []
    sorted_shares: list[list[float]] = []
    for seed in range(SEEDS):
        torch.manual_seed(1000 * seed + 7)
        moe = {"num_experts": E, "top_k": K, "ffn_hidden_size": H, "init_std": std}
        cfg = MoEGPTConfig.from_dict(
            {"d_model": H, "n_layers": BLOCKS, "n_heads": HEADS, "seq_len": SEQ, "moe": moe}
        )
        model = MoEGPT(cfg).eval()
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, corpus.numel() - SEQ, (T // SEQ,), generator=g)
        idx = torch.stack([corpus[s : s + SEQ] for s in starts.tolist()]).long()
        with torch.no_grad():
            model(idx)
        for _, layer in model.moe_layers():
            counts = layer.take_stats().counts_E
            assert counts is not None
            loads = counts.double()
            total = float(loads.sum())
            imbalance.append(float(loads.max()) * E / total)
            sorted_shares.append(sorted((float(x) / total for x in loads), reverse=True))
    per_rank = [quantiles([s[i] for s in sorted_shares]) for i in range(E)]
    return {
        "experts": E,
        "top_k": K,
        "tokens": T,
        "hidden": H,
        "init_std": std,
        "samples": len(imbalance),
        "imbalance_q": quantiles(imbalance),
        "sorted_shares_q": per_rank,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/sim_routing_prior.json")
    parser.add_argument("--quick", action="store_true", help="a few cells only (a smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    corpus = torch.frombuffer(bytearray(load_corpus(None, CORPUS_BYTES)), dtype=torch.uint8)
    grid = [
        (E, K, T, H, s)
        for E, K, T, H, s in itertools.product(EXPERTS, TOP_K, TOKENS, HIDDEN, INIT_STD)
        if K < E
    ]
    if args.quick:
        grid = grid[:: max(1, len(grid) // 6)]
    t0 = time.perf_counter()
    cells = []
    for i, (E, K, T, H, s) in enumerate(grid):
        cells.append(cell(corpus, E, K, T, H, s))
        c = cells[-1]
        print(i, len(grid), E, K, T, H, s, [round(x, 2) for x in c["imbalance_q"]], flush=True)
    out = {
        "what": __doc__.split("\n\n")[1].replace("\n", " "),
        "grid": {
            "experts": EXPERTS,
            "top_k": TOP_K,
            "tokens": TOKENS,
            "hidden": HIDDEN,
            "init_std": INIT_STD,
            "seeds": SEEDS,
            "blocks": BLOCKS,
            "seq_len": SEQ,
        },
        "load_average": os.getloadavg(),
        "wall_s": time.perf_counter() - t0,
        "cells": cells,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
