"""``moesaic taskflow show | compile | check``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moesaic.cli import main

SHAPE = ["--experts", "8", "--tokens", "16", "--hidden", "32", "--ffn", "64", "--topk", "2",
         "--tile-m", "4"]  # fmt: skip


def test_show_prints_queues_events_and_draws(tmp_path, capsys):
    png = tmp_path / "plan.png"
    rc = main(["taskflow", "show", *SHAPE, "--ep", "2", "--rank", "1", "--backward",
               "--png", str(png), "--limit", "5"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "taskflow backward plan, rank 1 of EP 2" in out
    assert "matrix queue (24 tasks, first 5)" in out and "vector queue (32 tasks" in out
    # balanced slot rows: ceil(16 * 2 / 8) = 4; w-grads wait on P*S/tile = 2 tiles, the
    # reduce on E*S/tile = 8 returned tiles.
    assert "thresholds: 1 x32, 2 x8, 8 x1" in out
    assert "gmm_w2_grad" in out and "-> rank 0" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compile_then_check_a_world(tmp_path, capsys):
    assert main(["taskflow", "compile", *SHAPE, "--ep", "2", "--out", str(tmp_path)]) == 0
    files = sorted(str(p) for p in tmp_path.glob("plan-forward-*.json"))
    assert len(files) == 2
    capsys.readouterr()
    assert main(["taskflow", "check", *files]) == 0
    assert "cross-rank check (forward): ok, ranks 0-1" in capsys.readouterr().out
    d = json.loads(Path(files[0]).read_text())
    d["events"][0]["threshold"] += 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    assert main(["taskflow", "check", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "threshold" in err  # one clear line


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--ep", "3"], "divisible by the expert-parallel size"),
        (["--ep", "2", "--rank", "2"], r"rank \(2\) must be in \[0, ep=2\)"),
        (["--unsplit", "gmm7"], "unknown operators"),
    ],
)
def test_user_errors_are_one_line_exit_2(capsys, extra, match):
    import re

    assert main(["taskflow", "show", *SHAPE, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and re.search(match, err)
