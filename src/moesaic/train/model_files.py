"""A model file or a training config read as the simulator's workload, and the two converted.

``moesaic simulate --model`` and ``moesaic plan --model`` read a model through :func:`load_model`,
which takes the simulator's model format (:mod:`moesaic.sim.model`) or a training config
(``moesaic train --config``: run options at top level, ``d_model``, ``n_layers``, ... under
``[model]``, the MoE block's under ``[model.moe]``), told apart by their keys (:func:`model_format`):
:func:`model_spec_of` gives the simulator's view of a training config (``batch = batch_size``,
``hidden = d_model``, fp32), and :func:`train_config_of` the training config a model file stands
for (the default run options: ``schedule = "vanilla"``, so one chunk per step), so that one file
can be planned and simulated. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from moesaic.checks import read_toml
from moesaic.models.config import LEGACY_MOE_KEYS, MoEGPTConfig
from moesaic.sim.model import MODEL_ONLY_KEYS, ModelSpec, train_model_table
from moesaic.train.config import TrainConfig


def model_spec_of(cfg: TrainConfig, *, name: str = "model") -> ModelSpec:
    """The simulator's view of a training config: its MoE blocks, one rank's batch, fp32.

    Raises ValueError (naming the field) for what the model format cannot express: dense
    blocks (``model.dense_layers``), which the simulator does not model.
    """
    model, moe = cfg.model, cfg.model.moe
    if model.dense_layers:
        raise ValueError(
            f"model.dense_layers ({model.dense_layers}) > 0: the simulator's model has MoE "
            "blocks only (set dense_layers = 0 to simulate it)"
        )
    if model.moe_layer_freq > 1:
        raise ValueError(
            f"model.moe_layer_freq ({model.moe_layer_freq}) > 1: the simulator's model has "
            "MoE blocks only (set moe_layer_freq = 1 to simulate it)"
        )
    return ModelSpec(
        name=name,
        layers=model.n_layers,
        batch=cfg.batch_size,
        seq_len=model.seq_len,
        hidden=model.d_model,
        ffn_hidden=moe.ffn_hidden_size,
        experts=moe.num_experts,
        top_k=moe.top_k,
        heads=model.n_heads,
        vocab=model.vocab_size,
        capacity_factor=float(moe.capacity_factor or 0.0),
        activation=moe.activation,
        act_bytes=4,  # moesaic train runs in fp32
        param_bytes=4,
    )


def _train_keys() -> tuple[set[str], set[str]]:
    """(top-level keys, ``[model]`` keys) only a training config has."""
    top = {f.name for f in fields(TrainConfig)} - {"model"}
    model = {f.name for f in fields(MoEGPTConfig)} | set(LEGACY_MOE_KEYS)
    return top, model - {f.name for f in fields(ModelSpec)}


def model_format(data: Mapping[str, Any]) -> str | None:
    """``"model"`` (a :class:`ModelSpec` file), ``"train"`` (a training config) or None (neither,
    or keys of both), by the keys of the parsed TOML ``data``."""
    top_keys, model_keys = _train_keys()
    raw = data.get("model")
    table = raw if isinstance(raw, Mapping) else {}
    as_model = any(k in MODEL_ONLY_KEYS for k in table)
    as_train = any(k in top_keys for k in data) or any(k in model_keys for k in table)
    # [model] with only the keys both formats name (seq_len, top_k): a training config with
    # the default model otherwise (a model file needs layers, hidden, ...)
    as_train = as_train or (bool(table) and set(table) <= {"seq_len", "top_k"})
    if as_model == as_train:
        return None
    return "model" if as_model else "train"


FORMATS_RULE = (
    "a model file (docs/simulator.md) holds one [model] table with layers, batch, seq_len, "
    "hidden, ffn_hidden, experts, top_k (optional: name, heads, vocab, capacity_factor, "
    "routing_skew, activation, act_bytes, param_bytes, layer_only); a training config "
    "(moesaic train --config) has run options at top level (batch_size, steps, ...), "
    "seq_len, d_model, n_layers, n_heads, ... under [model] and num_experts, top_k, "
    "ffn_hidden_size, ... under [model.moe]"
)


def load_model(path: str | Path) -> ModelSpec | TrainConfig:
    """The model file or training config at ``path`` (told apart by its keys: see
    :func:`model_format`); errors name the file and, for neither, the keys each format has."""
    path = Path(path)
    data = read_toml(path, "model file")
    kind = model_format(data)
    if kind == "model":
        return ModelSpec.from_toml(path)
    if kind is None:
        keys = sorted(data)
        table = data.get("model")
        if isinstance(table, Mapping):
            keys += [f"model.{k}" for k in sorted(table)]
        mixed = isinstance(table, Mapping) and any(k in MODEL_ONLY_KEYS for k in table)
        what = "mixes the keys of both formats" if mixed else "has the keys of neither"
        raise ValueError(
            f"model file {str(path)!r} is neither a model file nor a training config: it "
            f"{what} ({', '.join(keys) or 'no keys'}); {FORMATS_RULE}"
        )
    try:
        return TrainConfig.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"training config {str(path)!r}: {exc}") from None


def load_model_spec(path: str | Path) -> ModelSpec:
    """:func:`load_model` as a :class:`ModelSpec` (a training config converted, named after the
    file)."""
    model = load_model(path)
    if isinstance(model, ModelSpec):
        return model
    try:
        return model_spec_of(model, name=Path(path).stem)
    except ValueError as exc:
        raise ValueError(f"training config {str(path)!r}: {exc}") from None


def train_config_of(model: ModelSpec) -> TrainConfig:
    """The training config a model file stands for: its model and batch with the default run
    options (``schedule = "vanilla"``: one chunk per step); refuses what
    :func:`~moesaic.sim.model.train_model_table` refuses."""
    return TrainConfig.from_dict({"batch_size": model.batch, "model": train_model_table(model)})
