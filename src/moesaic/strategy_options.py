"""The options of one MoE execution strategy: :class:`StrategyOptions`, what each strategy's own
options dataclass derives from.

``MoEConfig.options`` holds the options of the config's ``dispatcher`` (``hybrid``'s domain sizes,
``taskflow``'s executor, ...), so that the config carries no field only one strategy reads. A
strategy without options has this empty class. Torch-free and at the bottom of the package (it
imports nothing of it), like :mod:`moesaic.strategy_table`, which names each strategy's options
class next to the strategy so that a config is validated without importing torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["StrategyOptions"]

OptionsT = TypeVar("OptionsT", bound="StrategyOptions")


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategyOptions:
    """A strategy's options: none here; a strategy with options subclasses this with its fields,
    validated in ``__post_init__`` (a bad value raises ValueError naming the field and the
    rule).

    Frozen: a config's options are compared between ranks and shared by every layer built from
    the config, so they never change after validation (``dataclasses.replace`` makes new ones).
    """

    @classmethod
    def from_dict(cls: type[OptionsT], d: Mapping[str, Any], *, strategy: str) -> OptionsT:
        """Build from a table of option names (a TOML ``[model.moe.options]``, ``to_dict()``).

        Raises:
            ValueError: ``d`` is not a table, or has keys that are not options of ``strategy``
                (naming them, the strategy and its options).
        """
        if not isinstance(d, Mapping):
            raise ValueError(
                f"options of strategy {strategy!r} must be a table of option names, got {d!r}"
            )
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            has = f"its options are {known}" if known else "it has none"
            raise ValueError(
                f"unknown option(s) {unknown} of strategy {strategy!r} ({cls.__name__}): {has}"
            )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """The options as plain data (``from_dict`` reads it back)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def check_run(
        self, *, ep: int, device: str, ep_hosts: int, kernels: str, activation: str
    ) -> None:
        """Refuse a run these options cannot make, before anything starts (ValueError naming
        the option and the reason); every run is fine unless a strategy's options say
        otherwise.

        Args:
            ep: the expert-parallel group's size.
            device: the device type the run computes on ("cpu", "cuda").
            ep_hosts: the most hosts one expert-parallel group spans.
            kernels, activation: the layer's ``MoEConfig`` fields of those names (which
                implementation runs the experts).
        """
