"""The pipelined schedules (moe-only, flowmoe): the same parameters as vanilla for R = 1, 2, 4
(aux loss included), the task orders of the paper's Eqs. 2-5 in the recorded timelines, no
all-reduce chunk issued while an all-to-all is in flight, and clear errors for bad settings.

One 2-rank world per strategy runs every case (DP 1 x EP 2, fp32, tiny model with a dense block
first and two MoE blocks, B = 12 so that R = 1, 2, 3, 4 all divide it); the tests read its
results.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F

from moesaic.comm.collectives import record_collectives
from moesaic.comm.world import run_world
from moesaic.layer import aux_loss
from moesaic.models import MoEGPT, MoEGPTConfig
from moesaic.schedule.base import StepParts
from moesaic.schedule.flowmoe import FlowMoEStep, MoeOnlyStep
from moesaic.schedule.pipeline import BlockPipeline
from moesaic.schedule.vanilla import VanillaStep
from moesaic.strategies import get_strategy, strategy_names
from moesaic.strategies.base import DispatchCombineStrategy
from moesaic.trace import Recorder

# The pipelined schedules run a strategy's dispatch/combine phases as separate stages.
PHASED = [s for s in strategy_names() if issubclass(get_strategy(s), DispatchCombineStrategy)]

B, T = 12, 8
STEPS = 2
# Small enough that the gradients leave in many chunks (replicated grads are ~60 KB).
SP = 4096
STEPS_OF = {"vanilla": VanillaStep, "moe-only": MoeOnlyStep, "flowmoe": FlowMoEStep}
CASES = [("vanilla", 1, False)]
CASES += [(s, r, False) for s in ("moe-only", "flowmoe") for r in (1, 2, 3, 4)]
# Skewed router: every token of both ranks goes to rank 0's experts, so rank 1 receives no rows.
CASES += [("vanilla", 1, True), ("moe-only", 2, True), ("flowmoe", 2, True)]
MOE_BLOCKS = (2, 3)  # block numbers of the MoE blocks (block 1 is dense)
# Today's layer features (first phased strategy only): a gated shared expert, group-limited
# biased routing with scaled weights, the sequence-wise and the global-batch balance losses,
# and every second block MoE (blocks 1 and 3; block 2 dense between them).
FEATURE_CASES = [
    ("vanilla", 1, "features"),
    ("flowmoe", 2, "features"),
    ("moe-only", 4, "features"),
]
FEATURES = {
    "num_shared_experts": 1,
    "shared_expert_gate": True,
    "num_expert_groups": 2,
    "topk_groups": 1,
    "score_bias_update_rate": 0.01,
    "routed_scaling_factor": 2.0,
    "seq_aux_loss_coef": 0.05,
    "balance_loss_scope": "global",
}


def _config(dispatcher: str, features: bool = False) -> MoEGPTConfig:
    return MoEGPTConfig.from_dict(
        {
            "d_model": 32,
            "n_layers": 3,
            "dense_layers": 0 if features else 1,
            **({"moe_layer_freq": 2} if features else {}),
            "n_heads": 2,
            "seq_len": T,
            # GPT-2's norm and positions: _skew moves ln2's bias (RMSNorm has none), and the
            # skewed steps' huge gradients (params ~25 after one) amplify rounding past the
            # tolerances below with rotary positions (1.2e-4 of tok_emb at step 2)
            "norm": "layernorm",
            "positions": "learned",
            "moe": {
                **(FEATURES if features else {}),
                "num_experts": 4,
                "top_k": 2,
                "ffn_hidden_size": 32,
                "dispatcher": dispatcher,
                "aux_loss_coef": 0.1,  # large, so that the aux gradients matter
                "z_loss_coef": 0.01,
                # hybrid: domains of one rank, so its rows cross the group as in the other
                # strategies (its gathers are tested in tests/schedule/test_hybrid_pipelined.py)
                **({"options": {"domain_sizes": [1]}} if dispatcher == "hybrid" else {}),
            },
        }
    )


def _lm_loss(logits_BTV, y_BT):
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())


@torch.no_grad()
def _skew(model):
    """Experts 0 and 1 (rank 0's) win every token: the MoE norms add 100 u to every input and
    the router scores u at 1, 0.9, -1, -0.9 (the normed input's own part is ~|x| = 6)."""
    for block in model.blocks[1:]:
        u = torch.nn.functional.normalize(torch.randn(block.ln2.bias.shape), dim=0)
        block.ln2.bias.copy_(100 * u)
        block.moe.router.weight.copy_(torch.outer(torch.tensor([1.0, 0.9, -1.0, -0.9]), u))


def _run_case(layout, dispatcher, name, R, skew, batches, rank):
    from moesaic.train.parallel import GradientSync

    torch.manual_seed(0)
    model = MoEGPT(_config(dispatcher, skew == "features"), ep_group=layout.ep_group)
    if skew is True:
        _skew(model)
    for _, layer in model.moe_layers():  # a bias that moves choices (zero at init)
        if layer.router.score_bias is not None:
            layer.router.score_bias.copy_(torch.tensor([0.3, -0.3, 0.1, 0.0]))
    rec = Recorder(rank)
    parts = StepParts(
        model=model,
        loss_fn=_lm_loss,
        grad_sync=GradientSync(layout),
        # SGD at lr 1: the parameters move by exactly the gradient (AdamW's first step is
        # sign(g) and would hide gradient errors).
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        pipeline_degree=R,
        ar_chunk_bytes=SP,
        recorder=rec,
    )
    step = STEPS_OF[name](parts)
    params, losses, spans, norms, logs = [], [], [], [], []
    for x_BT in batches:
        rec.clear()
        with record_collectives() as log:
            result = step.run(x_BT[:, :-1], x_BT[:, 1:])
        logs.append(list(log))
        assert result.applied
        losses.append((float(result.ce), float(result.aux)))
        norms.append(result.grad_norm)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        spans.append([(s.resource, s.name, s.start, s.end, dict(s.args)) for s in rec.events])
    if hasattr(step, "close"):
        step.close()
    return {"params": params, "losses": losses, "spans": spans, "norms": norms, "logs": logs}


def _world(rank, world_size, dispatcher):
    from moesaic.train.parallel import build_layout

    layout = build_layout(2, 60.0)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    batches = [torch.randint(0, 256, (B, T + 1), generator=gen) for _ in range(STEPS)]
    cases = CASES + (FEATURE_CASES if dispatcher == PHASED[0] else [])
    return {case: _run_case(layout, dispatcher, *case, batches, rank) for case in cases}


def _shared_world(rank, world_size):
    out = {dispatcher: _world(rank, world_size, dispatcher) for dispatcher in PHASED}
    out["tuning"] = _tuning_world(rank, world_size, 4)
    out["tuning_late"] = _tuning_world(rank, world_size, 6, before=3, iters=2)
    out["nan"] = _nan_world(rank, world_size)
    return out


@functools.cache
def _all_results() -> list[dict]:
    """Every dispatcher's cases, then the tuning and the non-finite worlds' checks, one after
    the other in one spawned world (a spawn costs seconds on 2 cores)."""
    return run_world(_shared_world, 2, timeout_s=300.0)


def _results(dispatcher: str) -> list[dict]:
    return [r[dispatcher] for r in _all_results()]


# ---- same mathematics --------------------------------------------------------------------


@pytest.mark.parametrize("dispatcher", PHASED)
@pytest.mark.parametrize("name", ["moe-only", "flowmoe"])
def test_same_parameters_as_vanilla(dispatcher, name):
    """After each of 2 SGD steps (lr 1: parameters move by the gradient), every parameter
    equals vanilla's for R = 1, 2, 4, with the aux loss (coef 0.1) and z-loss in the loss.

    Tolerance rtol 1e-5, atol 1e-6: the chunks change only the summation order (weight
    gradients summed over R chunk backwards instead of one matmul; the loss as a weighted sum
    of chunk means; the aux loss from per-chunk terms); fp32 reordering noise of these sums is
    ~1e-7 relative. Step 1 reduces every gradient at finish (the pool learns its hook counts);
    step 2 reduces flowmoe's during the backward, so both paths are covered.
    """
    for rank_results in _results(dispatcher):
        ref = rank_results[("vanilla", 1, False)]
        for R in (1, 2, 4):
            got = rank_results[(name, R, False)]
            for s in range(STEPS):
                ce, aux = got["losses"][s]
                ref_ce, ref_aux = ref["losses"][s]
                assert aux > 0.05  # the aux loss is in play
                assert ce == pytest.approx(ref_ce, rel=1e-5)
                assert aux == pytest.approx(ref_aux, rel=1e-5)
                for k, w in got["params"][s].items():
                    torch.testing.assert_close(
                        w, ref["params"][s][k], rtol=1e-5, atol=1e-6, msg=f"R={R} step {s} {k}"
                    )


def test_layer_features_same_parameters_as_vanilla():
    """The same for a model with today's layer features (``FEATURES``): the shared experts
    computed in the attention stage, the global-batch loads all-reduced once per layer after
    all chunks are routed and the sequence-wise loss over whole sequences leave flowmoe R = 2
    and moe-only R = 4 equal to vanilla (same tolerance, same reason)."""
    for rank_results in _results(PHASED[0]):
        ref = rank_results[("vanilla", 1, "features")]
        for case in FEATURE_CASES[1:]:
            got = rank_results[case]
            for s in range(STEPS):
                assert got["losses"][s] == pytest.approx(ref["losses"][s], rel=1e-5)
                for k, w in got["params"][s].items():
                    torch.testing.assert_close(
                        w, ref["params"][s][k], rtol=1e-5, atol=1e-6, msg=f"{case} step {s} {k}"
                    )
        assert any("shared_experts" in k for k in ref["params"][0])


@pytest.mark.parametrize("dispatcher", PHASED)
def test_global_norm_as_vanilla(dispatcher):
    """flowmoe gathers the unreduced (expert) part of the global norm with the loss flags
    while its last chunks travel; the norm equals vanilla's (GradientSync.global_norm) on every
    rank, the same float on both ranks."""
    results = _results(dispatcher)
    for name in ("moe-only", "flowmoe"):
        for R in (1, 2, 4):
            for s in range(STEPS):
                norms = [r[(name, R, False)]["norms"][s] for r in results]
                ref = results[0][("vanilla", 1, False)]["norms"][s]
                assert norms[0] == norms[1] == pytest.approx(ref, rel=1e-6), (name, R, s)


@pytest.mark.parametrize("dispatcher", PHASED)
def test_rank_without_rows_takes_part(dispatcher):
    """Every token goes to rank 0's experts: rank 1 receives no rows (dropless: its combine
    sends zero bytes) yet issues every all-to-all, and the parameters still equal vanilla's.
    (The first SGD step's z-loss gradient, ~2 * 0.01 * 100 * 100 on the router, rebalances
    the second step.)"""
    results = _results(dispatcher)
    for rank, rank_results in enumerate(results):
        ref = rank_results[("vanilla", 1, True)]
        for name in ("moe-only", "flowmoe"):
            got = rank_results[(name, 2, True)]
            for s in range(STEPS):
                combine = [x for x in got["spans"][s] if x[1].startswith("C") and x[0] == "a2a"]
                assert len(combine) == 2 * 2 * len(MOE_BLOCKS)  # R x (fwd, bwd) x blocks
                if dispatcher == "dropless" and rank == 1 and s == 0:  # (step 1 rebalances)
                    fwd = [x[4]["bytes"] for x in combine if x[4]["phase"] == "fwd"]
                    assert fwd == [0] * len(fwd)
                for k, w in got["params"][s].items():
                    torch.testing.assert_close(
                        w, ref["params"][s][k], rtol=1e-5, atol=1e-6, msg=f"{name} {k}"
                    )


# ---- recorded task orders (Eqs. 2-5) --------------------------------------------------------


def _expected_compute(R):
    """Eq. 2 (forward) and Eq. 4 (backward) with the head as the last AT stage."""
    fwd = []
    for blk in MOE_BLOCKS:
        fwd += [f"AT{r}.{blk}" for r in range(1, R + 1)] + [f"E{r}.{blk}" for r in range(1, R + 1)]
    fwd += [f"head{r}" for r in range(1, R + 1)]
    bwd = [f"head{r}" for r in range(R, 0, -1)]
    for blk in reversed(MOE_BLOCKS):
        bwd += [f"E{r}.{blk}" for r in range(R, 0, -1)] + [f"AT{r}.{blk}" for r in range(R, 0, -1)]
    return [(n, "fwd") for n in fwd] + [(n, "bwd") for n in bwd]


def _expected_a2a(R):
    """Eq. 3 (forward) and Eq. 5 (backward), in issue order."""
    fwd, bwd = [], []
    for blk in MOE_BLOCKS:
        fwd += [f"D{r}.{blk}" for r in range(1, R + 1)] + [f"C{r}.{blk}" for r in range(1, R + 1)]
    for blk in reversed(MOE_BLOCKS):
        bwd += [f"C{r}.{blk}" for r in range(R, 0, -1)] + [f"D{r}.{blk}" for r in range(R, 0, -1)]
    return [(n, "fwd") for n in fwd] + [(n, "bwd") for n in bwd]


def _lane(spans, resource):
    return sorted((s for s in spans if s[0] == resource), key=lambda s: s[2])


@pytest.mark.parametrize("dispatcher", PHASED)
@pytest.mark.parametrize("name", ["moe-only", "flowmoe"])
@pytest.mark.parametrize("R", [2, 3])
def test_recorded_orders_match_eqs_2_to_5(dispatcher, name, R):
    """Per rank and step: the compute lane runs Eq. 2 then Eq. 4, the all-to-all lane issues
    Eq. 3 then Eq. 5 (spans sorted by start), and every stage waits for its input."""
    for rank_results in _results(dispatcher):
        for spans in rank_results[(name, R, False)]["spans"]:
            compute = [(s[1], s[4]["phase"]) for s in _lane(spans, "compute")]
            assert compute == _expected_compute(R)
            a2a = [(s[1], s[4]["phase"]) for s in _lane(spans, "a2a")]
            assert a2a == _expected_a2a(R)
            assert [s[1] for s in _lane(spans, "optimizer")] == ["optimizer"]


@pytest.mark.parametrize("dispatcher", PHASED)
def test_moe_only_barriers_and_flowmoe_overlap(dispatcher):
    """moe-only issues a block's first D only after the block's last AT; flowmoe issues D1
    before AT2 ends (the attention of chunk 2 overlaps the dispatch of chunk 1). Both times
    are taken in the main thread, so this does not depend on timing."""
    for rank_results in _results(dispatcher):
        for name in ("moe-only", "flowmoe"):
            for spans in rank_results[(name, 2, False)]["spans"]:
                lanes = [s for s in spans if s[0] in ("compute", "a2a")]
                start = {(s[1], s[4]["phase"]): s[2] for s in lanes}
                end = {(s[1], s[4]["phase"]): s[3] for s in lanes}
                for blk in MOE_BLOCKS:
                    d1, at2 = start[(f"D1.{blk}", "fwd")], end[(f"AT2.{blk}", "fwd")]
                    assert (d1 >= at2) == (name == "moe-only"), (name, blk)


# ---- the exact interleaving of issues, waits and compute (one process, fake pool) ---------

# ">X" issue all-to-all X, "<X" wait for it, "X" a compute stage; "'" marks the backward.
FLOWMOE_R2 = """
AT1.2 >D1.2 AT2.2 >D2.2 <D1.2 E1.2 >C1.2 <D2.2 E2.2 >C2.2
<C1.2 AT1.3 >D1.3 <C2.2 AT2.3 >D2.3 <D1.3 E1.3 >C1.3 <D2.3 E2.3 >C2.3
<C1.3 head1 <C2.3 head2
head2' >C2.3' head1' >C1.3' <C2.3' E2.3' >D2.3' <C1.3' E1.3' >D1.3'
<D2.3' AT2.3' >C2.2' <D1.3' AT1.3' >C1.2'
<C2.2' E2.2' >D2.2' <C1.2' E1.2' >D1.2' <D2.2' AT2.2' <D1.2' AT1.2'
"""
MOE_ONLY_R2 = """
AT1.2 AT2.2 >D1.2 >D2.2 <D1.2 E1.2 >C1.2 <D2.2 E2.2 >C2.2
<C1.2 <C2.2 AT1.3 AT2.3 >D1.3 >D2.3 <D1.3 E1.3 >C1.3 <D2.3 E2.3 >C2.3
<C1.3 <C2.3 head1 head2
head2' head1' >C2.3' >C1.3' <C2.3' E2.3' >D2.3' <C1.3' E1.3' >D1.3'
<D2.3' <D1.3' AT2.3' AT1.3' >C2.2' >C1.2'
<C2.2' E2.2' >D2.2' <C1.2' E1.2' >D1.2' <D2.2' <D1.2' AT2.2' AT1.2'
"""


class _Log:
    """A fake pool (all-to-all = copy) and recorder that log one sequence of events."""

    def __init__(self):
        self.events = []

    def _tag(self, name, args):
        return name + ("'" if args["phase"] == "bwd" else "")

    def all_to_all(self, output, input, output_splits, input_splits, *, group, name, **args):
        tag = self._tag(name, args)
        self.events.append(">" + tag)
        output.copy_(input)
        log = self

        class Pending:
            def wait(self):
                log.events.append("<" + tag)
                return output

        return Pending()

    def end_all_to_alls(self):
        self.events.append("end")

    @contextlib.contextmanager
    def span(self, resource, name, **args):
        assert resource == "compute"
        self.events.append(self._tag(name, args))
        yield


@pytest.mark.parametrize("dispatcher", PHASED)
@pytest.mark.parametrize(
    ("overlap", "expected"), [(True, FLOWMOE_R2), (False, MOE_ONLY_R2)], ids=["flowmoe", "moe-only"]
)
def test_issue_wait_compute_interleaving(dispatcher, overlap, expected):
    """The main thread's exact sequence for R = 2: FlowMoE's AT{r}.{l+1} waits only C{r}.{l};
    moe-only waits every C of a block before the next block's attention, and every D gradient
    before the attention backward. Gradients match a plain backward of the whole batch."""
    torch.manual_seed(0)
    model = MoEGPT(_config(dispatcher))
    x_BT = torch.randint(0, 256, (4, T + 1), generator=torch.Generator().manual_seed(0))
    log = _Log()
    pipe = BlockPipeline(model, degree=2, overlap_attention=overlap, recorder=log)
    ce, aux = pipe.run(x_BT[:, :-1], x_BT[:, 1:], _lm_loss, log)
    # the pool hears "no more all-to-alls" right after the last one is issued (D1.2's gradient)
    end = log.events.index("end")
    assert log.events[end - 1] == ">D1.2'" and not [e for e in log.events[end:] if e[0] == ">"]
    assert [e for e in log.events if e != "end"] == expected.split()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = _lm_loss(model(x_BT[:, :-1]), x_BT[:, 1:]) + aux_loss(model)
    ref.backward()
    assert float(ce + aux) == pytest.approx(float(ref.detach()), rel=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)


# ---- priorities --------------------------------------------------------------------------


@pytest.mark.parametrize("dispatcher", PHASED)
def test_allreduce_chunks_one_per_gap_in_one_order(dispatcher):
    """flowmoe's second step (hook counts learned): both ranks issue the very same sequence of
    collectives (all-to-alls and all-reduce chunks interleaved alike: NCCL needs one order);
    chunks go out during the backward, at most one between two all-to-alls until the last
    all-to-all, and the rest after it."""
    results = _results(dispatcher)
    in_backward = 0
    for R in (1, 2, 3, 4):
        logs = [r[("flowmoe", R, False)]["logs"][1] for r in results]
        assert logs[0] == logs[1], R
        ops = [what for _, _, _, what in logs[0]]
        last_a2a = max(i for i, w in enumerate(ops) if w.startswith("all_to_all"))
        chunk = [w.startswith("all_reduce chunk") for w in ops]
        in_backward += sum(chunk[:last_a2a])
        for i in range(last_a2a):
            assert not (chunk[i] and chunk[i + 1]), (R, ops[i : i + 2])
    # Not vacuous: chunks did go out during the backward, between all-to-alls.
    assert in_backward


# ---- bad settings --------------------------------------------------------------------------


def _parts(model, R=1):
    from moesaic.train.parallel import GradientSync, build_layout

    return StepParts(
        model=model,
        loss_fn=_lm_loss,
        grad_sync=GradientSync(build_layout(1, 60.0)),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        pipeline_degree=R,
        ar_chunk_bytes=SP,
    )


def test_pipeline_degree_below_one_is_refused():
    model = MoEGPT(_config("dropless"))
    with pytest.raises(ValueError, match=r"pipeline_degree \(0\) must be >= 1"):
        _parts(model, 0)


@pytest.mark.parametrize("R", [5, 24])  # does not divide 12; larger than the batch
@pytest.mark.parametrize("name", ["moe-only", "flowmoe"])
def test_pipeline_degree_must_divide_the_batch(name, R):
    model = MoEGPT(_config("dropless"))
    step = STEPS_OF[name](_parts(model, R))
    x_BT = torch.zeros(B, T + 1, dtype=torch.long)
    with pytest.raises(
        ValueError, match=rf"pipeline_degree \({R}\) must divide .* \(12\).*--pipeline-degree"
    ):
        step.run(x_BT[:, :-1], x_BT[:, 1:])


def test_strategy_without_phases_is_named():
    from moesaic.strategies.base import MoEStrategy, StrategyOutput, Supports

    class Opaque(MoEStrategy):
        name = "opaque"

        def forward(self, x_TH, plan, experts):
            return StrategyOutput(x_TH, None)

    model = MoEGPT(_config("dropless"))
    model.blocks[1].moe.strategy = Opaque(model.blocks[1].moe.strategy.ctx)
    with pytest.raises(ValueError, match=r"'opaque' does not run under schedule 'flowmoe'"):
        FlowMoEStep(_parts(model, 2))
    # A strategy that claims every schedule without having the phases is still refused.
    Opaque.supports = Supports()
    with pytest.raises(ValueError, match=r"\(Opaque\) has no dispatch/combine phases"):
        FlowMoEStep(_parts(model, 2))


# ---- online tuning of Sp ------------------------------------------------------------------


def _tuning_world(rank, world_size, steps, before=0, iters=1):
    from moesaic.schedule.tuner import SpTuner
    from moesaic.train.parallel import GradientSync, build_layout

    layout = build_layout(2, 60.0)
    torch.manual_seed(0)
    model = MoEGPT(_config("dropless"), ep_group=layout.ep_group)
    parts = StepParts(
        model=model,
        loss_fn=_lm_loss,
        grad_sync=GradientSync(layout),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        pipeline_degree=2,
        ar_chunk_bytes=None,  # tuned
    )
    step = FlowMoEStep(parts)
    assert step.tuner is not None
    gen = torch.Generator().manual_seed(rank)
    for _ in range(before):  # steps before the tuner below is set (a benchmark's warm-up)
        x_BT = torch.randint(0, 256, (B, T + 1), generator=gen)
        step.run(x_BT[:, :-1], x_BT[:, 1:])
    # By default one iteration per sample, so that the samples change every step.
    step.tuner = SpTuner(low=step.tuner.low, high=step.tuner.high, iters_per_sample=iters)
    used = []
    for _ in range(steps):
        x_BT = torch.randint(0, 256, (B, T + 1), generator=gen)
        used.append(int(step.run(x_BT[:, :-1], x_BT[:, 1:]).metrics["ar_chunk_bytes"]))
    step.close()
    return used, [sp for sp, _ in step.tuner.history]


def test_rank_zero_tunes_sp_and_every_rank_follows():
    """Sp tuned online: rank 0's tuner observes each step and moves between samples; rank 1's
    tuner never observes, yet rank 1 uses rank 0's Sp every step (else the ranks would cut
    different all-reduce chunks and hang)."""
    (used0, hist0), (used1, hist1) = _results("tuning")
    assert used0 == used1
    assert used0 == hist0  # step k ran at rank 0's k-th sample
    assert hist1 == []
    assert len(set(used0)) >= 2


def test_a_tuner_set_after_steps_times_each_sample_at_its_own_sp():
    """A tuner set after 3 steps (as benchmarks/flowmoe_cluster.py sets one after its warm-up)
    with 2 iterations per sample: both steps of each window ran at that window's sample (the
    windows were counted from the first step of the run: a window straddled two samples)."""
    (used0, hist0), (used1, _) = _results("tuning_late")
    assert used0 == used1
    assert used0 == [sp for sp in hist0 for _ in range(2)]


# ---- health flags gathered early -----------------------------------------------------------


def _nan_world(rank, world_size):
    from moesaic.train.parallel import GradientSync, build_layout

    layout = build_layout(2, 60.0)
    torch.manual_seed(0)
    model = MoEGPT(_config("dropless"), ep_group=layout.ep_group)
    calls = []

    def loss_fn(logits_BTV, y_BT):
        calls.append(1)
        ce = _lm_loss(logits_BTV, y_BT)
        return ce * float("nan") if rank == 1 and len(calls) == 3 else ce  # step 2, chunk 1

    parts = StepParts(
        model=model, loss_fn=loss_fn, grad_sync=GradientSync(layout),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), pipeline_degree=2, ar_chunk_bytes=SP,
    )  # fmt: skip
    step = FlowMoEStep(parts)
    x_BT = torch.randint(0, 256, (4, T + 1), generator=torch.Generator().manual_seed(rank))
    out = []
    for _ in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        result = step.run(x_BT[:, :-1], x_BT[:, 1:])
        same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        out.append((result.nonfinite, result.applied, same))
    step.close()
    return out


def test_flowmoe_nonfinite_loss_on_one_rank_is_skipped_on_all():
    """flowmoe gathers the loss flags early (with the unreduced norm): a NaN loss on rank 1 in
    step 2 is named on both ranks, and neither updates; steps 1 and 3 update."""
    for steps in _results("nan"):
        (nf1, ok1, same1), (nf2, ok2, same2), (nf3, ok3, same3) = steps
        assert ok1 and not same1 and ok3 and not same3 and not nf1 and not nf3
        assert nf2[0] == "loss on rank(s) [1]" and nf2[-1].startswith("gradients")
        assert not ok2 and same2
