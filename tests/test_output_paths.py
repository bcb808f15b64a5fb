"""Every output path is checked before any work starts (issue 25 item 3).

Before: ``train --trace``/``--trace-png`` onto a directory or into a read-only one trained the
whole run, then exited 2 without its summary; ``calibrate --out`` into a read-only or missing
directory measured (19 s on an emulated cluster), then lost the result. Now one rule,
``moesaic.checks.check_output_file``: missing parents are created, a directory, a file as a
parent and an unwritable place are refused, naming the option, before the work.
"""

from __future__ import annotations

import errno
import tempfile
from pathlib import Path

import pytest

from moesaic.checks import check_output_file
from moesaic.cli import main


def _file_in(d: Path) -> Path:
    (d / "f").write_text("x")
    return d / "f"


def test_missing_parents_are_created(tmp_path):
    out = check_output_file("--out", tmp_path / "a" / "b" / "p.json")
    assert out.parent.is_dir() and not out.exists()
    assert not list(out.parent.iterdir())  # the probe left nothing behind


@pytest.mark.parametrize(
    ("make", "rule"),
    [
        (lambda d: d, "is a directory"),
        (lambda d: _file_in(d) / "p.json", "is not a directory"),
    ],
    ids=["a directory", "a file as parent"],
)
def test_bad_places_are_refused(tmp_path, make, rule):
    with pytest.raises(ValueError, match=rf"--trace \(.*\).*{rule}"):
        check_output_file("--trace", make(tmp_path))


def test_unwritable_place_is_refused(tmp_path, monkeypatch):
    # Root writes through chmod: make the probe file itself fail, as a read-only mount does.
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    with pytest.raises(ValueError, match=r"--out \(.*\) cannot be written: Read-only file system"):
        check_output_file("--out", tmp_path / "p.json")


def test_calibrate_refuses_a_bad_out_before_measuring(tmp_path, capsys, monkeypatch):
    import moesaic.measure.machine as machine

    def measured(*_args, **_kwargs):
        raise AssertionError("the measurement ran before --out was checked")

    monkeypatch.setattr(machine, "measure", measured)
    assert main(["calibrate", "--out", str(tmp_path)]) == 2
    assert f"--out ({tmp_path}) is a directory" in capsys.readouterr().err


def test_train_refuses_a_trace_onto_a_directory_before_training(tmp_path, capfd):
    data = tmp_path / "data.txt"
    data.write_bytes(b"def f(x):\n    return x\n" * 200)
    run = tmp_path / "run"
    args = ["train", "--data", str(data), "--run-dir", str(run), "--trace", str(tmp_path)]
    assert main([*args, "--steps", "2", "--no-progress"]) == 2
    err = capfd.readouterr().err
    assert f"--trace ({tmp_path}) is a directory" in err, err
    assert not (run / "metrics.jsonl").exists()  # nothing trained


def test_bench_out_under_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    code = main(["bench", "layer", "--quick", "--out", str(Path(tmp_path / "f" / "r.json"))])
    assert code == 2 and "is not a directory" in capsys.readouterr().err
