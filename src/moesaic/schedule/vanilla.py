"""The vanilla step: one forward of the whole batch, one backward, then one bulk gradient
synchronisation (two flat all-reduces) and the update. The reference of every other schedule."""

from __future__ import annotations

import torch

from moesaic.layer import aux_loss
from moesaic.schedule.base import StepResult, TrainStep
from moesaic.trace import maybe_span


class VanillaStep(TrainStep):
    """Forward, backward, ``grad_sync.sync``, then ``finish`` (check, clip, optimizer)."""

    name = "vanilla"

    def run(self, x_BT: torch.Tensor, y_BT: torch.Tensor) -> StepResult:
        model, rec = self.parts.model, self.parts.recorder
        # Whole-step spans (the MoE all-to-alls are inside forward and backward).
        with maybe_span(rec, "compute", "forward", phase="fwd"):
            ce = self.parts.loss_fn(model(x_BT), y_BT)
            aux = aux_loss(model).to(ce.device)  # once, after the step's only forward
        with maybe_span(rec, "compute", "backward", phase="bwd"):
            (ce + aux).backward()
        with maybe_span(rec, "allreduce", "allreduce"):
            self.parts.grad_sync.sync(self.params)
        return self.finish(ce, aux)
