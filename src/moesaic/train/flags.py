"""The command line of ``moesaic train``: its flags, and how they and a TOML file become a
:class:`~moesaic.train.config.TrainConfig`.

Every option is a ``TrainConfig`` field (run keys) or a ``MoEGPTConfig`` field under ``model.``
(``model.moe.`` for the MoE blocks', ``model.moe.options.`` for a strategy's options), declared
once: its flag is generated from the field and its doc (:mod:`moesaic.field_flags`: the name
with dashes unless the field's metadata spells it otherwise, ``--experts``), and the only other
data is where it applies (:mod:`moesaic.train.option_rules`). Flags left unset stay absent, so
that a TOML file's values
survive: :func:`config_from_args` applies defaults, then the ``--config`` file, then the flags,
and refuses the options that do not apply to the run's strategy and schedule
(:mod:`moesaic.train.option_rules`). Torch-free: ``moesaic train --help`` never imports torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from moesaic.checks import read_toml
from moesaic.field_flags import FieldFlag, add_flags, field_flags
from moesaic.models.config import MoEGPTConfig, nest_legacy_keys
from moesaic.schedule_table import schedule_names
from moesaic.strategy_table import options_class, strategy_names
from moesaic.train.config import TrainConfig
from moesaic.train.domains import load_cluster
from moesaic.train.option_rules import OPTIONS, check_applicable, drop_other_options
from moesaic.train.plan import AUTO, apply_plan_option, blame_plan

__all__ = ["add_train_arguments", "config_from_args", "load_toml"]


def _option_flags() -> tuple[list[FieldFlag], list[FieldFlag]]:
    """The run's flags (``TrainConfig``'s fields) and the model's (``MoEGPTConfig``'s,
    ``MoEConfig``'s under ``moe.`` and every registered strategy's options under
    ``moe.options.``, ``--<strategy>-<option>`` unless the option spells it otherwise), each
    from its field and its doc (:mod:`moesaic.field_flags`)."""
    run = field_flags(TrainConfig)
    model = MoEGPTConfig()
    model_flags = field_flags(MoEGPTConfig, prefix="model.", defaults=model)
    model_flags += field_flags(type(model.moe), prefix="model.moe.", defaults=model.moe)
    seen = {f.dest for f in model_flags}
    for strategy in strategy_names():
        cls = options_class(strategy)
        for f in field_flags(cls, prefix=OPTIONS, flag_prefix=f"{strategy}-", defaults=cls()):
            if f.dest not in seen:  # an option of several strategies: the first one's default
                seen.add(f.dest)
                model_flags.append(f)
    return run, model_flags


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every training option; unset flags stay absent so that TOML values survive."""
    run, model = _option_flags()
    parser.add_argument("--config", metavar="FILE", help="TOML file of options (flags override it)")
    add_flags(parser.add_argument_group("run"), run)
    add_flags(parser.add_argument_group("model"), model)


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file (run keys at top level, model keys under ``[model]``)."""
    return read_toml(path, "config file")


def _flag_of() -> dict[str, str]:
    """dest -> the flag that sets it (its first spelling), for messages."""
    run, model = _option_flags()
    return {"config": "--config"} | {f.dest: f.flags[0] for f in (*run, *model)}


def _toml_keys(d: dict[str, Any]) -> list[str]:
    """The options a TOML file sets, as dests (``ar_chunk``, ``model.moe.options.domain_sizes``)."""
    keys = [k for k in d if k != "model"]
    model = d.get("model", {})
    keys += [f"model.{k}" for k in model if k != "moe"]
    moe = model.get("moe", {})
    keys += [f"model.moe.{k}" for k in moe if k != "options"]
    return keys + [f"model.moe.options.{k}" for k in moe.get("options", {})]


def _stderr_note(line: str) -> None:
    print(f"moesaic train: note: {line}", file=sys.stderr)


def config_from_args(
    args: argparse.Namespace, *, note: Callable[[str], None] = _stderr_note
) -> TrainConfig:
    """Defaults, then the ``--config`` TOML file, then the flags given.

    The options set (not the defaults) must apply to the run's strategy and schedule
    (``moesaic.train.option_rules``): a flag that does not is refused (ValueError), a TOML key
    that does not gets one ``note`` line saying it has no effect.
    """
    config: str | None = getattr(args, "config", None)
    d: dict[str, Any] = load_toml(config) if config else {}
    model = d.get("model", {})
    if not isinstance(model, dict):
        raise ValueError("model must be a table of MoEGPTConfig fields")
    # before the flags, so that a flag wins over a 0.1 key; every strategy's flat option keys
    # kept in options, where those of other strategies than the run's are noted, then dropped
    model = nest_legacy_keys(model, keep_other_options=True)
    if not isinstance(model.get("moe", {}), dict):
        raise ValueError(f"model.moe must be a table of MoEConfig fields, got {model['moe']!r}")
    model["moe"] = dict(model.get("moe", {}))
    options = model["moe"].get("options", {})
    if not isinstance(options, dict):
        raise ValueError(f"model.moe.options must be a table of option names, got {options!r}")
    model["moe"]["options"] = dict(options)
    d = {**d, "model": model}
    given: dict[str, str] = dict.fromkeys(_toml_keys(d), str(config))
    for key, value in vars(args).items():
        if key.startswith("model.moe.options."):
            model["moe"]["options"][key.removeprefix("model.moe.options.")] = value
        elif key.startswith("model.moe."):
            model["moe"][key.removeprefix("model.moe.")] = value
        elif key.startswith("model."):
            model[key.removeprefix("model.")] = value
        elif key in TrainConfig.__dataclass_fields__:
            d[key] = value
    flag_of = _flag_of()
    given |= {key: flag_of[key] for key in vars(args) if key in flag_of}
    # --plan FILE.json sets the strategy, schedule and options it names; auto leaves them open
    planned = apply_plan_option(d, given, note)
    given = {key: source for key, source in given.items() if key not in planned}
    # Whether an option applies comes before whether its value is right (no point fixing a
    # value that will be refused); unknown names are left to TrainConfig's own messages.
    strategy = model["moe"].get("dispatcher", MoEGPTConfig().moe.dispatcher)
    schedule = d.get("schedule", TrainConfig.__dataclass_fields__["schedule"].default)
    if strategy in strategy_names() and schedule in schedule_names():
        check_applicable(given, strategy=strategy, schedule=schedule, note=note)
        # what was noted as another strategy's option has no effect: not the run's options
        model["moe"]["options"] = drop_other_options(model["moe"]["options"], strategy)
    emulate = d.get("emulate")
    if isinstance(emulate, str) and emulate and "nproc" not in d:
        # One worker per rank of the emulated cluster; a --nproc that disagrees is refused.
        d["nproc"] = load_cluster(emulate, option="emulate").world_size
    try:
        return TrainConfig.from_nested(d)  # nested above, once
    except ValueError as exc:
        plan = d.get("plan")
        if isinstance(plan, str) and plan != AUTO:  # an option it set may be the cause
            raise blame_plan(exc, plan) from None
        raise
