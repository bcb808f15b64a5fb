"""Issue 22 item 7: each strategy owns its options (``MoEConfig.options``, a small dataclass of
its own) instead of six strategy fields on ``MoEConfig``; old configs and checkpoints, which hold
those fields flat, still load into the new options."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

import moesaic.strategy_table as strategy_table
from moesaic.cli import build_parser
from moesaic.config import MoEConfig
from moesaic.models.config import LEGACY_OPTION_KEYS, MoEGPTConfig
from moesaic.strategies import get_strategy
from moesaic.strategies.base import MoEStrategy
from moesaic.strategies.hybrid_options import HybridOptions
from moesaic.strategies.taskflow_options import TaskflowOptions
from moesaic.strategy_options import StrategyOptions
from moesaic.train.ckpt_choice import saved_model_config
from moesaic.train.config import TrainConfig
from moesaic.train.flags import config_from_args

SHAPE = {"hidden_size": 8, "ffn_hidden_size": 8, "num_experts": 4}
# What MoEConfig held before the options, by field, with its defaults (what every checkpoint
# saved until then has under model.moe whatever its dispatcher).
OLD_DEFAULTS = {
    "domain_sizes": None,
    "expert_compression_ratio": 1.0,
    "shared_expert_every": 1,
    "taskflow_executor": "static",
    "taskflow_tile_m": 128,
    "taskflow_pipeline": False,
}


def _cfg(**fields) -> MoEConfig:
    return MoEConfig(**SHAPE, **fields)


# ---- the options classes --------------------------------------------------------------------


def test_each_strategy_resolves_its_own_options_class():
    want = {"dropless": StrategyOptions, "padded": StrategyOptions}
    want |= {"hybrid": HybridOptions, "taskflow": TaskflowOptions}
    for name, cls in want.items():
        assert strategy_table.options_class(name) is cls
        assert get_strategy(name).options_class is cls  # the class agrees with its entry
        assert type(_cfg(dispatcher=name).options) is cls  # None: the defaults
    # every flat field of old is an option of the strategy the legacy table names
    assert set(LEGACY_OPTION_KEYS) == set(OLD_DEFAULTS)
    for strategy, name in LEGACY_OPTION_KEYS.values():
        assert name in strategy_table.options_class(strategy).names()


@pytest.mark.parametrize(
    "cls, fields, match",
    [
        (HybridOptions, {"domain_sizes": "2"}, r"^domain_sizes \('2'\) must be a list"),
        (HybridOptions, {"domain_sizes": []}, r"^domain_sizes must not be empty"),
        (HybridOptions, {"domain_sizes": [2, 0]}, r"^domain_sizes\[1\] \(0\)"),
        (HybridOptions, {"compression_ratio": 0.5}, r"^compression_ratio \(0\.5\) must be a"),
        (HybridOptions, {"shared_expert_every": 0}, r"^shared_expert_every \(0\)"),
        (TaskflowOptions, {"executor": "eager"}, r"^executor \('eager'\) must be one of"),
        (TaskflowOptions, {"tile_m": 0}, r"^tile_m \(0\)"),
        (TaskflowOptions, {"pipeline": 1}, r"^pipeline"),
        (TaskflowOptions, {"transport": "nccl"}, r"^transport \('nccl'\) must be one of"),
    ],
    ids=["sizes-str", "sizes-empty", "size-zero", "cr", "every", "executor", "tile", "pipe", "tr"],
)
def test_options_validate_naming_the_field_and_the_rule(cls, fields, match):
    with pytest.raises(ValueError, match=match):
        cls(**fields)


def test_from_dict_to_dict_round_trip_and_unknown_keys():
    opts = HybridOptions.from_dict({"domain_sizes": [1, 2]}, strategy="hybrid")
    assert opts.domain_sizes == (1, 2) and opts.to_dict()["compression_ratio"] == 1.0
    assert HybridOptions.from_dict(opts.to_dict(), strategy="hybrid") == opts
    with pytest.raises(
        ValueError,
        match=r"unknown option\(s\) \['tile_m'\] of strategy 'hybrid' \(HybridOptions\): its "
        r"options are \['domain_sizes', 'compression_ratio', 'shared_expert_every', "
        r"'shared_expert'\]",
    ):
        HybridOptions.from_dict({"tile_m": 64}, strategy="hybrid")
    with pytest.raises(ValueError, match=r"\['x'\] of strategy 'padded' .*it has none"):
        _cfg(dispatcher="padded", options={"x": 1})


# ---- MoEConfig.options ----------------------------------------------------------------------


def test_config_takes_a_dict_or_its_own_options_and_refuses_another_strategys():
    cfg = _cfg(dispatcher="taskflow", options={"executor": "dynamic", "tile_m": 64})
    assert cfg.options == TaskflowOptions(executor="dynamic", tile_m=64)
    assert cfg.options_as(TaskflowOptions).tile_m == 64
    with pytest.raises(TypeError, match=r"dispatcher 'taskflow' has options TaskflowOptions"):
        cfg.options_as(HybridOptions)
    with pytest.raises(
        ValueError, match=r"options \(HybridOptions\) are not those of dispatcher 'taskflow'"
    ):
        _cfg(dispatcher="taskflow", options=HybridOptions())
    with pytest.raises(ValueError, match=r"options \(3\) must be the dispatcher's options"):
        _cfg(options=3)


def test_replacing_the_dispatcher_never_keeps_the_wrong_options():
    hybrid = _cfg(dispatcher="hybrid", options={"domain_sizes": (2,)})
    with pytest.raises(ValueError, match=r"needs options=None too"):
        dataclasses.replace(hybrid, dispatcher="dropless")
    assert dataclasses.replace(hybrid, dispatcher="dropless", options=None).options == (
        StrategyOptions()
    )
    # no options to lose (an empty StrategyOptions): the new dispatcher's defaults
    assert dataclasses.replace(_cfg(), dispatcher="hybrid").options == HybridOptions()


def test_fields_flat_has_the_options():
    model = MoEGPTConfig.from_dict(
        {"d_model": 8, "n_heads": 2, "moe": {**SHAPE, "dispatcher": "hybrid"}}
    )
    flat = model.fields_flat()
    assert flat["moe.options.domain_sizes"] is None and "moe.options" not in flat
    assert flat["moe.options.compression_ratio"] == 1.0 and flat["moe.dispatcher"] == "hybrid"


# ---- old configs and checkpoints ------------------------------------------------------------


def _old_meta(dispatcher: str, **flat) -> dict:
    """A checkpoint's meta.json as moesaic wrote it before the options: every old field flat
    under model.moe, whatever the dispatcher."""
    model = MoEGPTConfig.from_dict({"d_model": 8, "n_heads": 2, "moe": dict(SHAPE)}).to_dict()
    moe = {k: v for k, v in model["moe"].items() if k != "options"}
    model["moe"] = {**moe, **OLD_DEFAULTS, **flat, "dispatcher": dispatcher}
    return json.loads(json.dumps({"model": model, "step": 3}))


def test_old_checkpoints_load_into_the_options():
    saved = saved_model_config(
        _old_meta("hybrid", domain_sizes=[1, 2], expert_compression_ratio=4.0)
    )
    assert saved.moe.options == HybridOptions(domain_sizes=(1, 2), compression_ratio=4.0)
    saved = saved_model_config(_old_meta("taskflow", taskflow_tile_m=64, taskflow_pipeline=True))
    assert saved.moe.options == TaskflowOptions(tile_m=64, pipeline=True)
    # another strategy's old fields never had an effect: dropped
    assert saved_model_config(_old_meta("padded")).moe.options == StrategyOptions()
    # and what is saved now reads back the same
    assert MoEGPTConfig.from_dict(json.loads(json.dumps(saved.to_dict()))) == saved


def _train_cfg(tmp_path, toml: str, *argv: str, notes: list[str] | None = None) -> TrainConfig:
    path = tmp_path / "run.toml"
    path.write_text(toml)
    parser = build_parser("train")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    args = sub.choices["train"].parse_args(["--config", str(path), *argv])
    return config_from_args(args, note=(notes if notes is not None else []).append)


def test_old_and_new_toml_layouts_give_the_same_options(tmp_path):
    want = HybridOptions(domain_sizes=(1, 2), compression_ratio=4.0, shared_expert_every=2)
    old = "domain_sizes = [1, 2]\nexpert_compression_ratio = 4.0\nshared_expert_every = 2\n"
    new = "[model.moe.options]\ndomain_sizes = [1, 2]\ncompression_ratio = 4.0\n"
    new += "shared_expert_every = 2\n"
    layouts = {
        "flat [model.moe]": f'[model.moe]\ndispatcher = "hybrid"\n{old}',
        # moesaic 0.1's [model] dispatcher, moved into [model.moe] before the options
        "flat [model]": f'[model]\ndispatcher = "hybrid"\n[model.moe]\n{old}',
        "[model.moe.options]": f'[model.moe]\ndispatcher = "hybrid"\n{new}',
    }
    for name, toml in layouts.items():
        assert _train_cfg(tmp_path, toml).model.moe.options == want, name
        path = tmp_path / "model.toml"
        path.write_text(toml)
        model = TrainConfig.from_dict({"model": _toml_model(path)}).model
        assert model.moe.options == want, name
    # a flag wins over the file
    over = _train_cfg(tmp_path, layouts["[model.moe.options]"], "--domains", "2,1")
    assert over.model.moe.options == dataclasses.replace(want, domain_sizes=(2, 1))
    # one option given both ways, differently: refused naming both places
    both = f'[model.moe]\ndispatcher = "hybrid"\ndomain_sizes = [2, 2]\n{new}'
    with pytest.raises(ValueError, match=r"model.moe.domain_sizes \(\[2, 2\]\) and "):
        _train_cfg(tmp_path, both)


def _toml_model(path) -> dict:
    from moesaic.checks import read_toml

    return read_toml(path, "config")["model"]


def test_a_shared_toml_notes_then_drops_other_strategies_options(tmp_path):
    toml = "[model.moe]\ntaskflow_tile_m = 64\n[model.moe.options]\ndomain_sizes = [2]\n"
    notes: list[str] = []
    cfg = _train_cfg(tmp_path, toml, "--strategy", "taskflow", notes=notes)
    assert cfg.model.moe.options == TaskflowOptions(tile_m=64)
    assert [n.split(" in ")[0] for n in notes] == ["model.moe.options.domain_sizes"]
    assert "applies only to --strategy hybrid" in notes[0]
    # a name no strategy has is refused, naming the strategy and its options
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['tile'\] of strategy 'taskflow'"):
        _train_cfg(tmp_path, "[model.moe.options]\ntile = 64\n", "--strategy", "taskflow")


# ---- the registry ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _ToyOptions(StrategyOptions):
    depth: int = 1


class _Toy(MoEStrategy):
    name = "toy_options"
    options_class = _ToyOptions

    def forward(self, x_TH, plan, experts):  # never called: only the registry is tested
        raise NotImplementedError


def test_a_registered_strategy_brings_its_options(monkeypatch):
    monkeypatch.setitem(strategy_table._TARGETS, "toy_options", _Toy)
    assert _cfg(dispatcher="toy_options", options={"depth": 3}).options == _ToyOptions(depth=3)
    # by path, options named in the entry, as MOESAIC_STRATEGIES does with "+"
    entry = f"toy_env={__name__}:_Toy+{__name__}:_ToyOptions"
    monkeypatch.setenv(strategy_table.ENV_VAR, entry)
    assert strategy_table.options_class("toy_env") is _ToyOptions
    # an entry without options while the class declares some: refused when the class is built
    monkeypatch.setenv(strategy_table.ENV_VAR, f"toy_bare={__name__}:_Toy")
    assert strategy_table.options_class("toy_bare") is StrategyOptions
    with pytest.raises(ValueError, match=r"_Toy.options_class is _ToyOptions but its registry"):
        get_strategy("toy_bare")


def test_options_are_resolved_without_torch():
    code = (
        "import sys\nfrom moesaic.models.config import MoEGPTConfig\n"
        "m = MoEGPTConfig.from_dict({'moe': {'dispatcher': 'hybrid', 'domain_sizes': [2]}})\n"
        "t = MoEGPTConfig.from_dict({'moe': {'dispatcher': 'taskflow'}})\n"
        "print(m.moe.options.domain_sizes, t.moe.options.tile_m, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["(2,)", "128", "False"]


def test_the_taskflow_transport_option_reaches_the_runtime():
    """``options.transport`` is what the layer's runtime picks its transport by (a world of
    one: no process group is needed)."""
    from moesaic.layer import MoELayer

    cfg = MoEConfig(
        hidden_size=8,
        ffn_hidden_size=8,
        num_experts=2,
        dispatcher="taskflow",
        options={"transport": "auto"},
    )
    assert MoELayer(cfg).strategy.runtime.transport == "auto"
