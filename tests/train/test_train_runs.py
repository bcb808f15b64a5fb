"""End-to-end runs under the elastic launcher: learning, determinism, resume, resharding,
restart after a killed worker, the torchrun worker entry and generation."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from _train_helpers import (
    final_weights,
    read_metrics,
    start_from,
    tiny_args,
    train_losses,
)

from moesaic.cli import main
from moesaic.train.generate import generate_text


def test_loss_falls_and_metrics_are_complete(reference):
    records = read_metrics(reference)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert train[-1]["loss"] < train[0]["loss"] - 0.2
    assert [r["step"] for r in val] == [4, 8] and val[-1]["val_loss"] < val[0]["val_loss"]
    for r in train:
        # 2 MoE layers x 4 experts; every token makes top_k = 2 assignments (dropless).
        assert len(r["expert_load"]) == 2 and all(len(load) == 4 for load in r["expert_load"])
        assert all(sum(load) == 2 * 4 * 32 * 2 for load in r["expert_load"])
        assert all(x >= 1.0 for x in r["imbalance"]) and r["tokens_per_s"] > 0
        assert r["aux_loss"] > 0
    summary = records[-1]
    assert summary["kind"] == "summary" and summary["val_loss_last"] == val[-1]["val_loss"]
    # what it trained, resolved (a --plan run of the same combination records the same)
    combination = {k: summary["combination"][k] for k in ("strategy", "schedule", "ar_chunk")}
    assert combination == {"strategy": "dropless", "schedule": "vanilla", "ar_chunk": "auto"}
    assert "plan" not in summary


def test_torchrun_entry_is_deterministic(reference, data_file, tmp_path):
    """``torchrun -m moesaic.train`` (the multi-node form) reproduces the run bitwise."""
    run_dir = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "moesaic.train", *tiny_args(data_file, run_dir)[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert train_losses(run_dir) == train_losses(reference)
    ref_w, w = final_weights(reference), final_weights(run_dir)
    assert all(torch.equal(ref_w[k], w[k]) for k in ref_w)


def test_resume_is_bitwise(reference, data_file, tmp_path):
    run_dir = start_from(reference, 4, tmp_path / "resumed")
    assert main(tiny_args(data_file, run_dir, "--resume")) == 0
    ref = train_losses(reference)
    assert train_losses(run_dir) == {s: ref[s] for s in range(5, 9)}
    ref_w, w = final_weights(reference), final_weights(run_dir)
    assert all(torch.equal(ref_w[k], w[k]) for k in ref_w)


def test_resume_with_another_ep_size_reshards(reference, data_file, tmp_path):
    """Saved at EP 2 (one EP group), resumed at EP 1 (two DP replicas of all 4 experts)."""
    run_dir = start_from(reference, 4, tmp_path / "ep1")
    assert main(tiny_args(data_file, run_dir, "--resume", "--ep", "1")) == 0
    ref, got = train_losses(reference), train_losses(run_dir)
    assert sorted(got) == [5, 6, 7, 8]
    # Same weights and data; only the reduction order of the all-reduces differs (fp32).
    for s in got:
        assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), (s, got[s], ref[s])
    ref_w, w = final_weights(reference), final_weights(run_dir)
    for k in ref_w:
        torch.testing.assert_close(w[k], ref_w[k], rtol=1e-4, atol=1e-5)


def test_killed_worker_restarts_from_checkpoint(reference, data_file, tmp_path):
    """Rank 1 is SIGKILLed at step 6; the agent restarts the group, which resumes at step 4."""
    run_dir = tmp_path / "killed"
    args = ["--max-restarts", "1", "--fault-kill-rank", "1", "--fault-kill-step", "6"]
    assert main(tiny_args(data_file, run_dir, *args)) == 0
    records = read_metrics(run_dir)
    attempts = {(r["step"], r["attempt"]) for r in records if r["kind"] == "train"}
    assert {(5, 0), (5, 1), (8, 1)} <= attempts and (6, 0) not in attempts
    assert train_losses(run_dir) == train_losses(reference)
    ref_w, w = final_weights(reference), final_weights(run_dir)
    assert all(torch.equal(ref_w[k], w[k]) for k in ref_w)
    # Nothing left behind by the aborted attempt.
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]


def test_generate_from_checkpoint(reference, capsys):
    text = generate_text(str(reference), "def ", max_new_tokens=16, temperature=0)
    assert text.startswith("def ") and len(text.encode("utf-8", "replace")) >= 4
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(reference),
                "--prompt",
                "import",
                "--max-new-tokens",
                "8",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("import")


def test_no_stale_tmp_and_latest_pointer(reference):
    ckpts = sorted(p.name for p in (reference / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_00000004", "step_00000008"]
    assert (reference / "checkpoints" / "latest").read_text().strip() == "step_00000008"
    assert os.path.isfile(reference / "checkpoints" / "step_00000008" / "meta.json")
