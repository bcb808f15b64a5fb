"""Test helpers: the gloo world spawner and the relative tolerance rule."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moesaic.comm.world import WorkerError, run_world

if TYPE_CHECKING:
    from moesaic.config import MoEConfig
    from moesaic.layer import MoELayer

__all__ = [
    "WorkerError",
    "assert_close_to_ref",
    "ref_errors",
    "reference_world",
    "route_all_to_first_experts",
    "run_world",
]


def ref_errors(
    fast: torch.Tensor, ref: torch.Tensor, ref64: torch.Tensor, eps_dtype: torch.dtype
) -> dict[str, float | bool]:
    """The relative rule's figures: ``fast``'s and the same-dtype reference ``ref``'s max error
    against the float64 reference ``ref64``, the allowance ``2 * err(ref) + 4 ulps of
    eps_dtype at the tensor's scale``, and whether ``fast`` is within it (``ok``)."""
    truth = ref64.double()
    err_fast = (fast.double() - truth).abs().max().item() if truth.numel() else 0.0
    err_ref = (ref.double() - truth).abs().max().item() if truth.numel() else 0.0
    scale = max(truth.abs().max().item() if truth.numel() else 0.0, 1e-30)
    eps = 4 * torch.finfo(eps_dtype).eps * scale
    allowed = 2 * err_ref + eps
    return {"max_abs_err": err_fast, "max_rel_err": err_fast / scale,
            "ref_same_dtype_abs_err": err_ref, "eps": eps, "allowed_abs_err": allowed,
            "ok": bool(err_fast <= allowed)}  # fmt: skip


def assert_close_to_ref(
    fast: torch.Tensor, ref32: torch.Tensor, ref64: torch.Tensor, name: str = "tensor"
) -> None:
    """The relative rule for arithmetic paths: ``err(fast) <= 2 * err(ref32) + eps``.

    ``ref64`` is the reference run in float64 (the truth up to ~1e-16), ``ref32`` the same
    reference in the fast path's dtype: its error is what that dtype costs with an ordinary
    summation order, so a fast path may be at most twice as far from the truth. ``eps`` (4 ulps
    of float32 at the tensor's scale) absorbs the case where ref32 happens to be exact.
    """
    if fast.shape != ref64.shape:
        raise AssertionError(f"{name}: shape {tuple(fast.shape)} != {tuple(ref64.shape)}")
    e = ref_errors(fast, ref32, ref64, torch.float32)
    if not e["ok"]:
        raise AssertionError(
            f"{name}: max error {e['max_abs_err']:.3e} vs float64 reference exceeds "
            f"2 x reference-float32 error ({e['ref_same_dtype_abs_err']:.3e}) + eps "
            f"({e['eps']:.1e})"
        )


def reference_world(cfg: MoEConfig, sd: dict, xs: list, gs: list) -> dict:
    """The reference MoE over every rank's batch, in fp32 and fp64.

    Loss: ``sum_r (y_r * g_r).sum() + aux_r``. Returns ``{dtype: (ys, auxes, x_grads,
    param_grads)}``: per-rank outputs and aux losses, per-rank input gradients, and the
    gradients of the full (all-expert) parameters by name.
    """
    from moesaic.reference import ReferenceMoE

    out = {}
    for dtype in (torch.float32, torch.float64):
        ref = ReferenceMoE.from_full_state_dict(cfg, sd).to(dtype)
        xs_d = [x.detach().to(dtype).clone().requires_grad_() for x in xs]
        ys, auxes, terms = [], [], []
        for x, g in zip(xs_d, gs):
            y, aux = ref(x)
            ys.append(y)
            auxes.append(aux)
            terms.append((y * g.to(dtype)).sum() + aux)
        torch.stack(terms).sum().backward()
        grads = {name: p.grad for name, p in ref.named_parameters()}
        out[dtype] = (ys, auxes, [x.grad for x in xs_d], grads)
    return out


def route_all_to_first_experts(layer: MoELayer) -> dict:
    """Skew ``layer``'s router so that inputs with a large positive feature 0 go to experts 0
    and 1 (rank 0's); returns the new full state dict."""
    sd = layer.full_state_dict()
    sd["router.weight"].zero_()
    sd["router.weight"][0, 0], sd["router.weight"][1, 0] = 20.0, 10.0
    layer.load_full_state_dict(sd)
    return sd
