"""The strategies' lifecycle hooks: defaults that do nothing, hybrid's, and the training code
that calls them without naming a strategy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import moesaic
from moesaic.strategies import get_strategy, strategy_names
from moesaic.strategies.base import StrategyHooks
from moesaic.strategies.prefetch import ExpertPrefetcher
from moesaic.strategy_options import StrategyOptions
from moesaic.train.hooks import ModelHooks

TRAIN_DIR = Path(moesaic.__file__).parent / "train"


def _cfg(**overrides) -> moesaic.MoEConfig:
    return moesaic.MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, **overrides)


@pytest.mark.parametrize("name", [n for n in strategy_names() if n != "hybrid"])
def test_default_hooks_do_nothing(name):
    cls = get_strategy(name)
    cfg = _cfg(dispatcher=name)
    cls.check_levels(cfg, (4,))  # nothing to refuse
    assert cls.inference_config(cfg) is cfg
    hooks = cls.training_hooks([])
    assert type(hooks) is StrategyHooks
    hooks.after_optimizer_step()
    hooks.before_evaluation()
    hooks.close()


def test_hybrid_hooks():
    cls = get_strategy("hybrid")
    cls.check_levels(_cfg(dispatcher="hybrid", options={"domain_sizes": (1, 2)}), (2, 4))
    with pytest.raises(ValueError, match=r"^options\.domain_sizes"):
        cls.check_levels(_cfg(dispatcher="hybrid", options={"domain_sizes": (3,)}), (4,))
    cfg = cls.inference_config(_cfg(dispatcher="hybrid", options={"domain_sizes": (2,)}))
    assert cfg.dispatcher == "dropless" and cfg.options == StrategyOptions()
    with cls.training_hooks([], recorder=None) as hooks:
        assert isinstance(hooks, ExpertPrefetcher) and hooks.layers == []


class _Calls(StrategyHooks):
    def __init__(self, log: list, layers) -> None:
        self.log, self.layers = log, layers

    def after_optimizer_step(self) -> None:
        self.log.append("step")

    def before_evaluation(self) -> None:
        self.log.append("eval")

    def close(self) -> None:
        self.log.append("close")


def test_model_hooks_build_each_strategys_hooks_once_over_its_layers(monkeypatch):
    log: list = []
    built: list = []

    def training_hooks(cls, layers, *, recorder=None):
        built.append((cls.name, [s for s, _ in layers]))
        return _Calls(log, layers)

    dropless = get_strategy("dropless")
    monkeypatch.setattr(dropless, "training_hooks", classmethod(training_hooks))
    torch.manual_seed(0)
    model = torch.nn.Sequential(moesaic.MoELayer(_cfg()), moesaic.MoELayer(_cfg()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = ModelHooks(model).attach(optimizer)
    assert built == [("dropless", [model[0].strategy, model[1].strategy])]
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    hooks.before_evaluation()
    hooks.close()
    assert log == ["step", "eval", "close"]


def test_training_code_names_no_strategy():
    """Whatever depends on the strategy asks the strategy (its hooks and declared properties);
    only the table of which flags apply where (``option_rules.py``) is data that names them."""
    names = "|".join(map(re.escape, strategy_names()))
    pattern = re.compile(rf"""(["'])({names})\1""")  # a string literal that is a name
    for path in sorted(TRAIN_DIR.glob("*.py")):
        if path.name == "option_rules.py":
            continue
        hits = [
            i for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)
        ]
        assert not hits, f"{path.name} names a strategy on line(s) {hits}"
