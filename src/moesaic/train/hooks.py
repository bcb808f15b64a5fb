"""The training run's strategy hooks: every strategy's :class:`StrategyHooks` over its layers.

The loop calls these at the points of a run between forwards (after each optimizer step, before
validation, at the end) without knowing which strategy it runs: each strategy class builds its
own hooks for its layers of the model (:meth:`MoEStrategy.training_hooks`), e.g. ``hybrid``'s
asynchronous expert gathers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moesaic.strategies.base import MoEStrategy, StrategyHooks

if TYPE_CHECKING:
    import torch
    from torch import nn

    from moesaic.strategies.base import ExpertFn
    from moesaic.trace import Recorder

__all__ = ["ModelHooks"]


class ModelHooks(StrategyHooks):
    """The hooks of every strategy in ``model``'s MoE layers, called in order of first use.

    Args:
        model: a module holding MoE layers (modules with a ``strategy`` and their ``experts``).
        recorder: handed to each strategy's hooks for their spans.
    """

    def __init__(self, model: nn.Module, *, recorder: Recorder | None = None) -> None:
        layers: dict[type[MoEStrategy], list[tuple[MoEStrategy, ExpertFn]]] = {}
        for m in model.modules():
            strategy = getattr(m, "strategy", None)
            if isinstance(strategy, MoEStrategy):
                experts: ExpertFn = m.experts  # type: ignore[assignment]  # an MoELayer's
                layers.setdefault(type(strategy), []).append((strategy, experts))
        self.hooks = [cls.training_hooks(ls, recorder=recorder) for cls, ls in layers.items()]

    def attach(self, optimizer: torch.optim.Optimizer) -> ModelHooks:
        """Call :meth:`after_optimizer_step` after every ``optimizer.step()``; returns self."""

        def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
            self.after_optimizer_step()

        optimizer.register_step_post_hook(hook)
        return self

    def after_optimizer_step(self) -> None:
        for h in self.hooks:
            h.after_optimizer_step()

    def before_evaluation(self) -> None:
        for h in self.hooks:
            h.before_evaluation()

    def close(self) -> None:
        for h in self.hooks:
            h.close()
