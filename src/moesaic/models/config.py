"""MoEGPTConfig: the shape of an MoEGPT, with the MoE blocks' ``MoEConfig`` nested as ``moe``.

Torch-free (``moesaic train --help`` and config validation run without importing torch).

A TOML file gives the model under ``[model]`` and its MoE blocks under ``[model.moe]`` with
``MoEConfig``'s field names (``num_experts``, ``top_k``, ``ffn_hidden_size``, ``dispatcher``,
...); ``hidden_size`` is the model width and is filled in from ``d_model``. The flat keys of
moesaic 0.1 (``num_experts`` ... under ``[model]``, as old checkpoints' ``meta.json`` hold them)
are still read and moved into ``moe``: see ``LEGACY_MOE_KEYS``. The strategy options live in
``[model.moe.options]`` (``MoEConfig.options``, the dispatcher's); the flat ``[model.moe]`` keys
they had before (``domain_sizes``, ``taskflow_executor``, ..., as checkpoints saved until then
hold them) are still read and moved there: see ``LEGACY_OPTION_KEYS``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moesaic.checks import check_int, check_one_of, check_positive_int
from moesaic.config import MoEConfig
from moesaic.strategy_options import StrategyOptions

NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned")
# What a model saved before ``norm`` and ``positions`` existed used: a checkpoint's meta.json
# without the keys means these (``with_legacy_architecture``), not today's defaults.
LEGACY_ARCHITECTURE = {"norm": "layernorm", "positions": "learned"}

# moesaic 0.1 flat [model] key -> the MoEConfig field it now lives in ([model.moe]).
LEGACY_MOE_KEYS = {
    "num_experts": "num_experts",
    "top_k": "top_k",
    "expert_hidden": "ffn_hidden_size",
    "aux_loss_coef": "aux_loss_coef",
    "z_loss_coef": "z_loss_coef",
    "dispatcher": "dispatcher",
    "collective_timeout_s": "collective_timeout_s",
}

# A flat [model.moe] key of before the strategy options -> (the strategy that read it, its name
# in that strategy's options, [model.moe.options]).
LEGACY_OPTION_KEYS = {
    "domain_sizes": ("hybrid", "domain_sizes"),
    "expert_compression_ratio": ("hybrid", "compression_ratio"),
    "shared_expert_every": ("hybrid", "shared_expert_every"),
    "taskflow_executor": ("taskflow", "executor"),
    "taskflow_tile_m": ("taskflow", "tile_m"),
    "taskflow_pipeline": ("taskflow", "pipeline"),
}


def default_moe(d_model: object = 128) -> MoEConfig:
    """The default MoE block of width ``d_model``: 8 experts of width 256, top-2.

    A ``d_model`` that is not a valid int gives the default width 128 here and is reported by
    ``MoEGPTConfig`` under its own name.
    """
    ok = isinstance(d_model, int) and not isinstance(d_model, bool) and d_model > 0
    width = d_model if ok and isinstance(d_model, int) else 128
    return MoEConfig(hidden_size=width, ffn_hidden_size=256, num_experts=8, top_k=2)


@dataclass(kw_only=True, slots=True)
class MoEGPTConfig:
    """Shape of an MoEGPT.

    The default (4 blocks of width 128, 8 experts of width 256, top-2, RMSNorm, rotary
    positions) trains visibly on two CPU cores within about three minutes: see README.md for
    the measured losses and a sample.

    Attributes:
        vocab_size: V; 256 for raw bytes.
        seq_len: T, the longest context.
        d_model: D, the residual width.
        n_layers: number of transformer blocks.
        n_heads: attention heads; must divide ``d_model``.
        dense_layers: the first this-many blocks use a dense MLP instead of experts
            (DeepSeek's ``first_k_dense_replace``).
        moe_layer_freq: N, every N-th block is an MoE block: block i (from 0) has experts when
            ``i >= dense_layers and i % N == 0`` (DeepSeek's ``moe_layer_freq``), the others a
            dense MLP; 1: every block past ``dense_layers``.
        dense_hidden: hidden width of those dense MLPs (SwiGLU); None = 4 * d_model.
        moe: the ``MoEConfig`` of every MoE block; its ``hidden_size`` must equal ``d_model``
            (``from_dict`` fills it in). In a training run ``TrainConfig.timeout_s`` sets its
            ``collective_timeout_s``.
        norm: "rmsnorm" (no bias) or "layernorm" (GPT-2's, what models saved before this
            field existed use).
        positions: "rope" (rotary embeddings of queries and keys, base 10000) or "learned"
            (an absolute position embedding added to the bytes', GPT-2's).
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    dense_layers: int = 0
    dense_hidden: int | None = None
    moe_layer_freq: int = 1
    moe: MoEConfig = field(default_factory=default_moe)
    norm: str = "rmsnorm"
    positions: str = "rope"

    def __post_init__(self) -> None:
        check_positive_int("vocab_size", self.vocab_size)
        check_positive_int("seq_len", self.seq_len)
        check_positive_int("d_model", self.d_model)
        check_positive_int("n_layers", self.n_layers)
        check_positive_int("n_heads", self.n_heads)
        check_int("dense_layers", self.dense_layers, 0, self.n_layers)
        check_positive_int("moe_layer_freq", self.moe_layer_freq)
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.dense_hidden is not None:
            check_positive_int("dense_hidden", self.dense_hidden)
        check_one_of("norm", self.norm, NORMS)
        check_one_of("positions", self.positions, POSITIONS)
        if self.positions == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"positions 'rope' needs an even head width, got d_model / n_heads = "
                f"{self.d_model // self.n_heads}: rotary embeddings rotate pairs of channels"
            )
        if not isinstance(self.moe, MoEConfig):
            raise ValueError(f"moe must be a MoEConfig, got {type(self.moe).__name__}")
        if self.moe.hidden_size != self.d_model:
            raise ValueError(
                f"moe.hidden_size ({self.moe.hidden_size}) must equal d_model ({self.d_model}): "
                "the MoE blocks read and write the residual stream"
            )

    def is_moe_block(self, i: int) -> bool:
        """Whether block ``i`` (0-based) has experts (``dense_layers``, ``moe_layer_freq``)."""
        return i >= self.dense_layers and i % self.moe_layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_block(i) for i in range(self.n_layers))

    @property
    def first_moe_block(self) -> int | None:
        """The index of the first MoE block (the dense blocks before it), None when none."""
        return next((i for i in range(self.n_layers) if self.is_moe_block(i)), None)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``moe`` as a nested dict); ``from_dict`` reads it back."""
        return dataclasses.asdict(self)

    def fields_flat(self) -> dict[str, object]:
        """Every field, ``moe``'s as ``moe.<name>`` and its strategy options' as
        ``moe.options.<name>``: what ranks compare before building."""
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):
            if f.name != "moe":
                out[f.name] = getattr(self, f.name)
        for f in dataclasses.fields(self.moe):
            if f.name != "options":
                out[f"moe.{f.name}"] = getattr(self.moe, f.name)
        options = self.moe.options
        assert isinstance(options, StrategyOptions)  # internal: MoEConfig resolved it
        for name, value in options.to_dict().items():
            out[f"moe.options.{name}"] = value
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoEGPTConfig:
        """Build from ``to_dict()`` output or a TOML ``[model]`` table.

        ``moe`` is a table of ``MoEConfig`` fields (``hidden_size`` defaults to ``d_model``,
        ``options`` a table of the dispatcher's options); the flat keys of moesaic 0.1 are moved
        into it and its flat option keys into ``options`` (``nest_legacy_keys``). Unknown keys
        are an error naming them.
        """
        return cls.from_nested(nest_legacy_keys(d))

    @classmethod
    def from_nested(cls, d: dict[str, Any]) -> MoEGPTConfig:
        """:meth:`from_dict` of a table whose legacy keys are already nested (a caller that
        ran ``nest_legacy_keys`` itself: ``TrainConfig.from_dict``), so that it runs once."""
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model option(s) {unknown}; known: {sorted(known)}")
        moe = d.pop("moe", None)
        base = default_moe(d.get("d_model", 128))
        if moe is None:
            return cls(moe=base, **d)
        if isinstance(moe, MoEConfig):
            return cls(moe=moe, **d)
        if not isinstance(moe, dict):
            raise ValueError(f"model.moe must be a table of MoEConfig fields, got {moe!r}")
        moe_known = {f.name for f in dataclasses.fields(MoEConfig)}
        unknown = sorted(set(moe) - moe_known)
        if unknown:
            raise ValueError(f"unknown model.moe option(s) {unknown}; known: {sorted(moe_known)}")
        return cls(moe=dataclasses.replace(base, **moe), **d)


def with_legacy_architecture(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of a saved ``[model]`` dict with ``LEGACY_ARCHITECTURE`` for the keys it lacks.

    For what a checkpoint's meta.json describes: a model saved before ``norm`` and
    ``positions`` existed was built with LayerNorm and learned positions, whatever today's
    defaults are. (A TOML file's missing keys mean the defaults: not for those.)
    """
    return {**LEGACY_ARCHITECTURE, **d}


def nest_legacy_keys(d: dict[str, Any], *, keep_other_options: bool = False) -> dict[str, Any]:
    """A copy of the ``[model]`` dict ``d`` with moesaic 0.1's flat MoE keys moved into ``moe``
    and the flat strategy option keys of ``moe`` into ``moe.options``.

    ``{"num_experts": 4, "expert_hidden": 64}`` becomes
    ``{"moe": {"num_experts": 4, "ffn_hidden_size": 64}}``; ``{"moe": {"dispatcher": "hybrid",
    "expert_compression_ratio": 4.0}}`` becomes ``{"moe": {"dispatcher": "hybrid", "options":
    {"compression_ratio": 4.0}}}`` (``LEGACY_OPTION_KEYS``). A flat option key of another
    strategy than the dispatcher is dropped: it never had an effect (a checkpoint saved every
    one), unless ``keep_other_options`` (``moesaic train`` notes, then drops, what does not
    apply to the strategy its flags choose). A key given both ways with two different values is
    an error naming both places.
    """
    d = dict(d)
    legacy = {k: d.pop(k) for k in list(d) if k in LEGACY_MOE_KEYS}
    if not legacy and not isinstance(d.get("moe"), dict):
        return d
    moe = d.get("moe", {})
    if not isinstance(moe, dict):
        raise ValueError(f"model.moe must be a table of MoEConfig fields, got {moe!r}")
    moe = dict(moe)
    for old, value in legacy.items():
        new = LEGACY_MOE_KEYS[old]
        if new in moe and moe[new] != value:
            raise ValueError(
                f"model.{old} ({value!r}) and model.moe.{new} ({moe[new]!r}) differ; "
                f"{old} moved to [model.moe] as {new}: give it there only"
            )
        moe[new] = value
    d["moe"] = _nest_option_keys(moe, keep_others=keep_other_options)
    return d


def _nest_option_keys(moe: dict[str, Any], *, keep_others: bool) -> dict[str, Any]:
    """``moe`` with its flat option keys (``LEGACY_OPTION_KEYS``) moved into ``options``."""
    flat = {k: moe.pop(k) for k in list(moe) if k in LEGACY_OPTION_KEYS}
    if not flat:
        return moe
    dispatcher = moe.get("dispatcher", MoEConfig.__dataclass_fields__["dispatcher"].default)
    options = moe.get("options")
    if isinstance(options, StrategyOptions):
        options = options.to_dict()
    if not isinstance(options, dict | None):
        raise ValueError(f"model.moe.options must be a table of option names, got {options!r}")
    options = dict(options or {})
    for old, value in flat.items():
        strategy, new = LEGACY_OPTION_KEYS[old]
        if strategy != dispatcher and not keep_others:
            continue
        if new in options and _plain(options[new]) != _plain(value):
            raise ValueError(
                f"model.moe.{old} ({value!r}) and model.moe.options.{new} ({options[new]!r}) "
                f"differ; {old} moved to [model.moe.options] as {new}: give it there only"
            )
        options[new] = value
    moe["options"] = options
    return moe


def _plain(value: object) -> object:
    """``value`` with tuples as lists (a TOML list and a config's tuple compare equal)."""
    return list(value) if isinstance(value, tuple) else value
