"""HybridEP's and the pipelined schedules' memory (issue 49 item 6).

* a gather lets go of its packed bundle and gathered message once its result is taken;
* a default expert domain never spans nodes;
* the gathered copies travel and compute in the experts' compute dtype (bf16 under bf16
  autocast, fp32 otherwise), and their gradients still match ``dropless``'s;
* the copies are keyed by an explicit count of optimizer steps: an optimizer that does not
  bump the weights' version counters (torch 2.13's foreach AdamW under a dispatch mode, the
  fused one always) no longer leaves hybrid computing on the old weights;
* the gradient reduce stages the bundle once (staging, receive buffer, sum: no copy per
  matrix);
* a pipelined step's R chunks share one cast of a layer's own experts.
"""

from __future__ import annotations

import functools
import types
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import moesaic
from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.comm.world import run_world
from moesaic.placement.topology import default_domain_sizes
from moesaic.strategies.hybrid import _GatheredExperts, hybrid_topology
from moesaic.strategies.hybrid_options import HybridOptions
from moesaic.strategies.migration import start_gather

H, F, E = 16, 24, 8


class _OneRank:
    """A level group of one rank that keeps a weak reference to every message it gathers
    and sends back what it is given (an all-to-all of one member)."""

    size = 1

    def __init__(self) -> None:
        self.messages: list[weakref.ref] = []

    def start_all_gather_dim0(self, t: torch.Tensor, what: str):
        out = t.clone()
        self.messages.append(weakref.ref(out))
        return out, lambda: None

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> None:
        out.copy_(inp)


def test_a_taken_gather_lets_go_of_its_message():
    """Before: the record of a consumed gather (kept with its statistics until the forward
    takes the prefetch) held the closure that held the gathered message and the packed
    bundle: 3.75 MiB per layer in benchmarks/step_memory.py's case."""
    group = _OneRank()
    weights = (torch.randn(2, H, F), torch.randn(2, H, F), torch.randn(2, F, H))
    pending = start_gather(weights, [group], 1.0)
    out = pending.result()
    assert all(torch.equal(o, w) for o, w in zip(out, weights))
    assert pending.finish is None and group.messages[0]() is None
    with pytest.raises(RuntimeError, match="already taken"):
        pending.result()


def test_a_gather_moves_the_dtype_it_is_given():
    group = _OneRank()
    weights = (torch.randn(2, H, F), None, torch.randn(2, F, H))
    out = start_gather(weights, [group], 1.0, dtype=torch.bfloat16).result()
    assert out[1] is None
    for o, w in zip((out[0], out[2]), (weights[0], weights[2])):
        assert o.dtype == torch.bfloat16 and torch.equal(o, w.to(torch.bfloat16))


def test_default_domains_stay_inside_a_node():
    """Without ``domain_sizes`` the domain is the innermost level (one node's ranks), not the
    whole group across nodes (before: (2, 4), every expert gathered over the slow links)."""
    assert default_domain_sizes((8,)) == (8,)
    assert default_domain_sizes((2, 4)) == (1, 4)
    assert default_domain_sizes((3, 2, 4)) == (1, 1, 4)
    spec = ClusterSpec(
        levels=(
            Level(name="node", size=2, bandwidth_gbps=1.0, latency_ms=1.0),
            Level(name="gpu", size=4, bandwidth_gbps=100.0, latency_ms=0.01),
        )
    )

    def ctx(domain_sizes):
        options = HybridOptions(domain_sizes=domain_sizes)
        config = types.SimpleNamespace(options_as=lambda cls: options)
        return types.SimpleNamespace(
            group=types.SimpleNamespace(size=8), topology=spec, config=config
        )

    assert hybrid_topology(ctx(None)).domain_sizes == (1, 4)
    assert hybrid_topology(ctx((2, 2))).domain_sizes == (2, 2)  # a user's stays


def test_gradient_reduce_stages_the_bundle_once():
    """The backward of the gathered copies allocates the staging buffer, the all-to-all's
    receive buffer and the sum, of which the gradients are views: before, the concatenated
    bundle, the receive buffer, the sum and a copy per matrix (its non-contiguous columns)."""
    e, S = 2, 2
    group = _OneRank()
    group.size = S  # every member sends what this rank sends
    local = [torch.randn(e, H, F, requires_grad=True), torch.randn(e, F, H, requires_grad=True)]
    gathered = [torch.randn(S * e, H, F), torch.randn(S * e, F, H)]
    used = _GatheredExperts.apply([group], "test", local[0], gathered[0], local[1], gathered[1])
    grads = [torch.randn_like(u) for u in used]
    bundle = sum(g.numel() * g.element_size() for g in grads)
    with _Allocated() as allocated:
        torch.autograd.backward(list(used), grads)
    assert allocated.bytes <= 2 * bundle + bundle // S, (allocated.bytes, bundle)
    for w, g in zip(local, grads):  # each member's rows summed (both members here: this one)
        torch.testing.assert_close(w.grad, g[:e] + g[e:], rtol=0, atol=0)


class _Allocated(TorchDispatchMode):
    """Bytes of the storages the ops inside return (each storage once)."""

    def __enter__(self):
        self.bytes, self._seen = 0, set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and func is not torch.ops.aten.view.default:
                st = t.untyped_storage()
                if st._cdata not in self._seen:
                    self._seen.add(st._cdata)
                    self.bytes += st.nbytes()
        return out


# ---- a pipelined step's chunks share one cast -------------------------------------------------


class _CopyPool:
    """The pipeline's all-to-alls at one rank: a copy."""

    def all_to_all(self, output, input, output_splits, input_splits, *, group, name, **args):
        output.copy_(input)
        return types.SimpleNamespace(wait=lambda: output)

    def end_all_to_alls(self):
        pass


class _Casts(TorchDispatchMode):
    """Casts (``_to_copy``) of the given tensors' storages."""

    def __init__(self, sources):
        super().__init__()
        self.sources = {t.untyped_storage()._cdata for t in sources}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage()._cdata in (
            self.sources
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _pipelined_bf16(share: bool, monkeypatch) -> tuple[int, dict]:
    from moesaic.models import MoEGPT, MoEGPTConfig
    from moesaic.schedule import pipeline

    if not share:  # each chunk casts for itself (before)
        monkeypatch.setattr(pipeline, "_cast_once", lambda experts: experts)
    moe = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32}
    cfg = MoEGPTConfig.from_dict(
        {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 8, "moe": moe}
    )
    torch.manual_seed(0)
    model = MoEGPT(cfg)
    model.set_autocast(torch.bfloat16)
    experts = [layer.experts for _, layer in model.moe_layers()]
    weights = [w for x in experts for w in (x.w1, x.w3, x.w2)]
    x_BT = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(1))
    pipe = pipeline.BlockPipeline(model, degree=2, overlap_attention=True)

    def loss(logits, y):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    with _Casts(weights) as casts:
        pipe.run(x_BT[:, :-1], x_BT[:, 1:], loss, _CopyPool())
    return casts.count, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_pipelined_chunks_share_one_cast_of_the_experts(monkeypatch):
    """R = 2 chunks under bf16 autocast: one bf16 cast of each expert weight per step (before:
    one per chunk, each kept for its chunk's backward), the gradients bitwise the same."""
    if moesaic.experts.expert_compute_dtype(torch.device("cpu"), torch.bfloat16) != torch.bfloat16:
        pytest.skip("this CPU computes bf16 experts in fp32 (no cast to share)")
    shared, grads = _pipelined_bf16(True, monkeypatch)
    with monkeypatch.context() as m:
        per_chunk, want = _pipelined_bf16(False, m)
    assert (shared, per_chunk) == (2 * 3, 2 * 2 * 3)  # 2 layers x 3 weights (x 2 chunks)
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)


# ---- two ranks: the compute dtype, and the optimizer-step count ------------------------------


class _NoOp(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _layer(dispatcher: str) -> moesaic.MoELayer:
    options = {"domain_sizes": (2,)} if dispatcher == "hybrid" else None
    cfg = moesaic.MoEConfig(
        hidden_size=H,
        ffn_hidden_size=F,
        num_experts=E,
        init_std=0.5,
        dispatcher=dispatcher,
        options=options,
    )
    torch.manual_seed(4321)
    return moesaic.MoELayer(cfg)


def _grads(layer, x, g, autocast: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    ((y.float() * g).sum() + moesaic.aux_loss(layer)).backward()
    out = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out


def _dtype_and_steps(rank: int, world: int) -> dict:
    from moesaic.strategies.prefetch import ExpertPrefetcher

    out: dict = {}
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(rank))
    g = torch.randn(12, H, generator=torch.Generator().manual_seed(10 + rank))
    for autocast in (False, True):
        hybrid, dropless = _layer("hybrid"), _layer("dropless")
        got, want = _grads(hybrid, x, g, autocast), _grads(dropless, x, g, autocast)
        cached = hybrid.strategy._cache[1]
        out[autocast] = {
            "cached": [t.dtype for t in cached if t is not None],
            "grads": {n: t.dtype for n, t in got.items()},
            "err": max(float((got[n] - want[n]).abs().max()) for n in want),
            "scale": max(float(want[n].abs().max()) for n in want),
        }
    # foreach AdamW under a dispatch mode leaves the versions alone: the count must not
    layer = _layer("hybrid")
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, foreach=True)
    with ExpertPrefetcher([(layer.strategy, layer.experts)]) as prefetcher:
        prefetcher.attach(optimizer)
        for _ in range(2):
            ((layer(x) * g).sum() + moesaic.aux_loss(layer)).backward()
            with _NoOp():
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            prefetcher.wait()
        with torch.no_grad():
            got = layer(x)
            layer.strategy._cache = None
            layer.strategy._pending = None
            want = layer(x)  # gathered now, from the current weights
    out["stale"] = float((got - want).abs().max())
    dist.barrier()
    return out


@functools.cache
def _two_ranks() -> list[dict]:
    return run_world(_dtype_and_steps, 2, timeout_s=120)


def test_gathered_copies_in_the_compute_dtype():
    """bf16 autocast: the copies are bf16 (half the bytes gathered and held), the weights'
    gradients fp32 and as close to dropless's as bf16 compute allows (before: fp32 copies);
    fp32: fp32 copies, the gradients dropless's to fp32 summation order."""
    if moesaic.experts.expert_compute_dtype(torch.device("cpu"), torch.bfloat16) != torch.bfloat16:
        pytest.skip("this CPU computes bf16 experts in fp32")
    for r in _two_ranks():
        assert set(r[True]["cached"]) == {torch.bfloat16}, r[True]
        assert set(r[False]["cached"]) == {torch.float32}, r[False]
        for case in (r[True], r[False]):
            assert set(case["grads"].values()) == {torch.float32}
        assert r[False]["err"] <= 1e-5 * r[False]["scale"], r[False]
        # bf16 rounding of inputs and outputs (8 bits of mantissa: 2^-8 relative)
        assert r[True]["err"] <= 2**-6 * r[True]["scale"], r[True]


def test_copies_follow_optimizer_steps_not_version_counters():
    """foreach AdamW under a dispatch mode does not bump the versions: before, the prefetcher
    reserved nothing and the forward reused the first step's copies (stale output)."""
    for r in _two_ranks():
        assert r["stale"] == 0.0, r
