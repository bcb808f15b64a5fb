"""Ranks that were given different configurations are stopped before any collective uses them."""

from __future__ import annotations

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


def test_equal_fields_pass():
    fields = {"num_experts": 8, "dtype": "torch.float32", "lr": 1e-3}
    assert run_world(_agree, 3, [fields] * 3) == ["ok"] * 3


def test_first_differing_field_and_ranks_are_named():
    base = {"num_experts": 8, "ffn_hidden_size": 64, "lr": 1e-3}
    other = {**base, "ffn_hidden_size": 32, "lr": 2e-3}
    out = run_world(_agree, 3, [base, base, other])
    for msg in out:
        assert "field 'ffn_hidden_size' differs" in msg  # the first differing field, not lr
        assert "ranks [0, 1] vs ranks [2]" in msg


def test_different_field_sets_are_refused():
    out = run_world(_agree, 2, [{"a": 1}, {"a": 1, "b": 2}])
    assert all("different sets of fields" in msg for msg in out)


def test_single_process_is_a_no_op():
    check_ranks_agree({"a": 1})  # no process group: nothing to compare, returns
