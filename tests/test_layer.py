"""Single-process (EP = 1) edge cases, grouped matmul fast path, aux_loss collection."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import moesaic
from moesaic.experts import _fast_path_ok, _GroupedMM, grouped_mm, grouped_mm_reference
from moesaic.reference import ReferenceMoE, dense_ffn
from moesaic.testing import assert_close_to_ref


def _compare_with_reference(cfg, x, seed=0):
    torch.manual_seed(seed)
    layer = moesaic.MoELayer(cfg)
    sd = layer.full_state_dict()
    x = x.clone().requires_grad_()
    y = layer(x)
    g = torch.randn_like(y)
    ((y * g).sum() + moesaic.aux_loss(layer)).backward()
    refs = {}
    for dtype in (torch.float32, torch.float64):
        ref = ReferenceMoE.from_full_state_dict(cfg, sd).to(dtype)
        xr = x.detach().to(dtype).requires_grad_()
        yr, aux = ref(xr)
        ((yr * g.to(dtype)).sum() + aux).backward()
        refs[dtype] = (yr.detach(), xr.grad, dict(ref.named_parameters()))
    (y32, gx32, p32), (y64, gx64, p64) = refs[torch.float32], refs[torch.float64]
    assert_close_to_ref(y.detach(), y32, y64, "y")
    assert_close_to_ref(x.grad, gx32, gx64, "x.grad")
    for name, param in layer.named_parameters():
        assert_close_to_ref(param.grad, p32[name].grad, p64[name].grad, f"{name}.grad")
    return layer, y


@pytest.mark.parametrize(
    ("E", "K", "T", "extra"),
    [
        (7, 2, 11, {}),  # prime E
        (5, 5, 6, {}),  # K = E
        (4, 2, 1, {}),  # T = 1
        (6, 2, 9, {"dispatcher": "padded"}),
        (6, 3, 9, {"capacity_factor": 0.5}),  # drops
        (4, 2, 8, {"score_func": "sigmoid", "activation": "gelu"}),
        # DeepSpeed-MoE semantics: kept weights renormalised after drops; balance over choice 1
        (6, 3, 9, {"capacity_factor": 0.5, "renormalize_after_drop": True}),
        (6, 2, 9, {"capacity_factor": 0.5, "renormalize_after_drop": True, "dispatcher": "padded"}),
        (5, 2, 10, {"balance_loss_choices": "first", "aux_loss_coef": 1.0}),
    ],
)
def test_layer_matches_reference(E, K, T, extra):
    cfg = moesaic.MoEConfig(
        hidden_size=12, ffn_hidden_size=20, num_experts=E, top_k=K, init_std=0.5, **extra
    )
    _compare_with_reference(cfg, torch.randn(T, 12))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_single_expert_is_a_dense_ffn(activation):
    cfg = moesaic.MoEConfig(
        hidden_size=10, ffn_hidden_size=14, num_experts=1, top_k=1, activation=activation
    )
    layer = moesaic.MoELayer(cfg)
    x = torch.randn(2, 5, 10)
    w3 = layer.experts.w3[0] if layer.experts.w3 is not None else None
    want = dense_ffn(x, layer.experts.w1[0], layer.experts.w2[0], w3)
    torch.testing.assert_close(layer(x), want, rtol=0, atol=0)


def test_empty_batch_keeps_the_graph():
    cfg = moesaic.MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4)
    layer = moesaic.MoELayer(cfg)
    x = torch.randn(0, 8, requires_grad=True)
    y = layer(x)
    (y.sum() + moesaic.aux_loss(layer)).backward()
    assert y.shape == (0, 8)
    assert layer.experts.w1.grad is not None and torch.count_nonzero(layer.experts.w1.grad) == 0


def test_input_dtype_and_shape_preserved():
    cfg = moesaic.MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4)
    layer = moesaic.MoELayer(cfg).to(torch.bfloat16)
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape


def test_aux_loss_sums_over_a_model_and_expert_params_are_marked():
    cfg = moesaic.MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4)
    model = nn.Sequential(moesaic.MoELayer(cfg), nn.Linear(8, 8), moesaic.MoELayer(cfg))
    assert moesaic.aux_loss(model).item() == 0.0
    x1, x2 = torch.randn(5, 8), torch.randn(3, 8)
    model(x1)
    model(x2)  # a second forward (a microbatch chunk) adds, it does not overwrite
    total = moesaic.aux_loss(model)
    assert total.requires_grad and [model[i].take_stats().forwards for i in (0, 2)] == [2, 2]
    assert moesaic.aux_loss(model).item() == 0.0  # read-and-reset: nothing pending now
    # Both forwards count as one batch: the loss of the concatenated tokens, up to summation
    # order (fp32, 8 tokens: a few ulp).
    model(torch.cat([x1, x2]))
    whole = moesaic.aux_loss(model)
    torch.testing.assert_close(total, whole, rtol=1e-6, atol=0)
    grads = [torch.autograd.grad(loss, model[0].router.weight)[0] for loss in (total, whole)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-9)
    marked = {n for n, p in model.named_parameters() if moesaic.is_expert_param(p)}
    assert marked == {f"{i}.experts.{w}" for i in (0, 2) for w in ("w1", "w2", "w3")}


def test_determinism_bitwise():
    cfg = moesaic.MoEConfig(hidden_size=8, ffn_hidden_size=16, num_experts=4)
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        layer = moesaic.MoELayer(cfg)
        x = torch.randn(9, 8, requires_grad=True)
        y = layer(x)
        y.square().sum().backward()
        outs.append((y.detach(), x.grad, layer.experts.w2.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("counts", [[5, 0, 8], [0, 0, 0], [13]])
def test_grouped_mm_paths_agree(counts):
    M, e = sum(counts), len(counts)
    x = torch.randn(M, 16, requires_grad=True)
    w = torch.randn(e, 16, 8, requires_grad=True)
    ref = grouped_mm_reference(x, w, counts)
    ref.square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    grouped_mm(x, w, counts, use_fast=True).square().sum().backward()
    # Same fp32 products, possibly another blocking: a few ulps.
    torch.testing.assert_close(x.grad, gx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, gw, rtol=1e-5, atol=1e-5)


def test_grouped_mm_fast_path_when_available():
    if not _fast_path_ok(torch.device("cpu"), torch.float32):
        pytest.skip("torch._grouped_mm missing or failing its self-check on CPU")
    x = torch.randn(10, 4)
    w = torch.randn(2, 4, 8)
    offs = torch.tensor([4, 10], dtype=torch.int32)
    torch.testing.assert_close(_GroupedMM.apply(x, w, offs), grouped_mm_reference(x, w, [4, 6]))
    # F = 3 floats is not 16-byte aligned: grouped_mm must fall back, not fail.
    w3 = torch.randn(2, 4, 3)
    torch.testing.assert_close(
        grouped_mm(x, w3, [4, 6], use_fast=True), grouped_mm_reference(x, w3, [4, 6])
    )


def test_grouped_mm_rejects_bad_counts():
    with pytest.raises(ValueError, match=r"counts_e sums to 3, but x_MH has 4 rows"):
        grouped_mm(torch.zeros(4, 2), torch.zeros(1, 2, 2), [3])


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_aux_terms_of_chunks_sum_to_the_batch_loss(chunks):
    """Per-chunk terms (each in its own chunk's graph) add up to the whole batch's aux loss."""
    cfg = moesaic.MoEConfig(
        hidden_size=8, ffn_hidden_size=8, num_experts=4, aux_loss_coef=1.0, z_loss_coef=0.1
    )
    torch.manual_seed(1)
    layer = moesaic.MoELayer(cfg)
    x = torch.randn(12, 8)
    layer(x)
    whole = moesaic.aux_loss(layer)
    for part in x.tensor_split(chunks):
        layer(part)
    terms = layer.take_aux_terms()
    assert len(terms) == chunks
    torch.testing.assert_close(torch.stack(terms).sum(), whole, rtol=1e-6, atol=0)
    # Evaluation forwards fold into one entry and give the same loss.
    with torch.no_grad():
        for part in x.tensor_split(4):
            layer(part)
    assert len(layer._pending_aux) == 1
    torch.testing.assert_close(moesaic.aux_loss(layer), whole.detach(), rtol=1e-6, atol=0)


def test_route_then_run_experts_is_forward():
    """The two halves a pipelined schedule calls separately compose to forward, bitwise."""
    cfg = moesaic.MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4)
    torch.manual_seed(0)
    layer = moesaic.MoELayer(cfg)
    x = torch.randn(3, 5, 8)
    y_fwd, aux_fwd = layer(x), moesaic.aux_loss(layer)
    routed = layer.route(x)
    assert routed.plan.num_tokens == 15 and layer.stats.forwards == 1  # routing sends nothing
    y_split = layer.run_experts(routed)
    assert torch.equal(y_split, y_fwd) and torch.equal(moesaic.aux_loss(layer), aux_fwd)
    assert layer.take_stats().forwards == 2


def test_renormalize_after_drop_rescales_kept_weights_to_their_sum():
    """Capacity 1 per expert, two tokens on the same two experts: the second loses both or one."""
    cfg = moesaic.MoEConfig(
        hidden_size=4,
        ffn_hidden_size=4,
        num_experts=4,
        top_k=2,
        capacity_factor=0.5,  # ceil(0.5 * 4 * 2 / 4) = 1 slot per expert
        renormalize_after_drop=True,
    )
    router = moesaic.Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    x = torch.tensor([[3.0, 2.0, 0, 0], [3.0, 0, 2.0, 0], [0, 0, 0, 3.0], [0, 0, 0, 3.0]])
    plan, _ = router(x)
    w = plan.topk_weights_TK
    kept = plan.kept_TK
    assert kept.tolist() == [[True, True], [False, True], [True, False], [False, False]]
    torch.testing.assert_close(w.sum(-1)[:3], torch.ones(3))  # kept weights sum to 1 again
    assert torch.equal(w[~kept], torch.zeros(int((~kept).sum())))
    assert torch.equal(w[3], torch.zeros(2))  # every choice dropped: nothing, not a NaN


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("native", [True, False])
def test_half_activations_on_cpu_with_and_without_native_matmul(monkeypatch, dtype, native):
    """Without a native half matmul the experts compute in fp32; either way the result is
    within the half type's rounding of the fp64 reference (relative rule vs the same-dtype
    reference), and the output keeps the input's dtype."""
    from moesaic import experts

    monkeypatch.setattr(experts, "cpu_has_native_matmul", lambda d: native)
    assert experts.expert_compute_dtype(torch.device("cpu"), dtype) == (
        dtype if native else torch.float32
    )
    cfg = moesaic.MoEConfig(hidden_size=16, ffn_hidden_size=32, num_experts=4, init_std=0.5)
    torch.manual_seed(0)
    layer = moesaic.MoELayer(cfg).to(dtype)
    sd = {k: v.float() for k, v in layer.full_state_dict().items()}
    x = torch.randn(24, 16).to(dtype)
    y = layer(x)
    assert y.dtype == dtype
    y64, _ = ReferenceMoE.from_full_state_dict(cfg, sd).double()(x.double())
    yh, _ = ReferenceMoE.from_full_state_dict(cfg, sd).to(dtype)(x)
    err = (y.double() - y64).abs().max()
    err_ref = (yh.double() - y64).abs().max()
    assert err <= 2 * err_ref + 4 * torch.finfo(dtype).eps * y64.abs().max(), (err, err_ref)


def test_stats_aux_loss_is_each_forwards_own_loss_and_stays_bounded():
    """LayerStats.aux_loss: the sum of every forward's own aux + z loss, computed when read
    from detached terms (no graph), folded into one tensor every _FOLD_AUX_AT forwards."""
    from moesaic.layer import _FOLD_AUX_AT

    cfg = moesaic.MoEConfig(hidden_size=16, ffn_hidden_size=32, num_experts=4, top_k=2)
    torch.manual_seed(0)
    layer = moesaic.MoELayer(cfg)
    xs = [torch.randn(8, 16) for _ in range(_FOLD_AUX_AT + 3)]
    want = 0.0
    for x in xs:
        layer(x)
        want += moesaic.aux_loss(layer).item()  # this forward's own loss
    stats = layer.take_stats()
    assert stats.forwards == len(xs) and len(stats.aux_terms) == 3
    assert stats.aux_loss is not None and not stats.aux_loss.requires_grad
    assert stats.aux_loss.item() == pytest.approx(want, rel=1e-5)
    assert layer.take_stats().aux_loss is None
