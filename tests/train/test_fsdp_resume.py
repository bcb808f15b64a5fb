"""Sharded runs end to end (``moesaic train --dp-shard``): against the unsharded run, resumed at
another ``--dp-shard`` and another EP, and from a checkpoint written before sharding.

Resuming at another world size keeps the mathematics when the global batch is kept: rank r's
j-th sequence is global sample ``consumed + r * B + j``, so 4 ranks of 2 sequences see the 8
sequences 2 ranks of 4 saw, and the loss is the mean over them either way.

Tolerance: losses within rtol 1e-5 (the schedules' rule, docs/training.md): the runs compute
the same sums in another order (EP 1 against EP 2, reduce-scatter against all-reduce, 2 or 4
ranks), which AdamW carries into the next steps' weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _train_helpers import fails, final_weights, read_metrics, start_from, tiny_args, train_losses

from moesaic.cli import main
from moesaic.models import MoEGPTConfig
from moesaic.sim.memory import predict_memory, state_bytes
from moesaic.train.ckpt_choice import latest_checkpoint, read_checkpoint_meta

RTOL = 1e-5
HF_MIXTRAL = Path(__file__).resolve().parents[2] / "examples/hf/mixtral.json"


@pytest.fixture(scope="module")
def sharded(data_file, tmp_path_factory):
    """8 steps on 2 ranks, ``--dp-shard 2 --ep 1`` (checkpoints at 4 and 8), step 2's peak
    measured (``--measure-peak``)."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "sharded"
    flags = ("--dp-shard", "2", "--ep", "1", "--measure-peak")
    assert main(tiny_args(data_file, run_dir, *flags)) == 0
    return run_dir


def _close(got: dict[int, float], want: dict[int, float], steps) -> None:
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=RTOL), s


def test_sharded_run_equals_unsharded(sharded, reference):
    _close(train_losses(sharded), train_losses(reference), range(1, 9))
    # the sharded checkpoint loads whole into one process (generate's path): the same weights,
    # each tensor within 1e-6 of its norm. Not element by element: AdamW's update of a gradient
    # element near zero is about lr * sign(g), so the runs' fp32 rounding differences move a
    # lone weight by ~lr (one element of 4096 at 4e-6 of the tensor's largest after 8 steps,
    # on a 2-core AMD EPYC); a checkpoint loaded wrong moves whole tensors.
    got, want = final_weights(sharded), final_weights(reference)
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert float((got[name] - w).norm()) <= 1e-6 * float(w.norm()), name
    # the bytes measured per rank after step 1 are those predicted (every tensor's first
    # dimension divides by 2 here: no rank holds an extra row); step 2's peak, measured in the
    # sharded run only (a CPU run counts it with --measure-peak), within the model's 10%
    cfg = MoEGPTConfig.from_dict(read_checkpoint_meta(latest_checkpoint(str(sharded)))["model"])
    for run, dp_shard, ep in ((sharded, 2, 1), (reference, None, 2)):
        (memory,) = [r for r in read_metrics(run) if r["kind"] == "memory"]
        assert len(memory["per_rank"]) == 2 and memory["step"] == 2
        want = state_bytes(cfg, ep=ep, dp_shard=dp_shard)
        peak = predict_memory(cfg, batch_size=4, ep=ep, dp_shard=dp_shard).peak
        for mine in memory["per_rank"]:
            got = (mine["params"], mine["grads"], mine["optimizer"])
            assert got == (want.params, want.grads, want.optimizer), (run.name, mine)
            if dp_shard is None:
                assert mine["step_peak"] == mine["step_start"] == 0  # not measured
            else:
                assert mine["step_peak"] == pytest.approx(peak, rel=0.10), (mine, peak)


def test_async_checkpoint_sharded(sharded, data_file, tmp_path):
    """``--async-checkpoint`` (DCP's asynchronous staging of the sharded state): the same
    checkpoints as the synchronous run's, so the same final weights, bitwise."""
    run_dir = tmp_path / "async"
    flags = ("--dp-shard", "2", "--ep", "1", "--async-checkpoint")
    assert main(tiny_args(data_file, run_dir, *flags)) == 0
    got, want = final_weights(run_dir), final_weights(sharded)
    for name, w in want.items():
        assert torch.equal(got[name], w), name


@pytest.mark.parametrize(
    "flags",
    [
        ("--dp-shard", "4", "--ep", "1"),  # dense and experts over 4 ranks
        ("--dp-shard", "2", "--ep", "2"),  # another EP: experts split by EP, then sharded
    ],
    ids=["dp_shard-4", "ep-2"],
)
def test_resume_at_another_layout(sharded, data_file, tmp_path, flags):
    run_dir = start_from(sharded, 4, tmp_path / "run")
    args = tiny_args(data_file, run_dir, "--resume", "--nproc", "4", *flags)
    args[args.index("--batch-size") + 1] = "2"  # the same 8 sequences per step
    assert main(args) == 0
    _close(train_losses(run_dir), train_losses(sharded), range(5, 9))


def test_pre_sharding_checkpoint_resumes_sharded(reference, data_file, tmp_path):
    """An unsharded run's checkpoint (EP 2: the format of every checkpoint written before
    sharding) resumes as ``--dp-shard 2 --ep 1``."""
    run_dir = start_from(reference, 4, tmp_path / "run")
    assert main(tiny_args(data_file, run_dir, "--resume", "--dp-shard", "2", "--ep", "1")) == 0
    _close(train_losses(run_dir), train_losses(reference), range(5, 9))


PRE_FSDP = Path(__file__).resolve().parent / "fixtures/pre_fsdp_run"


def test_checkpoint_of_the_tree_before_sharding_resumes_sharded(data_file, tmp_path):
    """A checkpoint written by the tree before FSDP2 sharding (d4a5703, the parent of its first
    commit; ``fixtures/make_pre_fsdp_run.sh`` wrote it: EP 2 on 2 ranks, step 4 of 8) resumes
    as ``--dp-shard 2 --ep 1`` and continues that tree's own run: steps 5-8 within rtol 1e-5
    of its recorded losses."""
    run_dir = start_from(PRE_FSDP, 4, tmp_path / "run")
    args = tiny_args(data_file, run_dir, "--resume", "--dp-shard", "2", "--ep", "1")
    shape = {"--d-model": "16", "--expert-hidden": "16", "--seq-len": "16"}  # the fixture's
    args = [shape.get(prev, a) for prev, a in zip(["", *args[:-1]], args, strict=True)]
    assert main(args) == 0
    want = {r["step"]: r["loss"] for r in read_metrics(PRE_FSDP) if r["kind"] == "train"}
    _close(train_losses(run_dir), want, range(5, 9))


@pytest.mark.parametrize(
    "flags,start",
    [
        (
            ("--dp-shard", "2", "--ep", "1", "--schedule", "flowmoe"),
            "schedule 'flowmoe' does not run with FSDP sharding (--dp-shard, --dp-replicate): "
            "its gradient pool",
        ),
        (
            ("--dp-replicate", "2", "--strategy", "taskflow"),
            "strategy 'taskflow' does not run with FSDP sharding (--dp-shard, --dp-replicate): "
            "its tile tasks",
        ),
        (
            ("--dp-shard", "4", "--ep", "1"),
            "the world size (2) must be dp_replicate (1) x dp_shard (4) x ep (1) = 4",
        ),
        (("--dp-shard", "4"), "dp_replicate (1) x dp_shard (4) = 4 must divide the world size (2)"),
    ],
    ids=["flowmoe", "taskflow", "world", "ep-left"],
)
def test_refused_before_any_worker_starts(data_file, tmp_path, capsys, flags, start):
    err = fails(tiny_args(data_file, tmp_path / "run", *flags), capsys)
    assert err.startswith(f"moesaic train: error: {start}"), err
    assert not (tmp_path / "run").exists()


def test_hf_config_refused_sharded(data_file, tmp_path, capsys):
    args = ["train", "--data", str(data_file), "--run-dir", str(tmp_path / "run")]
    err = fails([*args, "--hf-config", str(HF_MIXTRAL), "--dp-shard", "2"], capsys)
    assert err.startswith(
        f"moesaic train: error: --dp-shard/--dp-replicate do not apply to --hf-config "
        f"({HF_MIXTRAL}) yet"
    ), err
