"""Ranks that were given different configurations are stopped before any collective uses them."""

from __future__ import annotations

import functools

from moesaic.comm.agree import RankMismatchError, check_ranks_agree, digest
from moesaic.comm.world import run_world


def _agree(rank: int, world: int, fields_per_rank: list[dict]) -> str:
    try:
        check_ranks_agree(fields_per_rank[rank], timeout_s=30, what="test config")
    except RankMismatchError as exc:
        return str(exc)
    return "ok"


def test_digest_is_stable_and_distinguishes():
    assert digest((1, "a")) == digest((1, "a"))
    assert digest(1) != digest(1.0)  # repr differs: an int is not a float here
    assert 0 <= digest("x") < 2**63


def _agree_each(rank: int, world: int, cases: list[list[dict]]) -> list[str]:
    return [_agree(rank, world, fields_per_rank) for fields_per_rank in cases]


FIELDS = {"num_experts": 8, "dtype": "torch.float32", "lr": 1e-3}
BASE = {"num_experts": 8, "ffn_hidden_size": 64, "lr": 1e-3}
OTHER = {**BASE, "ffn_hidden_size": 32, "lr": 2e-3}
# The 3-rank cases, one after the other in one spawned world (a spawn costs seconds).
CASES_3 = {"equal": [FIELDS] * 3, "differing": [BASE, BASE, OTHER]}


@functools.cache
def _world_of_3() -> dict[str, list[str]]:
    per_rank = run_world(_agree_each, 3, list(CASES_3.values()))
    return {name: [r[i] for r in per_rank] for i, name in enumerate(CASES_3)}


def test_equal_fields_pass():
    assert _world_of_3()["equal"] == ["ok"] * 3


def test_first_differing_field_and_ranks_are_named():
    out = _world_of_3()["differing"]
    for msg in out:
        assert "field 'ffn_hidden_size' differs" in msg  # the first differing field, not lr
        assert "ranks [0, 1] vs ranks [2]" in msg


def test_different_field_sets_are_refused():
    out = run_world(_agree, 2, [{"a": 1}, {"a": 1, "b": 2}])
    assert all("different sets of fields" in msg for msg in out)


def test_single_process_is_a_no_op():
    check_ranks_agree({"a": 1})  # no process group: nothing to compare, returns
