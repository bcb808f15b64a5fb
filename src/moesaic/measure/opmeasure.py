"""Time a model's own operations on this machine into an :class:`~moesaic.sim.opcal.OpCal`
(``moesaic calibrate --model``).

The model is the real ``MoEGPT`` that ``moesaic train`` builds from the model (one process, no
process group: its MoE layer holds every expert and exchanges nothing). With ``threads`` torch
threads (training's per-rank count), every piece is timed forward and backward at two batch
sizes (a quarter of the model's batch and the whole, at least 1 and 2 sequences), ``repeats``
times after one warm-up, the median call: a training step pays every call, not the least
disturbed one (the fastest of five priced a step's compute 3-10% under the median on this
project's shared CPU machine, ``benchmarks/results/sim_unseen17_setup.json``; the simulator adds
the slowdown of the run's own CPU sharing, :mod:`moesaic.sim.contention`):

* ``attention``: block 0's ``attention_stage`` (its outputs' backward with fixed gradients);
* ``experts``: a ``GroupedExperts`` of ``expert_count`` experts on ``T K`` rows spread evenly
  (the rows a rank's experts get from every rank under uniform routing), fitted per row;
* ``moe_local``: block 0's ``expert_stage`` (router, permutation, the experts of all ``E`` at
  one rank, combine, residual) minus the same rows through all ``E`` experts' GEMMs;
* ``head``: ``MoEGPT.head`` and the cross-entropy;
* ``optimizer``: a step's tail, the gradients' squared norm (``moesaic.gradnorm``, as every
  schedule computes it for clipping) and ``torch.optim.AdamW.step``, over block 0's parameters
  and over the whole model's, fitted per parameter byte;
* ``reference_s`` (:func:`reference_s`): one forward and backward of block 0's attention stage,
  its expert stage and the head at the model's batch, the median of ``repeats``: the speed
  reference. A machine whose speed drifts (a shared VM's ran the same GEMM at 145-300 GFLOPS
  within a day) can time it again later and rescale the profile's compute
  (:mod:`moesaic.measure.retime`).

A tiny model takes about a second; the issue's H 160, F 1536, 8 x 64 tokens about five.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from moesaic.checks import check_positive_int
from moesaic.sim.model import ModelSpec, model_config_of
from moesaic.sim.opcal import OpCal, OpFit, fit_line

__all__ = ["DRAWS", "REFERENCE_REPEATS", "measure_ops", "reference_s"]

# Inputs drawn per size, each piece's time the mean over them (what a step pays on average):
# the expert stage's backward takes 32 or 53 ms on the same shape depending on the routing its
# random input gets (H 240, F 1080, E 28, 512 tokens: its GEMMs, ``aten::mm``, run at half
# speed on some draws, the same number of calls), so one draw made the ``moe_local`` fits'
# backward 0-27 ms per call on the unseen rules' models.
DRAWS = 4

# Calls of the speed reference after its warm-up, the median kept: with one thread its median
# varied by about 7% between calls a second apart here, with two threads (sharing the 2 cores
# with everything else) by up to 30%.
REFERENCE_REPEATS = 7


def _typical(fn: Callable[[], tuple[float, float]], repeats: int) -> tuple[float, float]:
    """The median forward and backward seconds of ``fn`` (which returns both) over ``repeats``
    calls after a warm-up: what a step pays per call on this machine as it runs."""
    fn()
    runs = [fn() for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def _timed(forward: Callable[[], Any], grads: Callable[[Any], Any]) -> tuple[float, float]:
    """One forward and its backward (``grads(out)``: the outputs' gradients), seconds each."""
    import torch

    t0 = time.perf_counter()
    out = forward()
    t1 = time.perf_counter()
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, grads(outs))
    return t1 - t0, time.perf_counter() - t1


def _even_counts(rows: int, experts: int) -> list[int]:
    base, extra = divmod(rows, experts)
    return [base + (1 if i < extra else 0) for i in range(experts)]


def measure_ops(
    model: ModelSpec, *, world: int = 1, threads: int = 1, repeats: int = 5, seed: int = 0
) -> OpCal:
    """Times ``model``'s pieces (module docstring). ``world``: the ranks its experts are spread
    over (``expert_count = experts / world``); ``threads``: torch threads (restored after)."""

    check_positive_int("world", world)
    check_positive_int("threads", threads)
    check_positive_int("repeats", repeats)
    if model.experts % world:
        raise ValueError(f"model.experts ({model.experts}) must be a multiple of world ({world})")
    # layer_only and routing skew change what a simulation runs, not the pieces' shapes
    shape = dataclasses.replace(model, layer_only=False, routing_skew=0.0)
    with _threads_and_seed(threads, seed):
        return _measure(model, shape, world, threads, repeats)


@contextlib.contextmanager
def _threads_and_seed(threads: int, seed: int) -> Iterator[None]:
    """Torch at ``threads`` threads (restored after) and ``seed`` (the caller's RNG state
    restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_num_threads(before)


def _measure(model: ModelSpec, shape: ModelSpec, world: int, threads: int, repeats: int) -> OpCal:
    from moesaic.experts import GroupedExperts
    from moesaic.models import MoEGPT

    cfg = model_config_of(shape)
    net = MoEGPT(cfg)
    block: Any = net.blocks[0]
    e_rank = shape.experts // world
    rank_experts = GroupedExperts(block.moe.config, range(e_rank))
    rank_experts.reset_parameters(0)
    S, K = shape.seq_len, shape.top_k
    lo = max(1, shape.batch // 4)
    sizes = (lo, max(shape.batch, lo + 1))  # sequences
    fwd: dict[str, list[float]] = {}
    bwd: dict[str, list[float]] = {}
    for b in sizes:
        draws = [_pieces_at(net, rank_experts, shape, b, repeats) for _ in range(DRAWS)]
        for name in draws[0]:
            fwd.setdefault(name, []).append(statistics.fmean(d[name][0] for d in draws))
            bwd.setdefault(name, []).append(statistics.fmean(d[name][1] for d in draws))
    tokens = (sizes[0] * S, sizes[1] * S)
    fits_f: dict[str, OpFit] = {}
    fits_b: dict[str, OpFit] = {}
    for table, out in ((fwd, fits_f), (bwd, fits_b)):
        local = [max(0.0, s - a) for s, a in zip(table["stage"], table["all"])]
        per_token = {"attention": table["attention"], "moe_local": local, "head": table["head"]}
        for name, (t1, t2) in per_token.items():
            out[name] = fit_line(tokens[0], t1, tokens[1], t2)
        out["experts"] = fit_line(
            tokens[0] * K, table["experts"][0], tokens[1] * K, table["experts"][1]
        )
    return OpCal(
        model=model,
        threads=threads,
        expert_count=e_rank,
        tokens=tokens,
        fwd=fits_f,
        bwd=fits_b,
        optimizer=_optimizer_fit(net, block, repeats),
        op_overhead_s=_op_overhead(repeats),
        reference_s=_reference(net, shape, REFERENCE_REPEATS),
    )


def reference_s(
    model: ModelSpec, *, threads: int = 1, repeats: int = REFERENCE_REPEATS, seed: int = 0
) -> float:
    """The speed reference of ``model`` (module docstring) on this machine now, seconds, with
    ``threads`` torch threads (restored after): what :func:`measure_ops` records as
    ``OpCal.reference_s``."""
    from moesaic.models import MoEGPT

    check_positive_int("threads", threads)
    check_positive_int("repeats", repeats)
    shape = dataclasses.replace(model, layer_only=False, routing_skew=0.0)
    with _threads_and_seed(threads, seed):
        return _reference(MoEGPT(model_config_of(shape)), shape, repeats)


def _reference(net: Any, shape: ModelSpec, repeats: int) -> float:
    """The median seconds of one forward and backward of block 0's attention stage, its expert
    stage and the head at ``shape.batch`` sequences (after one warm-up)."""
    import torch
    import torch.nn.functional as F

    block = net.blocks[0]
    x = torch.randn(shape.batch, shape.seq_len, shape.hidden, requires_grad=True)
    y = torch.randint(0, shape.vocab, (shape.batch, shape.seq_len))

    net.zero_grad(set_to_none=True)  # as a fresh model: the warm-up allocates, then accumulate

    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        out = block.expert_stage(*block.attention_stage(x))
        loss = F.cross_entropy(net.head(out).flatten(0, 1), y.flatten())
        block.moe.take_aux_terms()
        loss.backward()
        return time.perf_counter() - t0, 0.0

    return _typical(once, repeats)[0]


def _like(outs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Random output gradients, one per output."""
    import torch

    return tuple(torch.randn_like(o) for o in outs)


def _pieces_at(
    net: Any, rank_experts: Any, shape: ModelSpec, b: int, repeats: int
) -> dict[str, tuple[float, float]]:
    """Median forward and backward seconds of every piece at ``b`` sequences: ``attention``,
    ``stage`` (the whole expert stage), ``all`` (its rows through all E experts), ``experts``
    (through the rank's), ``head``."""
    import torch
    import torch.nn.functional as F

    block = net.blocks[0]
    moe = block.moe
    S, H, K = shape.seq_len, shape.hidden, shape.top_k
    x = torch.randn(b, S, H, requires_grad=True)
    h = torch.randn(b, S, H, requires_grad=True)
    rows = b * S * K
    # ``all`` runs the stage's own rows per expert (its router's on ``h``): the stage's GEMMs
    # on skewed groups cost other than on even ones, and with even counts that difference
    # landed in ``moe_local`` (backward fits of 0-27 ms per call, 0 per token, on the unseen
    # rules' models).
    with torch.no_grad():
        counts_all = [int(c) for c in moe.route(h).plan.counts_E.tolist()]
    moe.take_aux_terms()
    x_all = torch.randn(sum(counts_all), H, requires_grad=True)
    x_rank = torch.randn(rows, H, requires_grad=True)
    counts_rank = _even_counts(rows, rank_experts.num_local_experts)
    y = torch.randint(0, shape.vocab, (b, S))

    def stage() -> Any:
        out = block.expert_stage(x, h)
        moe.take_aux_terms()  # the pending aux terms would grow with every call
        return out

    def head() -> Any:
        return F.cross_entropy(net.head(x).flatten(0, 1), y.flatten())

    pieces: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
        "attention": (lambda: block.attention_stage(x), _like),
        "stage": (stage, _like),
        "all": (lambda: moe.experts(x_all, counts_all), _like),
        "experts": (lambda: rank_experts(x_rank, counts_rank), _like),
        "head": (head, lambda outs: (torch.ones_like(outs[0]),)),
    }
    return {name: _typical(_bound(fn, grads), repeats) for name, (fn, grads) in pieces.items()}


def _bound(
    forward: Callable[[], Any], grads: Callable[[Any], Any]
) -> Callable[[], tuple[float, float]]:
    """A call of :func:`_timed` on these arguments."""
    return lambda: _timed(forward, grads)


def _optimizer_fit(net: Any, block: Any, repeats: int) -> OpFit:
    """The gradients' norm and AdamW's step over one block's parameters and over the whole
    model's, per byte."""
    import torch

    from moesaic.gradnorm import square_norm

    points = []
    for params in (list(block.parameters()), list(net.parameters())):
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3)
        nbytes = sum(p.numel() * p.element_size() for p in params)

        def step(opt: Any = opt, params: list = params) -> tuple[float, float]:
            t0 = time.perf_counter()
            float(sum(square_norm(p.grad) for p in params if p.grad is not None))
            opt.step()
            return time.perf_counter() - t0, 0.0

        points.append((float(nbytes), _typical(step, repeats)[0]))
    (n1, t1), (n2, t2) = points
    return fit_line(n1, t1, n2, t2)


def _op_overhead(repeats: int) -> float:
    """Seconds of one tiny torch op (a 1 x 1 matmul), the fastest of ``repeats`` x 100."""
    import torch

    tiny = torch.randn(1, 1)

    def hundred() -> tuple[float, float]:
        t0 = time.perf_counter()
        for _ in range(100):
            tiny @ tiny
        return (time.perf_counter() - t0) / 100, 0.0

    return _typical(hundred, repeats)[0]
