"""Peers of ``moesaic bench layer`` (moesaic.bench.peers): the adapter logic without any peer
installed (against moesaic.reference as a stand-in peer), and each real peer's agreement with
its moesaic counterpart where it is installed (skipped cleanly where not)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util

import pytest
import torch

from moesaic import MoEConfig, MoELayer
from moesaic.bench import layer as bench_layer
from moesaic.bench.peer_names import INSTALL, check_names
from moesaic.bench.peers import PeerModule, compare, counterpart_config
from moesaic.comm.world import run_world
from moesaic.reference import ReferenceMoE

BASE = MoEConfig(hidden_size=32, ffn_hidden_size=64, num_experts=4, top_k=2)


def _layer(name: str, *, skewed: bool) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(counterpart_config(name, BASE, capacity_factor=1.0))
    if skewed:  # favour low expert ids: the capacity drops a good share of the assignments
        with torch.no_grad():
            layer.router.weight[:, 0] = -torch.arange(4.0)
    return layer


def _inputs(skewed: bool, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 32, generator=gen)
    if skewed:
        x[:, 0] = 1.0
    return x, torch.randn(64, 32, generator=gen)


def _reference_peer(layer: MoELayer) -> PeerModule:
    """moesaic.reference behind the peer interface: what an adapter of another library does."""
    ref = ReferenceMoE.from_full_state_dict(layer.config, layer.full_state_dict())
    return PeerModule(ref, lambda x: ref(x))


def _reference_grads(peer: PeerModule) -> dict[str, torch.Tensor]:
    return {n: peer.inner.get_parameter(f"experts.{n}").grad for n in ("w1", "w3", "w2")}


@pytest.mark.parametrize("name", ["torchtitan", "deepspeed"])
def test_compare_accepts_a_faithful_peer_and_catches_a_wrong_weight(name):
    # deepspeed's counterpart drops (capacity factor 1.0 on skewed routing) and renormalises.
    layer = _layer(name, skewed=True)
    x, g = _inputs(skewed=True)
    peer = _reference_peer(layer)
    good = compare(peer, layer, x, g, bench_layer._check_step, _reference_grads)
    assert good.worst < 1e-5, good
    with torch.no_grad():
        peer.inner.get_parameter("experts.w2")[1] *= 1.01
    bad = compare(peer, layer, x, g, bench_layer._check_step, _reference_grads)
    assert bad.max_rel_y > 1e-4 and bad.max_rel_dw > 1e-4, bad


def _shared_layer(*, gate: bool) -> MoELayer:
    torch.manual_seed(0)
    config = dataclasses.replace(
        BASE, num_shared_experts=2, shared_expert_hidden_size=24, shared_expert_gate=gate
    )
    return MoELayer(counterpart_config("torchtitan", config, capacity_factor=1.0))


def test_compare_covers_the_shared_experts():
    layer = _shared_layer(gate=True)
    twin = copy.deepcopy(layer)  # a stand-in peer holding the same weights
    peer = PeerModule(twin, lambda x: (twin(x), None))

    def grads(p: PeerModule) -> dict[str, torch.Tensor]:
        named = dict(p.inner.named_parameters())
        return {k: named[k if "." in k else f"experts.{k}"].grad for k in named_grads}

    named_grads = ("w1", "w3", "w2", *(f"shared_experts.{n}" for n in ("w1", "w3", "w2", "gate")))
    x, g = _inputs(skewed=False)
    assert compare(peer, layer, x, g, bench_layer._check_step, grads).worst == 0.0
    with torch.no_grad():
        twin.shared_experts.w2[3] *= 1.01
    bad = compare(peer, layer, x, g, bench_layer._check_step, grads)
    assert bad.max_rel_y > 1e-4 and bad.max_rel_dw > 1e-4, bad
    # A peer that does not give the shared experts' gradients is not taken as agreeing.
    with pytest.raises(KeyError, match="shared_experts"):
        compare(peer, layer, x, g, bench_layer._check_step, _reference_grads_of_twin)


def _reference_grads_of_twin(peer: PeerModule) -> dict[str, torch.Tensor]:
    return {n: peer.inner.get_parameter(f"experts.{n}").grad for n in ("w1", "w3", "w2")}


def test_bench_refuses_shared_experts_where_a_peer_has_none():
    with pytest.raises(ValueError, match="Mixtral"):
        bench_layer.LayerBench(num_shared_experts=1)
    with pytest.raises(ValueError, match="deepspeed"):
        bench_layer.LayerBench(num_shared_experts=1, with_transformers=False, peers=("deepspeed",))
    with pytest.raises(ValueError, match="num_shared_experts > 0"):
        bench_layer.LayerBench(shared_expert_hidden_size=64)
    bench = bench_layer.LayerBench(num_shared_experts=2, with_transformers=False)
    # The bound counts the shared experts' FLOPs: width K*F + S*Fs per token (here 2x).
    plain = bench_layer.LayerBench(with_transformers=False)
    assert bench_layer._expert_flops(bench, 10) == 2 * bench_layer._expert_flops(plain, 10)


def test_counterparts_match_the_peers_semantics():
    tt = counterpart_config("torchtitan", BASE, 1.25)
    assert (tt.dispatcher, tt.capacity_factor) == ("dropless", None)
    ds = counterpart_config("deepspeed", BASE, 1.25)
    assert (ds.dispatcher, ds.capacity_factor) == ("padded", 1.25)
    assert ds.renormalize_after_drop and ds.balance_loss_choices == "first"
    with pytest.raises(ValueError, match="peer"):
        counterpart_config("megablocks", BASE, 1.25)


def test_train_step_adds_the_peers_own_loss_terms():
    layer = _layer("torchtitan", skewed=False)
    ref = ReferenceMoE.from_full_state_dict(layer.config, layer.full_state_dict())
    peer = PeerModule(ref, lambda x: ref(x))  # (y, aux): aux goes into the loss
    x, g = _inputs(skewed=False)
    seen = []
    ref.get_parameter("router.weight").register_hook(lambda grad: seen.append(grad))
    bench_layer._train_step(peer, x, g)  # loss = output term + the peer's aux loss
    bench_layer._check_step(peer, x, g)  # the output term alone
    # The router weight's gradient differs by d(aux)/dW: the aux loss was in the timed loss.
    assert len(seen) == 2 and not torch.allclose(seen[0], seen[1])
    assert peer.loss_terms() is None  # each forward's terms are taken once


def test_unknown_and_missing_peers_are_refused_with_the_install_line(monkeypatch):
    with pytest.raises(ValueError, match="peer"):
        check_names(("dropless",), ("megablocks",))
    with pytest.raises(ValueError, match="strategy"):
        check_names(("nope",), ())
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real(n, *a)
    )
    with pytest.raises(ValueError, match="not installed") as err:
        check_names(("dropless",), ("deepspeed",))
    assert INSTALL["deepspeed"][1] in str(err.value)


def test_bench_config_refuses_unknown_strategies_and_peers():
    with pytest.raises(ValueError, match="strategies"):
        bench_layer.LayerBench(strategies=("dropless", "nope"))
    with pytest.raises(ValueError, match="peers"):
        bench_layer.LayerBench(peers=("megablocks",))
    with pytest.raises(ValueError, match="capacity_factor"):
        bench_layer.LayerBench(capacity_factor=0)


# ---- the real peers, where installed -------------------------------------------------------


def _needs(peer: str):
    module = INSTALL[peer][0]
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None, reason=f"{peer} not installed"
    )


def _check_real_peer(rank: int, world: int, name: str, skewed: bool) -> float:
    from moesaic.bench.peers import build_peer

    layer = _layer(name, skewed=skewed)
    peer = build_peer(name, layer, capacity_factor=1.0)
    x, g = _inputs(skewed, rank)
    return compare(peer, layer, x, g, bench_layer._check_step).worst


@_needs("torchtitan")
@pytest.mark.parametrize("skewed", [False, True])
def test_torchtitan_agrees_with_dropless(skewed):
    assert _check_real_peer(0, 1, "torchtitan", skewed) < 1e-5


def _check_shared_peer(rank: int, world: int, gate: bool) -> tuple[float, float]:
    """torchtitan with shared experts vs ours: worst error as built, and with one shared
    weight of torchtitan's changed by 1% (which the check must see)."""
    from moesaic.bench.peers import build_peer

    layer = _shared_layer(gate=gate)
    peer = build_peer("torchtitan", layer)
    x, g = _inputs(True, rank)
    good = compare(peer, layer, x, g, bench_layer._check_step).worst
    with torch.no_grad():
        peer.inner.shared_experts.w1.weight[5] *= 1.01
    bad = compare(peer, layer, x, g, bench_layer._check_step)
    return good, min(bad.max_rel_y, bad.max_rel_dw)


@_needs("torchtitan")
@pytest.mark.parametrize("gate", [False, True])
def test_torchtitan_with_shared_experts_agrees_with_dropless(gate):
    good, bad = _check_shared_peer(0, 1, gate)
    assert good < 1e-5 and bad > 1e-4, (good, bad)


@_needs("torchtitan")
def test_torchtitan_with_shared_experts_agrees_at_ep2():
    results = run_world(_check_shared_peer, 2, True, timeout_s=180)
    assert all(good < 1e-5 and bad > 1e-4 for good, bad in results), results


@_needs("deepspeed")
@pytest.mark.parametrize("skewed", [False, True])
def test_deepspeed_agrees_with_padded_at_its_capacity(skewed):
    assert _check_real_peer(0, 1, "deepspeed", skewed) < 1e-5


@pytest.mark.parametrize("name", [pytest.param(p, marks=_needs(p)) for p in INSTALL])
def test_peer_agrees_at_ep2(name):
    worst = run_world(_check_real_peer, 2, name, True, timeout_s=180)
    assert max(worst) < 1e-5, worst


def test_cli_refuses_an_unknown_peer_in_one_line(tmp_path, capsys):
    from moesaic.cli import main

    assert main(["bench", "layer", "--peers", "megablocks", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "megablocks" in err
    assert list(tmp_path.iterdir()) == []


@_needs("torchtitan")
@_needs("deepspeed")
def test_cli_times_the_peers_beside_their_counterparts(tmp_path):
    import json

    from moesaic.cli import main

    tiny = ["--hidden", "16", "--ffn", "32", "--experts", "4", "--tokens", "32", "--iters", "1"]
    tiny += ["--warmup", "0", "--ep", "1", "--no-transformers", "--strategies", "dropless"]
    out = tmp_path / "r.json"
    assert (
        main(["bench", "layer", *tiny, "--peers", "torchtitan,deepspeed", "--out", str(out)]) == 0
    )
    rows = {(r["impl"], r["routing"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {
        (impl, routing)
        for impl in ("dropless", "torchtitan", "padded-cf1.25", "deepspeed")
        for routing in ("uniform", "skewed")
    }
    for routing in ("uniform", "skewed"):
        assert rows[("torchtitan", routing)]["check"]["counterpart"] == "dropless"
        assert rows[("deepspeed", routing)]["check"]["counterpart"] == "padded-cf1.25"
        assert "speedup_vs_torchtitan" in rows[("dropless", routing)]
        assert "speedup_vs_deepspeed" in rows[("padded-cf1.25", routing)]


def test_speedups_are_peer_over_counterpart_median_and_paired_per_round():
    def row(impl, rounds):
        ordered = sorted(rounds)
        return {
            "ep": 2,
            "impl": impl,
            "routing": "skewed",
            "step": {"median_ms": ordered[len(ordered) // 2], "round_ms": rounds},
        }

    # Per round 1.5x, 6x, 1.5x: the paired median is 1.5; the ratio of medians (60 / 10) is not.
    rows = [row("dropless", [10.0, 10.0, 40.0]), row("torchtitan", [15.0, 60.0, 60.0])]
    bench_layer._add_ratios(rows, bench_layer.LayerBench(peers=("torchtitan",)))
    ours = rows[0]
    assert ours["speedup_vs_torchtitan"] == pytest.approx(60.0 / 10.0)
    assert ours["paired_speedup_vs_torchtitan"] == pytest.approx(1.5)
    assert "speedup_vs_torchtitan" not in rows[1]


@_needs("deepspeed")
@pytest.mark.parametrize("ep", [1, 2])
def test_a_peer_that_disagrees_is_not_timed_and_no_rank_hangs(ep):
    from moesaic.comm.world import WorkerError

    bench = bench_layer.LayerBench(
        hidden_size=16,
        ffn_hidden_size=32,
        num_experts=4,
        tokens_per_rank=32,
        ep_sizes=(ep,),
        iters=1,
        warmup=0,
        strategies=("dropless",),
        peers=("deepspeed",),
        with_transformers=False,
        check_tolerance=1e-30,  # any rounding difference in any gradient is a disagreement
    )
    with pytest.raises((RuntimeError, WorkerError), match="disagrees"):
        bench_layer.run(bench)
