"""The router kernel (softmax, top-k, weights and the loss statistics from fp32 logits) against
plain torch, forward and backward, under Triton's interpreter (tests/kernels/conftest.py); and
which routers the layer sends to it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moesaic import MoEConfig
from moesaic.kernels.router import block_t, route, route_reference
from moesaic.routing import Router

# (T, E, K): one token, E not a power of two, K = E, several programs with a ragged tail, E
# above one program's 16 columns
SHAPES = [(1, 1, 1), (7, 5, 2), (6, 3, 3), (2 * block_t(8) + 5, 8, 2), (37, 40, 6)]
NAMES = ("weights", "probs_mean", "z")


def _parts(out):
    """The differentiable outputs of ``route``: weights, mean probabilities, z."""
    return out[1], out[2], out[4]


@pytest.mark.parametrize(("T", "E", "K"), SHAPES)
@pytest.mark.parametrize(("normalize", "scale"), [(True, 1.0), (False, 2.5), (True, 0.5)])
def test_route_matches_torch(T, E, K, normalize, scale, close):
    gen = torch.Generator().manual_seed(T * 31 + E)
    logits = (2 * torch.randn(T, E, generator=gen)).requires_grad_()
    out = route(logits, K, normalize, scale)
    ref = route_reference(logits.detach(), K, normalize, scale)
    ref64 = route_reference(logits.detach().double(), K, normalize, scale)
    assert torch.equal(out[0], ref[0]), "ids"
    assert out[0].dtype == torch.long
    assert torch.equal(out[3], ref[3]), "counts"
    assert out[3].sum().item() == T * K
    for name, fast, r, r64 in zip(NAMES, _parts(out), _parts(ref), _parts(ref64), strict=True):
        close(fast, r, r64.float(), name)
    # each output's gradient alone (the kernel skips the absent ones) and all of them at once
    upstream = [torch.randn(t.shape, generator=gen) for t in _parts(out)]
    for which in ([0], [1], [2], [0, 1, 2]):
        grads = []
        for base in (logits, logits.detach().clone(), logits.detach().double()):
            leaf = base if base is logits else base.requires_grad_()
            run = route if leaf is logits else route_reference
            parts = _parts(run(leaf, K, normalize, scale))
            loss = sum((parts[i] * upstream[i].to(leaf.dtype)).sum() for i in which)
            grads.append(torch.autograd.grad(loss, leaf)[0])
        close(grads[0], grads[1], grads[2].float(), f"logits.grad of {[NAMES[i] for i in which]}")


def test_route_counts_only_real_tokens():
    """The padded rows of the last program add nothing to the counts or the means."""
    T, E = block_t(4) + 1, 4
    logits = torch.zeros(T, E)
    logits[:, 2] = 3.0
    _ids, _w, probs_mean, counts, z = route(logits, 1)
    assert counts.tolist() == [0.0, 0.0, float(T), 0.0]
    ref = route_reference(logits, 1)
    torch.testing.assert_close(probs_mean, ref[2])
    torch.testing.assert_close(z, ref[4])


@pytest.mark.parametrize(
    ("logits", "top_k", "match"),
    [
        (torch.zeros(4, 3, dtype=torch.float64), 1, "fp32"),
        (torch.zeros(4, 3, 2), 1, r"fp32 \[T, E\]"),
        (torch.zeros(0, 3), 1, "T >= 1"),
        (torch.zeros(4, 3), 4, r"top_k \(4\) must be between 1 and E \(3\)"),
        (torch.zeros(4, 3), 0, "top_k"),
    ],
)
def test_route_refuses_bad_input(logits, top_k, match):
    with pytest.raises(ValueError, match=match):
        route(logits, top_k)


@pytest.mark.parametrize(
    ("extra", "tokens", "fused"),
    [
        ({}, 8, True),
        ({"normalize_topk": False, "routed_scaling_factor": 2.0}, 8, True),
        ({}, 0, False),  # a rank with no tokens
        ({"score_func": "sigmoid"}, 8, False),
        ({"score_bias_update_rate": 1e-3}, 8, False),  # chosen on the biased scores
        ({"num_expert_groups": 2, "topk_groups": 1}, 8, False),  # group-limited
        ({"balance_loss_choices": "first"}, 8, False),
        ({"seq_aux_loss_coef": 1e-3}, 8, False),
    ],
)
def test_router_uses_the_kernel_where_it_computes_the_same(extra, tokens, fused):
    router = Router(MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, **extra))
    assert router.routes_in_one_kernel(tokens) is fused
