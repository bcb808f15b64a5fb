"""Remote puts through torch's symmetric memory on CUDA (``moesaic.comm.symmetric``), in a
one-GPU world: the device primitives that the CPU tests (``tests/comm/test_symmetric_put.py``)
replace with host stand-ins.

* A self-put: ``symm_mem.empty`` + ``rendezvous`` windows, origin-encoded tiles copied into the
  window through the peer mapping (``get_buffer``) on the put stream, their events signalled
  with ``stream_write_value32`` and seen by the Subscriber, over two steps; a 4 MB tile whose
  event must not fire before its last element landed.
* The ``taskflow`` layer at EP 1 with ``transport="symmetric"`` (its windows in symmetric
  memory, the step fence on the device) against ``dropless``: output and gradients.

Skipped without CUDA. Passed in the GPU sessions (one H200, one H100: a world of one; puts
between two GPUs have not run).
"""

from __future__ import annotations

import functools

import torch
from _gpu_helpers import NEEDS_CUDA, RTOL, attempt, device_of, value_or_fail

from moesaic.comm.world import run_world

pytestmark = NEEDS_CUDA
N = 16
BIG = 1 << 20  # fp32 elements of the large tile (4 MB)


def _tile(src: int, j: int, n: int = N) -> torch.Tensor:
    return src * 1000.0 + j * 10.0 + torch.arange(n, dtype=torch.float32) / 64


def _self_put(device: torch.device) -> dict:
    from moesaic.comm.collectives import EPGroup
    from moesaic.comm.counters import EventCounters
    from moesaic.comm.symmetric import CudaSymmetricMemory, SymmetricMemoryChannel

    group = EPGroup(None, 60.0)
    channel = SymmetricMemoryChannel(group, 60.0)
    assert isinstance(channel.primitives, CudaSymmetricMemory)
    window = channel.window(4 * N + BIG, torch.float32, device, num_events=4)
    out: dict = {"counts": [], "windows": []}
    for step in range(2):
        counters = EventCounters(4)
        channel.begin(window, counters, expected=4)
        channel.put(_tile(step, 0).to(device), 0, 0, (0,))
        channel.put(_tile(step, 1).to(device), 0, 2 * N, (0, 2))
        channel.put(torch.empty(0, device=device), 0, 0, (1,))  # a pure signal
        channel.put(_tile(step, 2, BIG).to(device), 0, 4 * N, (3,))
        counters.wait(3, 1, 60.0)
        big_ok = torch.equal(window[4 * N :].cpu(), _tile(step, 2, BIG))  # data before signal
        channel.finish()
        out["counts"].append([counters.count(j) for j in range(4)])
        out["windows"].append(window[: 4 * N].cpu())
        out.setdefault("big", []).append(big_ok)
    return out


def _layer_vs_dropless(device: torch.device) -> dict:
    from moesaic import MoEConfig, MoELayer
    from moesaic.comm.symmetric import SymmetricMemoryChannel
    from moesaic.taskflow.runtime.concurrent import TaskflowRuntime

    H, F, E = 32, 48, 8
    layers, grads = {}, {}
    for dispatcher in ("dropless", "taskflow"):
        torch.manual_seed(1)
        cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, dispatcher=dispatcher)
        layers[dispatcher] = MoELayer(cfg).to(device)
    layers["taskflow"].load_state_dict(layers["dropless"].state_dict())
    strategy = layers["taskflow"].strategy
    strategy.runtime = TaskflowRuntime(
        layers["taskflow"].ep, tile_m=8, timeout_s=60.0, transport="symmetric"
    )
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(2)).to(device)
    g = torch.randn(40, H, generator=torch.Generator().manual_seed(3)).to(device)
    for name, layer in layers.items():
        xi = x.clone().requires_grad_()
        for _ in range(2):  # the second step reuses the bucket's windows
            layer.zero_grad()
            xi.grad = None
            y = layer(xi)
            (y * g).sum().backward()
        grads[name] = [y.detach().cpu(), xi.grad.cpu()] + [
            p.grad.cpu() for p in layer.experts.parameters()
        ]
    rt = strategy.runtime
    assert isinstance(rt.channel, SymmetricMemoryChannel), type(rt.channel)
    return {
        "close": [
            torch.allclose(a, b, rtol=RTOL, atol=1e-5)
            for a, b in zip(grads["taskflow"], grads["dropless"])
        ],
        "window_bytes": rt.channel.window_bytes(),
    }


def symmetric_world(rank: int, world: int) -> dict:
    device = device_of("cuda")
    return {"self_put": attempt(_self_put, device), "layer": attempt(_layer_vs_dropless, device)}


@functools.cache
def _results() -> dict:
    (out,) = run_world(symmetric_world, 1, device="cuda", backend="auto", timeout_s=300)
    return out


def test_self_put_lands_and_signals_through_symmetric_memory():
    got = value_or_fail(_results()["self_put"], "self-put")
    for step in range(2):
        assert got["counts"][step] == [2, 1, 1, 1]
        want = torch.cat([_tile(step, 0), torch.zeros(N), _tile(step, 1), torch.zeros(N)])
        assert torch.equal(got["windows"][step], want), step
        assert got["big"][step], f"step {step}: the 4 MB tile's event fired before its data"


def test_taskflow_layer_on_symmetric_memory_matches_dropless():
    got = value_or_fail(_results()["layer"], "taskflow on symmetric memory")
    assert all(got["close"]), got["close"]  # y, x.grad, then each expert weight's grad
    assert got["window_bytes"] > 0
