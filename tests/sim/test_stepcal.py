"""One rank's whole step (``moesaic.sim.stepcal``): the run that times it, its median, the
pieces it is priced against (``opcal.priced_step_s``), the rest the simulator charges once per
step, and the profile field. ``calibrate --model``'s real run of it is in test_measured_loads."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_opcal import MODEL, _cal, _spec

from moesaic.sim.opcal import OpPrices, priced_step_s
from moesaic.sim.profile import Profile
from moesaic.sim.simulate import SimOptions, simulate
from moesaic.sim.stepcal import median_step_s, step_config


def _job(**moe):
    from moesaic.train.config import TrainConfig

    return TrainConfig.from_dict(
        {
            "nproc": 4,
            "batch_size": 6,
            "steps": 600,
            "schedule": "flowmoe",
            "pipeline_degree": 2,
            "ckpt_every": 50,
            "threads": 3,
            "model": {
                "d_model": 32,
                "n_heads": 2,
                "moe": {"ffn_hidden_size": 64, "capacity_factor": 1.25, **moe},
            },
        }
    )


def test_the_step_run_is_one_ranks_share(tmp_path):
    """One rank's batch and experts (never fewer than top_k), dropless under vanilla, the
    given threads, none of the job's run options."""
    run = step_config(
        _job(num_experts=8, top_k=2), world=4, threads=1, steps=7, run_dir=tmp_path / "r"
    )
    assert (run.nproc, run.ep, run.batch_size, run.steps, run.threads) == (1, 1, 6, 7, 1)
    assert run.model.moe.num_experts == 2 and run.model.moe.dispatcher == "dropless"
    assert run.model.moe.capacity_factor is None and run.schedule == "vanilla"
    assert run.ckpt_every == 0 and not run.save_final and run.run_dir == str(tmp_path / "r")
    run = step_config(
        _job(num_experts=4, top_k=2), world=4, threads=2, steps=7, run_dir=tmp_path / "r"
    )
    assert run.model.moe.num_experts == 2 and run.threads == 2  # top_k experts at least


def test_median_step_is_tokens_over_the_rate_after_the_warm_up(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rates = [10.0, 1000.0, 500.0, 250.0, 400.0]  # tokens per second
    lines = [{"kind": "train", "step": i, "tokens_per_s": r} for i, r in enumerate(rates)]
    lines.insert(2, {"kind": "val", "step": 1, "val_loss": 1.0})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    # after the first 3: 1000/250 and 1000/400 s -> median 3.25 s
    assert median_step_s(path, 1000, skip=3) == pytest.approx(3.25)
    # too few: all of them (100, 1, 2, 4, 2.5 s)
    assert median_step_s(path, 1000, skip=9) == pytest.approx(2.5)
    path.write_text('{"kind": "val"}\n')
    with pytest.raises(ValueError, match="no train record with tokens_per_s"):
        median_step_s(path, 1000, skip=0)
    path.write_text("{oops\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: not JSON"):
        median_step_s(path, 1000, skip=0)
    with pytest.raises(ValueError, match="tokens_per_step"):
        median_step_s(path, 0, skip=0)


def test_the_priced_step_is_its_pieces_by_hand():
    """Per block the stage and the expert GEMMs of T x K rows both ways, the head both ways,
    the optimizer over the rank's parameters (test_opcal's fits: piece i costs (i+1) ms +
    (i+1) us per unit forward, 3(i+1) ms + 5(i+1) us backward)."""
    cal = _cal()  # MODEL: 2 blocks, 8 x 16 tokens, top-2, H 32, F 64, 2 experts per rank
    T, rows = 128, 256

    def both(i: int, n: int) -> float:
        return (i + 1) * (1e-3 + 1e-6 * n) + (i + 1) * (3e-3 + 5e-6 * n)

    block = both(0, T) + both(1, T) + both(2, rows)
    H, F, E = 32, 64, 4
    params = 2 * (4 * H * H + 4 * H + H * E) + (MODEL.vocab + 16) * H + 2 * H
    params += 2 * 2 * MODEL.mats * H * F
    want = 2 * block + both(3, T) + 2e-3 + 1e-9 * params * 4
    assert priced_step_s(cal) == pytest.approx(want)
    layer = dataclasses.replace(MODEL, layer_only=True)
    assert priced_step_s(dataclasses.replace(cal, model=layer)) == 0.0


def test_the_rest_is_the_step_beyond_its_pieces():
    cal = _cal()
    priced = priced_step_s(cal)
    assert OpPrices(cal, MODEL).rest_s == 0.0  # not timed
    timed = dataclasses.replace(cal, step_s=priced + 0.05)
    prices = OpPrices(timed, MODEL)
    assert prices.rest_s == pytest.approx(0.05) and prices.notes == []
    assert OpPrices(dataclasses.replace(cal, step_s=priced / 2), MODEL).rest_s == 0.0
    other = OpPrices(timed, dataclasses.replace(MODEL, batch=16))
    assert other.rest_s == pytest.approx(0.05)  # kept as measured, and said
    assert any("rest beyond its pieces (50 ms)" in n and "kept as is" in n for n in other.notes)


def test_the_profile_keeps_the_step_and_older_ones_load(tmp_path):
    p = Profile(flops_per_s=1e10, ops=dataclasses.replace(_cal(), step_s=0.25))
    assert Profile.load(p.save(tmp_path / "p.json")) == p
    data = json.loads(json.dumps(p.to_dict()))
    data["ops"].pop("step_s")
    assert Profile.from_dict(data).ops.step_s == 0.0  # a profile from before it
    data["ops"]["step_s"] = -1.0
    with pytest.raises(ValueError, match=r"ops\.step_s"):
        Profile.from_dict(data)


@pytest.mark.parametrize("schedule", ["vanilla", "moe-only", "flowmoe"])
def test_simulate_charges_the_rest_once_per_step(schedule):
    """The rest runs ahead of the step's compute: every schedule's step grows by it (no
    contention modelled here), and the task and its ms are in the result."""
    cal = _cal()
    opts = SimOptions(degree=2)
    plain = Profile(flops_per_s=1e12, ops=cal)
    before = simulate(_spec(2), MODEL, "dropless", plain, opts, schedule=schedule)
    timed = Profile(
        flops_per_s=1e12, ops=dataclasses.replace(cal, step_s=priced_step_s(cal) + 0.03)
    )
    after = simulate(_spec(2), MODEL, "dropless", timed, opts, schedule=schedule)
    assert after.iteration_s - before.iteration_s == pytest.approx(0.03)
    assert after.details["step_rest_ms"] == pytest.approx(30.0)
    assert "step_rest_ms" not in before.details
    rest = [s for s in after.spans if s.name == "step_rest"]
    assert len(rest) == 1 and rest[0].start == 0.0 and rest[0].duration == pytest.approx(0.03)
