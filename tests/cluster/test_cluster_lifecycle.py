"""Owner records, liveness and ``cluster down``'s decisions, with the system calls faked (no root).

The real thing (namespaces, a live ``cluster up``, a SIGKILLed harness) is exercised in
test_cluster_netns.py; here every case of the decision runs in milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from moesaic.cluster import lifecycle, system
from moesaic.cluster.lifecycle import STATE_DIR_ENV, Owner, down, read_owner, register


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A private state dir and temp root, and namespaces/processes that live in a dict."""
    state, tmp = tmp_path / "state", tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv(STATE_DIR_ENV, str(state))
    world = {"namespaces": {}, "deleted": []}  # namespace -> pids inside

    def delete(names):
        world["deleted"] += list(names)
        for name in names:
            world["namespaces"].pop(name, None)

    monkeypatch.setattr(system, "require_support", lambda: None)
    monkeypatch.setattr(system, "list_namespaces", lambda: sorted(world["namespaces"]))
    monkeypatch.setattr(system, "namespace_pids", lambda ns: world["namespaces"].get(ns, []))
    monkeypatch.setattr(system, "delete_namespaces", delete)
    world["tmp"] = tmp
    return world


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _cluster(fake: dict, run_id: str, *, pid: int | None, pids_inside=(), tmpdir=True) -> Path:
    for ns in (f"msc-{run_id}-fab", f"msc-{run_id}-r0", f"msc-{run_id}-r1"):
        fake["namespaces"][ns] = list(pids_inside)
    path = fake["tmp"] / f"msc-{run_id}-q1w2e3r4"
    if tmpdir:
        path.mkdir()
        (path / "delayline.log").write_text("x")
    if pid is not None:
        owner = register(run_id, tmpdir=str(path))
        if pid != os.getpid():  # pretend another process wrote it
            data = json.loads((lifecycle.state_dir() / f"{run_id}.json").read_text())
            data.update(pid=pid, start_ticks=None)
            (lifecycle.state_dir() / f"{run_id}.json").write_text(json.dumps(data))
        assert owner.tmpdir == str(path)
    return path


def test_owner_liveness_checks_pid_and_start_time() -> None:
    me = Owner(run_id="abcdef", pid=os.getpid(), start_ticks=None, host="h", command="c", created=0)
    assert me.alive()
    ticks = lifecycle.process_start_ticks(os.getpid())
    assert ticks is not None and Owner(**{**_fields(me), "start_ticks": ticks}).alive()
    # the same pid started at another time is another process (pid reuse)
    assert not Owner(**{**_fields(me), "start_ticks": ticks + 1}).alive()
    assert not Owner(**{**_fields(me), "pid": _dead_pid()}).alive()


def _fields(owner: Owner) -> dict:
    return {f: getattr(owner, f) for f in Owner.__slots__}


def test_register_read_unregister(fake: dict) -> None:
    owner = register("a1b2c3", tmpdir="/tmp/msc-a1b2c3-xyz")
    assert read_owner("a1b2c3") == owner and owner.pid == os.getpid()
    lifecycle.unregister("a1b2c3")
    assert read_owner("a1b2c3") is None
    lifecycle.unregister("a1b2c3")  # idempotent


def test_unwritable_state_dir_says_how_to_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "file" / "state"))
    with pytest.raises(system.ClusterError, match=f"set {STATE_DIR_ENV} to a writable directory"):
        register("a1b2c3")


def test_down_by_run_id_keeps_a_live_cluster(fake: dict) -> None:
    tmpdir = _cluster(fake, "aaaaaa", pid=os.getpid())
    report = down("aaaaaa", tmp_root=fake["tmp"])
    assert report.removed_namespaces == [] and fake["deleted"] == [] and tmpdir.is_dir()
    why = report.kept["aaaaaa"]
    assert f"still up: owner pid {os.getpid()}" in why and "--run-id aaaaaa --force" in why
    assert report.lines()[-1].startswith("kept cluster aaaaaa: still up")
    # --force by name removes it, its temp dir and its record
    report = down("aaaaaa", force=True, tmp_root=fake["tmp"])
    assert len(report.removed_namespaces) == 3 and not tmpdir.exists()
    assert read_owner("aaaaaa") is None and fake["namespaces"] == {}


def test_down_without_run_id_removes_only_stale_clusters(fake: dict) -> None:
    live = _cluster(fake, "aaaaaa", pid=os.getpid())
    dead = _cluster(fake, "bbbbbb", pid=_dead_pid())
    # no record (an older moesaic) but a process inside: treated as live
    legacy_busy = _cluster(fake, "cccccc", pid=None, pids_inside=[os.getpid()])
    legacy_idle = _cluster(fake, "dddddd", pid=None)
    orphan_dir = fake["tmp"] / "msc-eeeeee-zzzzzzzz"  # a killed run's temp dir, nothing else
    orphan_dir.mkdir()
    report = down(tmp_root=fake["tmp"])
    assert sorted(report.kept) == ["aaaaaa", "cccccc"]
    assert "owner unknown and 3 process(es)" in report.kept["cccccc"]
    assert sorted({ns.split("-")[1] for ns in report.removed_namespaces}) == ["bbbbbb", "dddddd"]
    assert live.is_dir() and legacy_busy.is_dir()
    assert not dead.exists() and not legacy_idle.exists() and not orphan_dir.exists()
    assert read_owner("bbbbbb") is None and read_owner("aaaaaa") is not None
    assert "removed 3 temp dir(s)" in "\n".join(report.lines())


def test_a_record_never_makes_down_delete_a_foreign_path(fake: dict, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    register("ffffff", tmpdir=str(precious))  # a corrupt or hostile record
    data = json.loads((lifecycle.state_dir() / "ffffff.json").read_text())
    data.update(pid=_dead_pid(), start_ticks=None)
    (lifecycle.state_dir() / "ffffff.json").write_text(json.dumps(data))
    down("ffffff", tmp_root=fake["tmp"])
    assert precious.is_dir() and read_owner("ffffff") is None


def test_force_needs_a_run_id(fake: dict, capsys: pytest.CaptureFixture[str]) -> None:
    from moesaic.cli import main

    with pytest.raises(ValueError, match="force needs a run id"):
        down(force=True)
    assert main(["cluster", "down", "--force"]) == 2
    assert "--force needs --run-id" in capsys.readouterr().err
