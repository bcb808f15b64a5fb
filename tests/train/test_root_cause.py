"""The first real error wins, whichever rank the agent saw exit first (issue 25 item 4).

The agent reports only the workers it saw exit with an error: a rank that failed for a reason
of its own but was still tearing down when its peer's echo ("Connection closed by peer") ended
was stopped by the agent, and the launcher printed the peer's symptom (1 of 12 runs). The
launcher now also reads every rank's record of the last attempt from the agent's log directory.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from moesaic.train.errors import RECORD_KEY, pick_root_cause
from moesaic.train.launch import _last_attempt_records


def _write(root, attempt: int, rank: int, line: str, peer: bool, t: float) -> None:
    d = root / "moesaic-run" / f"attempt_{attempt}" / str(rank)
    d.mkdir(parents=True)
    record = {"line": line, "peer": peer, "rank": rank, "time": t}
    (d / "error.json").write_text(json.dumps({"message": line, RECORD_KEY: record}))


def test_the_cause_of_a_rank_the_agent_did_not_report_wins(tmp_path):
    _write(tmp_path, 0, 0, "rank 0: old attempt", False, 1.0)
    _write(tmp_path, 1, 0, "rank 0: metrics.jsonl: No space left on device", False, 10.0)
    _write(tmp_path, 1, 1, "rank 1: dispatch counts failed ... a peer died", True, 10.5)
    (tmp_path / "moesaic-run" / "attempt_1" / "2").mkdir()  # a rank that left no record
    # the agent saw only rank 1 exit
    echo = {"line": "rank 1: ... a peer died", "peer": True, "time": 10.5}
    reported = {1: SimpleNamespace(error_file_data={RECORD_KEY: echo}, timestamp=10)}
    assert pick_root_cause(reported)[0] == 1  # what the launcher printed before
    records = _last_attempt_records(str(tmp_path))
    assert sorted(records) == [0, 1]  # the last attempt's, not attempt 0's
    rank, line = pick_root_cause({**records, **reported})
    assert (rank, line) == (0, "rank 0: metrics.jsonl: No space left on device")


def test_no_log_dir_content_changes_nothing(tmp_path):
    assert _last_attempt_records(str(tmp_path)) == {}
