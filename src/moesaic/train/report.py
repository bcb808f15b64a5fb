"""What a user sees of a run: the rank-0 progress bar, metrics.jsonl and the final summary.

``metrics.jsonl`` (in the run directory, appended across resumes) holds one JSON object a line:
``{"kind": "train", "step", "loss", "aux_loss", "lr", "grad_norm", "tokens_per_s",
"expert_load": [[per-expert assignments] per MoE layer], "imbalance": [max/mean per layer],
"attempt"}``, ``{"kind": "val", "step", "val_loss"}``, ``{"kind": "checkpoint", "step",
"path"}``, once per attempt after its second step (its first in a run of one) ``{"kind":
"memory", "step", "per_rank": [{"params", "grads", "optimizer", "dense_params",
"expert_params", "step_peak", "step_start"} bytes per rank]}`` (``moesaic.train.memory``: local
shards with ``--dp-shard``, taken after the first optimizer step; the second step's peak and the
bytes alive at its start, 0 where not measured) and a final ``{"kind": "summary", ...,
"combination"}`` (what the run trained: ``moesaic.train.plan.combination_record``; with
``--plan`` also ``"plan"``, its source beside it), after which a run on an emulated cluster's
launcher appends ``{"kind": "network", "cluster", "tx_bytes", "rx_bytes"}`` (per rank:
``moesaic.train.emulate``). Every line is strict JSON: a NaN or infinite number (a diverged
loss) is written as ``null``.

A metrics file that cannot be written (a full disk) raises ``OSError`` naming the file.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from moesaic.train.config import TrainConfig
from moesaic.train.plan import combination_record, plan_record


def strict_json(value):
    """``value`` with every NaN or infinite float replaced by None (strict JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def imbalance(load: list[int]) -> float:
    """max / mean of an expert load (1.0 = perfectly balanced)."""
    mean = sum(load) / max(1, len(load))
    return max(load) / mean if mean else 0.0


class Reporter:
    """Rank 0 prints and writes; every other rank's calls do nothing."""

    def __init__(self, cfg: TrainConfig, layout, start_step: int, resumed_from: str | None) -> None:
        self.active = layout.rank == 0
        self.cfg = cfg
        self.start_step = start_step
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.t_start = time.perf_counter()
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.val_losses: list[tuple[int, float]] = []
        self.tok_s: list[float] = []
        self.last_imbalance: list[float] = []
        self.bar = None
        if not self.active:
            return
        self.metrics_path = Path(cfg.run_dir) / "metrics.jsonl"
        try:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self.metrics = self.metrics_path.open("a")
        except OSError as exc:
            raise self._io_error(exc) from None
        E, ep = cfg.model.moe.num_experts, cfg.check_world(layout.world_size)
        grid = f"DP {layout.dp_size} x EP {ep}"
        if cfg.sharded:  # FSDP2 (train/fsdp.py)
            m = cfg.mesh_shape(layout.world_size)
            grid = (
                f"dp_replicate {m.dp_replicate} x dp_shard {m.dp_shard} x EP {ep} (FSDP2: dense "
                f"parameters sharded over {m.dense_shards} ranks, each expert over {m.dp_shard})"
            )
        self._log(
            f"moesaic train: {layout.world_size} ranks = {grid} "
            f"({E // ep} experts per rank), {cfg.steps} steps of "
            f"{layout.world_size * cfg.batch_size * cfg.model.seq_len} tokens"
            + (f"; resumed from {resumed_from} at step {start_step}" if resumed_from else "")
            + (f" (restart {self.attempt} of {cfg.max_restarts})" if self.attempt else "")
        )
        if cfg.progress:
            try:
                from tqdm import tqdm
            except ImportError:  # the `progress` extra is not installed: log lines instead
                return
            self.bar = tqdm(
                total=cfg.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True
            )

    def _log(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def _io_error(self, exc: OSError) -> OSError:
        # write() and flush() errors carry no file name: add it.
        return OSError(exc.errno, exc.strerror, str(self.metrics_path))

    def _write(self, record: dict) -> None:
        try:
            self.metrics.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
            self.metrics.flush()
        except OSError as exc:
            raise self._io_error(exc) from None

    def train_step(
        self, step, loss, aux_loss, lr, grad_norm, tokens_per_s, loads, *, nonfinite=()
    ) -> None:
        """One step's line; ``nonfinite`` says what was not finite where (the step was not
        applied), recorded as a ``nonfinite`` list next to ``null`` numbers."""
        if not self.active:
            return
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss
        self.tok_s.append(tokens_per_s)
        self.last_imbalance = [round(imbalance(load), 4) for load in loads]
        self._write(
            {
                "kind": "train",
                "step": step,
                "loss": loss,
                "aux_loss": aux_loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_s,
                "expert_load": loads,
                "imbalance": self.last_imbalance,
                "attempt": self.attempt,
                **({"nonfinite": list(nonfinite)} if nonfinite else {}),
            }
        )
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)
        elif step % 10 == 0 or step == self.cfg.steps:
            self._log(f"step {step}: loss {loss:.4f} tok/s {tokens_per_s:,.0f}")

    def validation(self, step: int, val_loss: float, bits_per_byte: float | None = None) -> None:
        """One validation: its loss (nats per token) and, when given, bits per UTF-8 byte of
        the validation text (comparable between byte and token runs)."""
        if not self.active:
            return
        self.val_losses.append((step, val_loss))
        record = {"kind": "val", "step": step, "val_loss": val_loss, "attempt": self.attempt}
        bpb = ""
        if bits_per_byte is not None:
            record["val_bits_per_byte"] = bits_per_byte
            bpb = f" ({bits_per_byte:.4f} bits per byte)"
        self._write(record)
        self._log(f"step {step}: validation loss {val_loss:.4f}{bpb}")

    def memory(self, step: int, per_rank: list[dict[str, int]]) -> None:
        """Per-rank bytes of parameters, gradients and optimizer state (local shards, after the
        first optimizer step) and the second step's peak (``moesaic.train.memory``): one
        record, and one line with rank 0's and the largest peak."""
        if not self.active:
            return
        self._write({"kind": "memory", "step": step, "per_rank": per_rank})
        mine = per_rank[0]
        line = (
            "memory per rank (rank 0): parameters {:,} B (dense {:,}, experts {:,}), gradients "
            "{:,} B, optimizer state {:,} B".format(
                mine["params"],
                mine["dense_params"],
                mine["expert_params"],
                mine["grads"],
                mine["optimizer"],
            )
        )
        top = max(per_rank, key=lambda r: r["step_peak"])
        if top["step_peak"]:
            line += "; step peak {:,} B on rank {} ({:,} B above the step's start)".format(
                top["step_peak"], per_rank.index(top), top["step_peak"] - top["step_start"]
            )
        self._log(line)

    def checkpoint(self, step: int, path) -> None:
        if self.active:
            self._write({"kind": "checkpoint", "step": step, "path": str(path)})

    def finish(self) -> dict:
        if not self.active:
            return {}
        if self.bar is not None:
            self.bar.close()
        wall = time.perf_counter() - self.t_start
        steady = sorted(self.tok_s[min(5, len(self.tok_s) - 1) :]) if self.tok_s else [0.0]
        summary = {
            "kind": "summary",
            "steps": self.cfg.steps,
            "steps_this_attempt": self.cfg.steps - self.start_step,
            "wall_s": wall,
            "tokens_per_s_median": steady[len(steady) // 2],
            "train_loss_first": self.first_loss,
            "train_loss_last": self.last_loss,
            "val_loss_first": self.val_losses[0][1] if self.val_losses else None,
            "val_loss_last": self.val_losses[-1][1] if self.val_losses else None,
            "val_curve": self.val_losses,
            "expert_imbalance_last": self.last_imbalance,
            "run_dir": self.cfg.run_dir,
            "combination": combination_record(self.cfg),
        }
        plan = plan_record(self.cfg)  # --plan: the combination it chose
        if plan is not None:
            summary["plan"] = plan
        self._write(summary)
        try:
            self.metrics.close()
        except OSError as exc:
            raise self._io_error(exc) from None
        print(format_summary(summary), file=sys.stderr, flush=True)
        return summary


def format_summary(s: dict) -> str:
    """The final table."""

    def f(v) -> str:
        return "-" if v is None else f"{v:.4f}"

    rows = [
        ("steps", f"{s['steps']} ({s['steps_this_attempt']} this run)"),
        ("wall time", f"{s['wall_s']:.1f} s"),
        ("tokens/s (median)", f"{s['tokens_per_s_median']:,.0f}"),
        ("train loss", f"{f(s['train_loss_first'])} -> {f(s['train_loss_last'])}"),
        ("validation loss", f"{f(s['val_loss_first'])} -> {f(s['val_loss_last'])}"),
        ("expert max/mean", ", ".join(f"{x:.2f}" for x in s["expert_imbalance_last"]) or "-"),
        ("run directory", s["run_dir"]),
    ]
    if "plan" in s:  # --plan: what it chose
        p = s["plan"]
        rows.append(
            ("plan", f"{p['strategy']}+{p['schedule']} R={p['pipeline_degree']} ({p['source']})")
        )
    width = max(len(k) for k, _ in rows)
    lines = ["", "summary", "-" * (width + 40)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)
