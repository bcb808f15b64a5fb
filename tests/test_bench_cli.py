"""``moesaic bench layer`` guards: committed results, ``--out``, sizes, option errors, Ctrl-C.

Runs are tiny (H = F = 16, 8 tokens, 1 iteration, EP 1) so that each takes well under a second
after torch is imported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moesaic.bench.options import DEFAULT_OUT, check_world_sizes, resolve_out
from moesaic.cli import main

TINY = ["--hidden", "16", "--ffn", "16", "--experts", "4", "--tokens", "8", "--iters", "1"]
TINY += ["--warmup", "0", "--ep", "1", "--no-transformers"]
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _committed(tmp_path: Path, monkeypatch) -> Path:
    """A stand-in for the committed result, at the default path under a fresh working dir."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / DEFAULT_OUT
    path.parent.mkdir(parents=True)
    path.write_text('{"committed": true}\n')
    return path


def test_quick_run_does_not_overwrite_the_committed_result(tmp_path, monkeypatch, capsys):
    # The reproduction: this used to replace benchmarks/results/bench_layer_cpu.json.
    committed = _committed(tmp_path, monkeypatch)
    assert main(["bench", "layer", "--quick", "--no-transformers", "--ep", "1"]) == 2
    assert committed.read_text() == '{"committed": true}\n'
    err = capsys.readouterr().err
    assert "--out FILE is required" in err and "--quick" in err and str(DEFAULT_OUT) in err
    assert sorted(p.name for p in committed.parent.iterdir()) == [committed.name]


def test_out_directory_gets_a_file_inside_and_no_stray_files(tmp_path):
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    assert main(["bench", "layer", *TINY, "--out", str(out_dir)]) == 0
    assert json.loads((out_dir / "bench_layer_cpu.json").read_text())["rows"]
    assert sorted(p.name for p in out_dir.iterdir()) == ["bench_layer_cpu.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # no results.tmp beside it


def test_out_file_is_written_atomically_without_leftovers(tmp_path):
    out = tmp_path / "sub" / "r.json"  # a missing parent is created
    assert main(["bench", "layer", *TINY, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["tokens_per_rank"] == 8
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.json"]


def test_quick_keeps_explicit_tokens_and_iters(tmp_path):
    # --quick used to replace an explicit --tokens 8 --iters 1 by 256 tokens and 3 iterations.
    out = tmp_path / "r.json"
    args = ["--quick", "--hidden", "16", "--ffn", "16", "--experts", "4", "--tokens", "8"]
    args += ["--iters", "1", "--ep", "1", "--no-transformers", "--out", str(out)]
    assert main(["bench", "layer", *args]) == 0
    config = json.loads(out.read_text())["config"]
    assert (config["tokens_per_rank"], config["iters"], config["warmup"]) == (8, 1, 1)
    assert config["ep_sizes"] == [1]


def test_absurd_ep_size_is_refused_before_any_process_starts(tmp_path, capsys):
    ep = 16 * CORES  # the issue: --ep 64 --experts 64 on 2 cores hung the machine
    args = ["bench", "layer", "--ep", str(ep), "--experts", str(ep), "--out", str(tmp_path)]
    start = time.monotonic()
    assert main(args) == 2
    assert time.monotonic() - start < 30  # refused, not run
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"--ep {ep} would start {ep} processes" in err
    assert f"this machine's {CORES} core" in err and "--allow-oversubscribe" in err
    assert list(tmp_path.iterdir()) == []


def test_world_size_guard_rules():
    check_world_sizes((1, 2, 4), cores=2)  # the default run: EP 4 on 2 cores is 2 per core
    check_world_sizes((8,), cores=2)  # 4 per core is the limit
    with pytest.raises(ValueError, match=r"--ep 9 would start 9 processes on this machine's 2"):
        check_world_sizes((1, 9), cores=2)
    check_world_sizes((64,), cores=2, allow_oversubscribe=True)
    with pytest.raises(ValueError, match=r"--cluster c.toml has 16 ranks: it would start 16"):
        check_world_sizes((16,), cores=2, option="--cluster c.toml")


def test_out_resolution_rules(tmp_path):
    assert resolve_out(None, default_run=True) == DEFAULT_OUT
    with pytest.raises(ValueError, match=r"--out FILE is required .*\(--tokens 8\)"):
        resolve_out(None, default_run=False, differences="--tokens 8")
    assert resolve_out(str(tmp_path), default_run=False) == tmp_path / "bench_layer_cpu.json"
    named = resolve_out(str(tmp_path), default_run=False, cluster="x/2dc.toml")
    assert named == tmp_path / "bench_layer_cluster_2dc.json"
    assert resolve_out(str(tmp_path / "new") + os.sep, default_run=False) == (
        tmp_path / "new" / "bench_layer_cpu.json"
    )
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"--out \(.*f/r.json\): .*f is not a directory"):
        resolve_out(str(tmp_path / "f" / "r.json"), default_run=False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ep", "0"], "argument --ep: EP sizes must be ints > 0, got '0'"),
        (["--ep", "1,x"], "argument --ep: EP sizes must be ints > 0, got '1,x'"),
        (["--tokens", "0"], "argument --tokens: must be an int > 0, got '0'"),
        (["--iters", "-1"], "argument --iters: must be an int > 0, got '-1'"),
        (["--warmup", "-1"], "argument --warmup: must be an int >= 0, got '-1'"),
        (["--experts", "two"], "argument --experts: must be an int > 0, got 'two'"),
    ],
)
def test_bad_values_are_one_argparse_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "layer", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].endswith(message)


def test_out_in_a_missing_file_parent_is_one_line(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["bench", "layer", *TINY, "--out", str(tmp_path / "f" / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a directory" in err


@pytest.mark.parametrize("ep", ["1", "2"])
def test_ctrl_c_is_one_line_and_exit_130(tmp_path, ep):
    # A run long enough to be interrupted (2000 iterations); the whole process group gets the
    # SIGINT, as from a terminal's Ctrl-C, so an EP world's workers get it too. At EP 2 it lands
    # while the workers start up (importing torch) or step: each used to print a traceback.
    args = ["bench", "layer", *TINY, "--iters", "2000", "--ep", ep, "--out", str(tmp_path)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moesaic", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once the run starts
        assert line.startswith("bench layer: "), line
        time.sleep(1.5)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip() == "moesaic bench: interrupted", err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ep_sizes": (1, 0)}, r"ep_sizes\[1\] \(0\) must be > 0"),  # was a ZeroDivisionError
        ({"ep_sizes": ()}, "ep_sizes must name at least one EP size"),
        ({"tokens_per_rank": 0}, r"tokens_per_rank \(0\) must be > 0"),
        ({"iters": 0}, r"iters \(0\) must be > 0"),
        ({"warmup": -1}, r"warmup \(-1\) must be >= 0"),
    ],
)
def test_layer_bench_refuses_bad_sizes(fields, message):
    from moesaic.bench.layer import LayerBench

    with pytest.raises(ValueError, match=message):
        LayerBench(**fields)
