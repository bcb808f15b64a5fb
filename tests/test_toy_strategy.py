"""A new strategy is its own module plus one registry entry; nothing else changes.

A toy strategy lives in a temporary module outside the package (``TOY_SOURCE``: dropless's rows
with another regrouping, a stable sort by local expert instead of dropless's index arithmetic)
and is registered the way user code does it, by ``MOESAIC_STRATEGIES`` (so that spawned worlds
and ``moesaic train``'s workers see it too). With no other edit, the EP parity check, the layout
test, ``moesaic bench layer`` and ``moesaic train`` all pick it up. The environment is restored
after each test, so no other test sees the toy.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

import moesaic
from moesaic.cli import main
from moesaic.strategies import get_strategy, register_strategy, strategy_names
from moesaic.strategy_table import ENV_VAR
from moesaic.testing import run_world
from test_ep_parity import check_parity, ep_worker
from test_strategy_layout import layout_worker, scenarios_for

TOY_MODULE = "moesaic_toy_strategy"
TOY_SOURCE = '''
"""toy: dropless rows, regrouped by local expert with a stable sort."""

from dataclasses import dataclass

import torch

from moesaic.strategies.base import CommStats, DispatchCombineStrategy, ExchangeHandle, Outbound


@dataclass(frozen=True, slots=True)
class ToyHandle(ExchangeHandle):
    order_M: torch.Tensor  # received rows (source rank, local expert) -> expert order
    inverse_M: torch.Tensor
    counts_e: list


class ToyStrategy(DispatchCombineStrategy[ToyHandle]):
    name = "toy"

    def dispatch_send(self, x_TH, plan):
        P, e = self.group.size, self.placement.num_local
        send_Pe = plan.counts_Pe
        recv_Pe = send_Pe
        if P > 1:
            recv_Pe = torch.empty_like(send_Pe)
            self.group.all_to_all_single(recv_Pe, send_Pe, what="toy counts")
        in_splits, out_splits = send_Pe.sum(1).tolist(), recv_Pe.sum(1).tolist()
        expert_M = torch.arange(e).repeat(P).repeat_interleave(recv_Pe.reshape(-1).cpu())
        order_M = torch.sort(expert_M, stable=True).indices
        row_bytes = x_TH.shape[-1] * x_TH.element_size()
        meta = self.to_every_peer(e * send_Pe.element_size())
        rows = self.peer_bytes(in_splits, out_splits, row_bytes)
        stats = CommStats(
            dispatch_bytes=self.off_rank(in_splits) * row_bytes,
            combine_bytes=self.off_rank(out_splits) * row_bytes,
            meta_bytes=sum(meta),
            dropped_rows=plan.kept_TK.numel() - sum(in_splits),
            collectives=3 if P > 1 else 0,
            peer_bytes_P=tuple(a + b for a, b in zip(rows, meta)),
        )
        handle = ToyHandle(
            plan=plan,
            in_splits_P=in_splits,
            out_splits_P=out_splits,
            order_M=order_M.to(x_TH.device),
            inverse_M=torch.argsort(order_M).to(x_TH.device),
            counts_e=recv_Pe.sum(0).tolist(),
        )
        return Outbound(plan.permute(x_TH, sum(in_splits)), handle, stats)

    def dispatch_recv(self, rows, handle):
        return rows[handle.order_M], handle.counts_e

    def combine_send(self, y_MH, handle):
        return y_MH[handle.inverse_M]

    def combine_recv(self, rows, handle):
        return rows
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """Registers ``toy`` from a module in ``tmp_path``, for this process and its children."""
    (tmp_path / f"{TOY_MODULE}.py").write_text(TOY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    monkeypatch.setenv(ENV_VAR, f"toy={TOY_MODULE}:ToyStrategy")
    yield "toy"
    sys.modules.pop(TOY_MODULE, None)


def test_the_environment_registers_it_and_nothing_else_sees_it(toy):
    assert strategy_names()[-1] == toy
    assert get_strategy(toy).__module__ == TOY_MODULE
    cfg = moesaic.MoEConfig(hidden_size=4, ffn_hidden_size=4, num_experts=2, dispatcher=toy)
    assert cfg.dispatcher == toy  # the config validates against the registry
    with pytest.raises(ValueError, match="already registered"):
        register_strategy(toy, "elsewhere:Toy")


def test_bad_environment_entries_are_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "toy=no_colon")
    with pytest.raises(ValueError, match=f"{ENV_VAR}: entry 'toy=no_colon' must be name=module"):
        strategy_names()
    monkeypatch.setenv(ENV_VAR, "dropless=some.module:Class")
    with pytest.raises(ValueError, match=f"{ENV_VAR}: strategy 'dropless' is already registered"):
        strategy_names()
    # Registered, but not importable: the error names the strategy, its target and what is missing.
    monkeypatch.setenv(ENV_VAR, "toy=no_such_module:Toy, toy2=json:NoSuchClass")
    with pytest.raises(ValueError, match=r"'toy' .* module 'no_such_module' is not found"):
        get_strategy("toy")
    with pytest.raises(ValueError, match=r"'toy2' .* module 'json' has no 'NoSuchClass'"):
        get_strategy("toy2")


def test_without_the_environment_there_is_no_toy():
    assert "toy" not in strategy_names()


def _parity_and_layout(rank: int, world: int, names: tuple[str, ...]) -> tuple[dict, list]:
    # One world for both (each spawned world costs seconds of torch imports on 2 cores).
    return ep_worker(rank, world, names), layout_worker(rank, world, names)


def test_ep_parity_and_layout_tests_pick_it_up(toy):
    per_rank = run_world(_parity_and_layout, 2, (toy,), timeout_s=120)
    check_parity([parity for parity, _ in per_rank], 2, (toy,))
    for _, rows in per_rank:
        assert len(rows) == len(scenarios_for(2)) >= 4
        assert all(t.startswith(f"{toy}/") for t in rows)


def test_bench_layer_times_it_by_default(toy, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "layer", "--hidden", "8", "--ffn", "8", "--experts", "4", "--tokens", "16"]
    args += ["--ep", "2", "--iters", "1", "--warmup", "0", "--no-transformers", "--out", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["config"]["strategies"][-1] == toy
    impls = {r["impl"] for r in result["rows"]}
    assert toy in impls and set(strategy_names()) <= impls


def test_train_runs_it(toy, data_file, tmp_path):
    from moesaic.train.checkpoint import load_model_for_inference
    from moesaic.train.ckpt_choice import latest_checkpoint

    run_dir = tmp_path / "run"
    args = ["train", "--data", str(data_file), "--run-dir", str(run_dir), "--strategy", toy]
    args += ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--experts", "4"]
    args += ["--expert-hidden", "32", "--seq-len", "32", "--batch-size", "4", "--steps", "4"]
    args += ["--eval-every", "0", "--eval-batches", "1", "--ckpt-every", "0", "--warmup-steps", "1"]
    args += ["--threads", "1", "--no-progress", "--timeout-s", "60"]
    assert main(args) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if m["kind"] == "train"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    model, meta = load_model_for_inference(latest_checkpoint(str(run_dir)))
    assert meta["model"]["moe"]["dispatcher"] == toy and model.config.moe.dispatcher == toy
