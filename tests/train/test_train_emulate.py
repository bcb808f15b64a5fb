"""``moesaic train --emulate CLUSTER.toml``: the training job on an emulated network.

The run on a slow emulated cluster must be the same job as the loopback reference run (the same
losses bitwise: the network changes when the bytes arrive, not what they are) while its bytes
demonstrably crossed the emulated links (the kernel's counters of every rank's ``eth0``, which
only the namespaces have) and its steps took at least the links' latency bound (a loopback step
of this model takes 35-50 ms on the 2-core machine, the emulated one ~350 ms at 10 ms).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _train_helpers import fails, interrupt_when, read_metrics, tiny_args, train_losses

from moesaic.cli import main
from moesaic.cluster.system import leftover_namespaces, support_problem

PROBLEM = support_problem(probe=True)

LATENCY_MS = 10.0
# 2 ranks behind one switch: 50 Mbit/s, 10 ms one way (the delay line is accurate to a few %
# at >= 3 ms: docs/cluster.md).
SLOW = f"""\
name = "slow2"
world_size = 2

[[levels]]
name = "node"
size = 2
bandwidth_gbps = 0.05
latency_ms = {LATENCY_MS}
"""


@pytest.fixture
def slow_cluster(tmp_path) -> Path:
    path = tmp_path / "slow2.toml"
    path.write_text(SLOW)
    return path


@pytest.mark.netns
@pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")
@pytest.mark.timeout(180)
def test_emulated_run_is_the_reference_job_over_the_links(reference, data_file, tmp_path, capfd):
    cluster = tmp_path / "slow2.toml"
    cluster.write_text(SLOW)
    run_dir = tmp_path / "emulated"
    assert main(tiny_args(data_file, run_dir, "--emulate", str(cluster))) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    # The same job as the loopback run: 8 steps, the same losses bitwise, both checkpoints.
    assert train_losses(run_dir) == train_losses(reference)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [
        "step_00000004",
        "step_00000008",
    ]
    records = read_metrics(run_dir)
    assert [r["kind"] for r in records[-2:]] == ["summary", "network"]
    network = records[-1]
    assert network["cluster"] == "slow2"
    # Each step all-reduces the embedding's gradient (256 bytes x d_model 32, fp32): rank 0's
    # sum needs every one of rank 1's 32 KiB and the other way round, so each rank's eth0 sent
    # at least 8 x 32 KiB; the all-to-alls, other gradients and checkpoints add to it.
    assert min(network["tx_bytes"]) >= 8 * 256 * 32 * 4, network
    assert min(network["rx_bytes"]) >= 8 * 256 * 32 * 4, network
    # A step runs 2 MoE layers x (dispatch + combine) x (forward + backward) = 8 all-to-alls
    # one after another, each waiting at least one one-way latency of the link.
    tokens_per_step = 2 * 4 * 32
    step_s = [tokens_per_step / r["tokens_per_s"] for r in records if r["kind"] == "train"]
    assert min(step_s) >= 8 * LATENCY_MS / 1e3, step_s
    assert "moesaic train: emulated cluster slow2: the ranks sent" in err, err


@pytest.mark.netns
@pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")
@pytest.mark.timeout(180)
def test_a_dead_rank_is_one_line_naming_the_rank(data_file, slow_cluster, tmp_path, capfd):
    run_dir = tmp_path / "killed"
    args = tiny_args(data_file, run_dir, "--emulate", str(slow_cluster), "--steps", "3")
    assert main([*args, "--fault-kill-rank", "1", "--fault-kill-step", "2"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("moesaic train: error: ")]
    # The survivor's record: its collective lost the peer (rank 1 was SIGKILLed silently).
    assert len(errors) == 1 and errors[0].startswith("moesaic train: error: rank 0: "), err
    assert f"(traceback in {run_dir}/logs/rank_0.log)" in errors[0], err


@pytest.mark.netns
@pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")
@pytest.mark.timeout(180)
def test_ctrl_c_stops_the_workers_and_removes_the_network(data_file, slow_cluster, tmp_path):
    run, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    args = tiny_args(data_file, run, "--emulate", str(slow_cluster), "--steps", "100000")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moesaic", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
        start_new_session=True,
    )
    metrics, fabric = run / "metrics.jsonl", []

    def stepping_over_the_links() -> bool:
        if not (metrics.is_file() and '"train"' in metrics.read_text()):
            return False
        fabric[:] = tmp.glob("msc-*")  # the network's directory, named by its run id
        return True

    interrupt_when(proc, stepping_over_the_links, wait_s=90)
    assert len(fabric) == 1, fabric
    run_id = fabric[0].name.split("-")[1]
    assert not leftover_namespaces(run_id), "the emulated network stayed up"
    for pattern in ("msc-*", "moesaic-emulate-*"):  # the network's, the launcher's
        assert not list(tmp.glob(pattern)), f"{pattern} stayed behind"
    left = subprocess.run(["pgrep", "-f", f"moesaic.train.launched {tmp}"], capture_output=True)
    assert left.stdout == b"", "workers outlived the launcher"


def test_the_torchrun_entry_refuses_emulate(slow_cluster, capsys):
    from moesaic.train.__main__ import main as worker_entry

    assert worker_entry(["--emulate", str(slow_cluster)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moesaic train: error: --emulate {slow_cluster} starts the workers")


def test_nproc_that_disagrees_with_the_cluster_is_refused(
    data_file, slow_cluster, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    err = fails(
        tiny_args(data_file, run_dir, "--emulate", str(slow_cluster), "--nproc", "3"), capsys
    )
    assert err == (
        "moesaic train: error: nproc (3) must be the world size (2) of the emulated cluster "
        f"{slow_cluster}: one worker runs in each rank's namespace (leave --nproc out)"
    )
    assert not run_dir.exists()


def test_nccl_is_refused_on_an_emulated_cluster(data_file, slow_cluster, tmp_path, capsys):
    args = tiny_args(data_file, tmp_path / "run", "--emulate", str(slow_cluster))
    err = fails([*args, "--backend", "nccl"], capsys)
    assert "backend 'nccl' cannot train on the emulated cluster" in err


def test_emulate_defaults_nproc_backend_and_hybrids_cluster(slow_cluster):
    import argparse

    from moesaic.train.flags import add_train_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    hybrid = ["--emulate", str(slow_cluster), "--strategy", "hybrid", "--experts", "4"]
    cfg = config_from_args(parser.parse_args(hybrid))
    assert (cfg.nproc, cfg.backend, cfg.cluster) == (2, "gloo", str(slow_cluster))
    cfg = config_from_args(parser.parse_args(["--emulate", str(slow_cluster)]))
    assert (cfg.nproc, cfg.backend, cfg.cluster) == (2, "gloo", None)  # dropless reads none


def test_a_machine_without_namespaces_is_refused_before_anything(
    data_file, slow_cluster, tmp_path, capsys, monkeypatch
):
    import moesaic.train.emulate as emulate

    monkeypatch.setattr(emulate, "support_problem", lambda: "the emulated cluster needs root")
    run_dir = tmp_path / "run"
    err = fails(tiny_args(data_file, run_dir, "--emulate", str(slow_cluster)), capsys)
    assert err == f"moesaic train: error: --emulate {slow_cluster}: the emulated cluster needs root"
    assert not run_dir.exists()


@pytest.mark.netns
@pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")
@pytest.mark.timeout(180)
def test_cluster_down_removes_a_killed_emulation_s_work_directory(
    data_file, slow_cluster, tmp_path
):
    # Issue 57 item 7: a SIGKILLed `train --emulate` left moesaic-emulate-* in the temp dir,
    # which `cluster down` did not remove (it removed the namespaces).
    import signal
    import time

    from moesaic.cluster.lifecycle import down

    run, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    args = tiny_args(data_file, run, "--emulate", str(slow_cluster), "--steps", "100000")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moesaic", *args],
        stderr=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmp)},
        start_new_session=True,
    )
    metrics = run / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 90
        while not (metrics.is_file() and '"train"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        fabric = list(tmp.glob("msc-*"))
        assert len(fabric) == 1, fabric
        # Every file of the run's own lies inside the network's directory (torch's compile
        # cache, torchinductor_<user>, is torch's).
        assert _run_files(tmp) == [fabric[0].name]
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: no teardown runs
        proc.wait(timeout=30)
        run_id = fabric[0].name.split("-")[1]
        deadline = time.monotonic() + 60  # the workers notice their launcher is gone
        while subprocess.run(["pgrep", "-f", f"moesaic.train.launched {tmp}"]).returncode == 0:
            assert time.monotonic() < deadline, "workers outlived the launcher"
            time.sleep(0.2)
        report = down(run_id, tmp_root=tmp)
        assert str(fabric[0]) in report.removed_dirs, report
        assert not _run_files(tmp), "the killed run's directories stayed behind"
        assert not leftover_namespaces(run_id)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run_files(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(("msc-", "moesaic-")))
