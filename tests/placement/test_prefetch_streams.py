"""HybridEP's prefetch on the stream path (issue 49 item 1), run on CPU through the stand-in
streams of ``comm.streams``.

On NCCL the prefetcher enqueues its gathers from the calling thread (the optimizer's post-hook)
on a side stream (``ExpertPrefetcher._run_on_stream``). It used to switch autograd off with
``torch.set_grad_enabled(False)`` there, which on the main thread left it off: under ``vanilla``
the second step's backward raised, under the pipelined schedules the expert gradients were
silently missing. On gloo it ran on a worker thread, where the switch is thread-local and
harmless, so no CPU test saw it. Here ``HostStreams`` makes the prefetcher take the stream path
on a gloo world, and three optimizer steps must equal the thread path's, gradients present.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from moesaic.comm.streams import HostStreams
from moesaic.comm.world import run_world
from moesaic.models import MoEGPT, MoEGPTConfig
from moesaic.schedule.base import StepParts
from moesaic.schedule.flowmoe import FlowMoEStep
from moesaic.schedule.vanilla import VanillaStep
from moesaic.strategies.prefetch import ExpertPrefetcher
from moesaic.trace import Recorder

WORLD, B, T, STEPS = 2, 4, 8, 3
SCHEDULES = {"vanilla": (VanillaStep, 1), "flowmoe": (FlowMoEStep, 2)}


def test_prefetch_queues_leave_grad_mode_on_on_the_calling_thread():
    """The queues run under a context: the caller's grad mode is what it was (3bca125 left it
    off, on any thread that ran them: the main thread on device streams)."""
    prefetcher = ExpertPrefetcher([])
    assert torch.is_grad_enabled()
    prefetcher._run([])
    assert torch.is_grad_enabled()
    prefetcher.close()


def _config(compression_ratio: float = 1.0) -> MoEGPTConfig:
    return MoEGPTConfig.from_dict(
        {
            "d_model": 16,
            "n_layers": 2,
            "dense_layers": 0,
            "n_heads": 2,
            "seq_len": T,
            "moe": {
                "num_experts": 4,
                "top_k": 2,
                "ffn_hidden_size": 16,
                "dispatcher": "hybrid",
                "options": {"domain_sizes": [2], "compression_ratio": compression_ratio},
            },
        }
    )


def _train(
    layout, schedule: str, streams: HostStreams | None, batches, rank, compression_ratio=1.0
) -> dict:
    from moesaic.train.parallel import GradientSync

    cls, R = SCHEDULES[schedule]
    torch.manual_seed(0)
    model = MoEGPT(_config(compression_ratio), ep_group=layout.ep_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads: list[dict] = []  # each step's gradients as the optimizer sees them

    def keep(_opt, _args, _kwargs) -> None:
        grads.append(
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        )

    optimizer.register_step_pre_hook(keep)
    prefetcher = ExpertPrefetcher(model, streams=streams).attach(optimizer)
    parts = StepParts(
        model=model,
        loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        grad_sync=GradientSync(layout),
        optimizer=optimizer,
        pipeline_degree=R,
        ar_chunk_bytes=4096,
        recorder=Recorder(rank),
    )
    step = cls(parts)
    out: dict = {"losses": [], "grads": [], "params": [], "grad_mode": []}
    for x_BT in batches:
        result = step.run(x_BT[:, :-1], x_BT[:, 1:])
        assert result.applied
        prefetcher.wait()
        out["grad_mode"].append(torch.is_grad_enabled())
        out["losses"].append(float(result.ce))
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    if hasattr(step, "close"):
        step.close()
    prefetcher.close()
    out["grads"] = grads
    out["log"] = [entry[:2] for entry in streams.log] if streams is not None else []
    out["record_stream"] = [e for e in streams.log if e[0] == "record_stream"] if streams else []
    return out


def _world(rank, world_size):
    from moesaic.train.parallel import build_layout

    layout = build_layout(WORLD, 60.0)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, 256, (B, T + 1), generator=gen) for _ in range(STEPS)]
    out = {}
    for schedule in SCHEDULES:
        for path in ("thread", "stream"):
            streams = HostStreams() if path == "stream" else None
            try:
                out[(schedule, path)] = _train(layout, schedule, streams, batches, rank)
            except RuntimeError as exc:  # 3bca125: "element 0 of tensors does not require grad"
                out[(schedule, path)] = {"error": str(exc).splitlines()[0]}
    out["compressed"] = _train(layout, "vanilla", HostStreams(), batches, rank, 4.0)
    return out


@functools.cache
def _results() -> list[dict]:
    return run_world(_world, WORLD, timeout_s=300.0)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_stream_path_trains_like_the_thread_path(schedule):
    """Three AdamW steps with the prefetch on the (stand-in) stream path: no error, grad mode
    on after every step, every parameter's gradient present and equal to the thread path's,
    and so the parameters (the same arithmetic in the same order: bitwise)."""
    for rank, results in enumerate(_results()):
        want, got = results[(schedule, "thread")], results[(schedule, "stream")]
        assert "error" not in want, want
        assert "error" not in got, f"rank {rank}: {got}"
        assert got["grad_mode"] == [True] * STEPS
        assert got["losses"] == want["losses"]
        for s in range(STEPS):
            for name, g in want["grads"][s].items():
                assert g is not None, (rank, s, name)
                assert got["grads"][s][name] is not None, f"rank {rank} step {s}: {name}"
                assert torch.equal(got["grads"][s][name], g), (rank, s, name)
            for name, p in want["params"][s].items():
                assert torch.equal(got["params"][s][name], p), (rank, s, name)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_stream_path_keeps_the_device_order(schedule):
    """Per optimizer step: the side stream waits for the main one (the update first), the
    gathers' ready event is recorded on the side stream, every gathered tensor is marked as
    used on the main stream, and each layer's forward makes the main stream wait for it."""
    for results in _results():
        log = results[(schedule, "stream")]["log"]
        assert log.count(("wait_stream", "side1")) == STEPS
        assert log.count(("record", "side1")) == STEPS
        # two hybrid layers, in every step's forward but the first (the last prefetch waits
        # for a step that does not come)
        assert log.count(("wait_event", "main")) == 2 * (STEPS - 1)
        assert log.count(("record_stream", "main")) >= 2 * 3 * STEPS  # w1, w2, w3 per layer
        first = log.index(("wait_stream", "side1"))
        assert log.index(("record", "side1")) > first
        assert log.index(("wait_event", "main")) > log.index(("record", "side1"))


def test_compressed_gathers_mark_their_shared_experts_for_the_main_stream():
    """A compressed gather's shared experts (made on the side stream, kept to encode the next
    gathers) are marked as used on the main stream like the decoded experts (issue 49 item 9):
    per step and layer 3 decoded matrices and 3 shared experts, where 3bca125 marked 3."""
    for results in _results():
        marked = results["compressed"]["record_stream"]
        assert len(marked) == 2 * 6 * STEPS, marked  # two hybrid layers
        assert {stream for _, stream, _ in marked} == {"main"}
        # the shared experts: one expert's shape each ([H, F] or [F, H]), no expert dimension
        shared = [shape for *_, shape in marked if len(shape) == 2]
        assert len(shared) == 2 * 3 * STEPS, marked
