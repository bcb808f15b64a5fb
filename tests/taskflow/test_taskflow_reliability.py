"""``taskflow check`` refuses files of different worlds and says which checks ran; ``show`` and
``compile`` refuse absurd sizes before building anything; old plan files are refused by name."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from moesaic.cli import main

SHAPE = ["--experts", "8", "--tokens", "16", "--hidden", "32", "--ffn", "64", "--topk", "2",
         "--tile-m", "4"]  # fmt: skip


def _compile(out: Path, *extra: str) -> list[str]:
    assert main(["taskflow", "compile", *SHAPE, "--ep", "2", "--out", str(out), *extra]) == 0
    return sorted(str(p) for p in out.glob("plan-*.json"))


def test_check_refuses_ranks_of_different_worlds(tmp_path, capsys):
    # Rank 0 from a world compiled with RATR, rank 1 from one compiled with --no-ratr: each
    # file is a valid plan, but they do not belong together. This used to print "ok" for both
    # and silently skip the cross-rank check.
    a = _compile(tmp_path / "a")
    b = _compile(tmp_path / "b", "--no-ratr")
    capsys.readouterr()
    assert main(["taskflow", "check", a[0], b[1]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "different worlds" in err and "ratr" in err
    assert Path(a[0]).name in err and Path(b[1]).name in err


def test_check_says_which_checks_ran(tmp_path, capsys):
    files = _compile(tmp_path)
    capsys.readouterr()
    assert main(["taskflow", "check", files[0]]) == 0
    out = capsys.readouterr().out
    assert "per-plan checks: 1 file ok" in out
    assert re.search(r"cross-rank check \(forward\): NOT run, rank 1 of 2 missing", out)
    assert main(["taskflow", "check", *files]) == 0
    out = capsys.readouterr().out
    assert "per-plan checks: 2 files ok" in out
    assert "cross-rank check (forward): ok, ranks 0-1" in out


def test_check_refuses_a_rank_given_twice(tmp_path, capsys):
    files = _compile(tmp_path)
    capsys.readouterr()
    assert main(["taskflow", "check", files[0], files[0], files[1]]) == 2
    err = capsys.readouterr().err
    assert "rank 0" in err and "twice" in err


@pytest.mark.parametrize("command", ["show", "compile"])
def test_absurd_sizes_are_refused_before_building(tmp_path, capsys, command):
    argv = ["taskflow", command, "--experts", "8", "--tokens", "1000000000", "--hidden", "32",
            "--ffn", "64", "--topk", "2", "--tile-m", "1"]  # fmt: skip
    if command == "compile":
        argv += ["--out", str(tmp_path)]
    t0 = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - t0 < 5.0  # refused from an estimate, nothing was built
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "--max-tasks" in err and "--tile-m" in err and "--tokens" in err
    assert re.search(r"about [\d.]+e\+\d+ tasks", err)  # the estimate, ~1e10


def test_max_tasks_is_an_explicit_override(capsys):
    # 44 tasks (8 dispatch + 4 x 8 row tiles + 4 token tiles): refused under a limit of 40,
    # built when the limit is raised to exactly its size.
    assert main(["taskflow", "show", *SHAPE, "--max-tasks", "40"]) == 2
    assert "about 44 tasks" in capsys.readouterr().err
    assert main(["taskflow", "show", *SHAPE, "--max-tasks", "44"]) == 0


def test_old_plan_version_is_refused_naming_both_versions(tmp_path, capsys):
    files = _compile(tmp_path)
    d = json.loads(Path(files[0]).read_text())
    d["version"] = 1
    old = tmp_path / "old.json"
    old.write_text(json.dumps(d))
    capsys.readouterr()
    assert main(["taskflow", "check", str(old)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"version 1 .*this build reads version 2", err)
    assert "recompile" in err
