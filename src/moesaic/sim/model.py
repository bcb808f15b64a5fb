"""The workload a simulation runs: an MoE transformer and the batch one rank feeds it.

A model file is TOML with one ``[model]`` table::

    [model]
    name = "flowmoe_small"
    layers = 4              # transformer blocks, each attention + MoE
    batch = 8               # sequences per rank
    seq_len = 64
    hidden = 128            # H
    ffn_hidden = 2048       # F, of each expert
    experts = 4             # E
    top_k = 2               # K
    heads = 4
    vocab = 256
    capacity_factor = 0.0   # 0: dropless; > 0: each expert admits ceil(cf T K / E) rows
    routing_skew = 0.0      # Zipf exponent of expert popularity (0: uniform)
    measured_loads = []     # rows each expert got in a run, in placement order (overrides the
                            # skew): one list, or one list per MoE layer
    activation = "swiglu"   # or "gelu"
    act_bytes = 4           # bytes per activation element on the wire
    param_bytes = 4         # bytes per parameter (gradients are reduced in this width)
    layer_only = false      # true: MoE layers alone (below)

With ``layer_only`` a block is the MoE layer alone, as ``benchmarks/taskflow_cluster.py`` and
``bench_layer.py`` time it: the router's gate is its only compute besides the experts, and there
is no attention, head, embedding, replicated gradient (so no all-reduce) or optimizer step.

FLOPs follow the models of ``models/gpt.py`` (pre-norm attention with fused QKV and an output
projection, SwiGLU or GELU experts without biases, a byte-level head) at 2 FLOPs per MAC;
backward is twice the forward. Torch-free.

``moesaic simulate --model`` and ``moesaic plan --model`` also take a training config
(:mod:`moesaic.train.model_files`); :func:`train_model_table` is the training model a model file
stands for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from moesaic.checks import check_bool, check_number, check_one_of, check_positive_int, read_toml
from moesaic.config import check_top_k
from moesaic.models.config import MoEGPTConfig

__all__ = [
    "ModelSpec",
    "expert_shares",
    "layer_shares",
    "measured_loads",
    "model_config_of",
    "train_model_table",
]

# [model] keys only the model format has, and those only a training config's [model] has.
MODEL_ONLY_KEYS = (
    "name",
    "layers",
    "batch",
    "hidden",
    "ffn_hidden",
    "experts",
    "heads",
    "vocab",
    "capacity_factor",
    "routing_skew",
    "measured_loads",
    "activation",
    "act_bytes",
    "param_bytes",
    "layer_only",
)


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelSpec:
    """An MoE transformer and one rank's batch (see the module docstring for the fields)."""

    name: str = "model"
    layers: int
    batch: int
    seq_len: int
    hidden: int
    ffn_hidden: int
    experts: int
    top_k: int
    heads: int = 4
    vocab: int = 256
    capacity_factor: float = 0.0
    routing_skew: float = 0.0
    measured_loads: tuple[tuple[float, ...], ...] = ()
    activation: str = "swiglu"
    act_bytes: int = 4
    param_bytes: int = 4
    layer_only: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"model.name ({self.name!r}) must be a non-empty string")
        for f in ("layers", "batch", "seq_len", "hidden", "ffn_hidden", "experts", "top_k"):
            check_positive_int(f"model.{f}", getattr(self, f))
        for f in ("heads", "vocab", "act_bytes", "param_bytes"):
            check_positive_int(f"model.{f}", getattr(self, f))
        check_top_k(self.top_k, self.experts, names=("model.top_k", "model.experts"))
        if self.hidden % self.heads:
            raise ValueError(f"model.hidden ({self.hidden}) must be divisible by model.heads")
        check_number("model.capacity_factor", self.capacity_factor, 0.0, 1e3)
        check_number("model.routing_skew", self.routing_skew, 0.0, 10.0)
        loads = load_rows(self.measured_loads, "model.measured_loads", self.experts)
        object.__setattr__(self, "measured_loads", loads)
        check_one_of("model.activation", self.activation, ("swiglu", "gelu"))
        check_bool("model.layer_only", self.layer_only)

    @classmethod
    def from_toml(cls, path: str | Path) -> ModelSpec:
        """Reads a model file; errors name the file and the field."""
        path = Path(path)
        data = read_toml(path, "model file")
        try:
            return cls.from_dict(data, default_name=path.stem)
        except ValueError as exc:
            raise ValueError(f"model file {str(path)!r}: {exc}") from exc

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, default_name: str = "model") -> ModelSpec:
        """From the TOML layout (a ``model`` table), validating every field."""
        if set(data) != {"model"} or not isinstance(data["model"], Mapping):
            raise ValueError("a model file holds exactly one [model] table")
        raw = dict(data["model"])
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(allowed))
        if unknown:
            raise ValueError(f"model: unknown field(s) {unknown}; allowed are {allowed}")
        required = ("layers", "batch", "seq_len", "hidden", "ffn_hidden", "experts", "top_k")
        missing = [f for f in required if f not in raw]
        if missing:
            raise ValueError(f"model: missing field(s) {missing}")
        raw.setdefault("name", default_name)
        return cls(**raw)

    # ------------------------------------------------------------------------------ sizes
    @property
    def tokens(self) -> int:
        """T, tokens per rank per step."""
        return self.batch * self.seq_len

    @property
    def mats(self) -> int:
        """Weight matrices per expert: 3 (SwiGLU) or 2 (GELU)."""
        return 3 if self.activation == "swiglu" else 2

    def attention_flops(self, tokens: int) -> float:
        """Forward FLOPs of one block's attention stage and gate for ``tokens`` tokens (the gate
        alone when ``layer_only``)."""
        H = self.hidden
        gate = self.gate_flops(tokens)
        if self.layer_only:
            return gate
        qkv_o = 2.0 * tokens * H * 4 * H
        scores = 2.0 * 2 * tokens * self.seq_len * H / 2  # causal: half the square
        return qkv_o + scores + gate

    def expert_flops(self, rows: float) -> float:
        """Forward FLOPs of ``rows`` routed rows through their experts."""
        return self.mats * 2.0 * rows * self.hidden * self.ffn_hidden

    def gate_flops(self, tokens: int) -> float:
        """Forward FLOPs of the router's gate (``tokens x H @ H x E``; fp32 logits, computed
        at the router's rate: ``Profile.router_flops_per_s``)."""
        return 2.0 * tokens * self.hidden * self.experts

    def gate_bytes(self, tokens: int, *, fp32_copy: bool = True) -> float:
        """Forward bytes of the router's memory-bound passes for ``tokens`` tokens: the tokens
        read in their dtype, and with ``fp32_copy`` (fp32 logits computed in fp32, as on a
        CPU) written and read again in fp32; without (a GPU's half-precision gate,
        ``router_gate.gate_logits``) that read alone."""
        return tokens * self.hidden * (self.act_bytes + (8.0 if fp32_copy else 0.0))

    def expert_bytes(self, rows: float) -> float:
        """Forward bytes of the memory-bound passes over ``rows`` routed rows outside their
        GEMMs, what a GPU pays at memory bandwidth (``Profile.compute_s``): the dispatch and
        the combine gathers (a row of H read and written, each), the combine's weighted sum
        (read), and the activation between the GEMMs (SwiGLU as torch runs it, silu then the
        product: 5 passes of F; GELU: 2). The backward moves about twice this (the rule for
        every task: twice the forward). On a GPU the default ``kernels="fused"`` runs SwiGLU in
        3 passes forward and 5 backward: this over-counts it there by 2 and 4 passes of F per
        row (about 0.2 ms of an 8k-token Mixtral-like bf16 step on an H200), left as measured
        against in issue 27."""
        act_passes = 5 if self.mats == 3 else 2
        return self.act_bytes * rows * (5.0 * self.hidden + act_passes * self.ffn_hidden)

    def head_flops(self, tokens: int) -> float:
        """Forward FLOPs of the output head for ``tokens`` tokens (0 when ``layer_only``)."""
        if self.layer_only:
            return 0.0
        return 2.0 * tokens * self.hidden * self.vocab

    def replicated_params_per_block(self) -> int:
        """Parameters of a block that every rank holds: QKV, output, two norms, the router
        (none reduced when ``layer_only``: the layer is timed alone, without a data-parallel
        step)."""
        if self.layer_only:
            return 0
        H = self.hidden
        return 4 * H * H + 4 * H + H * self.experts

    def outer_params(self) -> int:
        """Embeddings (tokens, positions), final norm: reduced after the first block's (0 when
        ``layer_only``)."""
        if self.layer_only:
            return 0
        return (self.vocab + self.seq_len) * self.hidden + 2 * self.hidden


def load_rows(raw: Any, name: str, experts: int | None = None) -> tuple[tuple[float, ...], ...]:
    """Expert loads as rows, one per MoE layer or per step and layer (``model.measured_loads``,
    a profile's ``routing.loads``): a flat list (one row) or a list of rows, each with one entry per
    expert (``experts`` of them when given, else all rows as long), >= 0 and not all zero;
    () for none. ``name`` names the field in the errors."""
    rows = list(raw)
    if not rows:
        return ()
    flat = not isinstance(rows[0], (list, tuple))
    if flat:
        rows = [rows]
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)):
            raise ValueError(
                f"{name}[{i}] must be a list (one row per MoE layer) when another entry is"
            )
        where = name if flat else f"{name}[{i}]"
        if experts is not None and len(row) != experts:
            raise ValueError(
                f"{where} has {len(row)} entries; it must have one per expert (model.experts "
                f"= {experts})"
            )
        if experts is None and (not row or len(row) != len(rows[0])):
            raise ValueError(f"{name} must be one non-empty row per MoE layer, all as long")
        for e, x in enumerate(row):
            check_number(f"{where}[{e}]", x, 0.0, 1e18)
        if not math.fsum(row) > 0:
            raise ValueError(f"{where} must not be all zero")
        out.append(tuple(float(x) for x in row))
    return tuple(out)


def layer_shares(model: ModelSpec) -> list[list[float]]:
    """Each MoE layer's share of the routed rows per expert, in placement order: every row of
    ``measured_loads`` normalised (one row stands for every layer), else Zipf(``routing_skew``),
    uniform at 0; with a capacity factor each share is capped at ``cf / E`` (the rest is
    dropped: the shares then sum to less than 1)."""
    E = model.experts
    rows = model.measured_loads or (tuple((e + 1) ** -model.routing_skew for e in range(E)),)
    cap = model.capacity_factor / E if model.capacity_factor > 0 else math.inf
    out = []
    for row in rows:
        total = math.fsum(row)
        out.append([min(x / total, cap) for x in row])
    return out


def expert_shares(model: ModelSpec, groups: int = 1) -> list[float]:
    """Share of routed rows each expert receives, in placement order: ``measured_loads``
    normalised when given (a run's loads, :func:`measured_loads`), else Zipf(``routing_skew``),
    uniform at 0.

    With a capacity factor, an expert's share is capped at ``cf / E`` of the rows and the
    rest is dropped (the shares then sum to less than 1).

    With loads of several MoE layers, each layer is normalised and capped, its ``groups``
    contiguous groups of experts (the ranks' experts, ``E / groups`` each) are put in order of
    their load, busiest first, and the layers are averaged: the simulator prices one layer for
    all of them, and a step waits in every layer for that layer's busiest rank, whichever rank
    it is (summing the layers as placed would spread one layer's hot rank and another's over
    two ranks). ``groups = E`` orders single experts (the largest expert load of a layer,
    averaged); ``groups = 1`` keeps the placement.
    """
    E = model.experts
    if E % groups:
        raise ValueError(f"groups ({groups}) must divide model.experts ({E})")
    rows = layer_shares(model)
    size = E // groups
    out = [0.0] * E
    for shares in rows:
        blocks = [shares[g * size : (g + 1) * size] for g in range(groups)]
        if groups > 1:
            blocks.sort(key=math.fsum, reverse=True)
        for e, s in enumerate(x for block in blocks for x in block):
            out[e] += s / len(rows)
    return out


def measured_loads(path: str | Path, *, skip: int = 2) -> tuple[tuple[float, ...], ...]:
    """Rows each expert received in a training run, one row per step and MoE layer (steps
    outer), from its ``metrics.jsonl``: every train record's ``expert_load`` (one list per MoE
    layer, experts in placement order) after the first ``skip`` records (warm-up; all of them
    when there are no more). The busiest rank of a real job carries these, not a uniform share.

    Each step is a row of its own, not summed over the steps: a step waits for that step's
    busiest rank (and a padded exchange without a capacity sends that step's largest load),
    and which expert is busiest changes from step to step (a step's windows of the corpus
    share their bytes), so the busiest of the sum is below the steps' busiest (1.6-2.2x the
    mean against 1.5-3.7x, steps 3-8 of a top-1 run of 8 experts): :func:`expert_shares`
    orders every row's ranks before averaging them."""
    import json

    path = Path(path)
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if isinstance(row, dict) and row.get("kind") == "train" and row.get("expert_load"):
            records.append(row["expert_load"])
    if not records:
        raise ValueError(
            f"{path}: no train record with expert_load (a moesaic train metrics.jsonl)"
        )
    records = records[skip:] or records
    shapes = {(len(rec), len(layer)) for rec in records for layer in rec}
    if len(shapes) != 1:
        raise ValueError(f"{path}: expert_load records of different shapes {sorted(shapes)}")
    return tuple(tuple(float(x) for x in layer) for rec in records for layer in rec)


def train_model_table(model: ModelSpec) -> dict[str, Any]:
    """The ``[model]`` table of the training config a model file stands for (``d_model``,
    ``n_layers``, ... and its ``moe`` table). ``layer_only`` and ``routing_skew`` have no
    training-config equivalent and are refused (``act_bytes`` is the caller's)."""
    if model.layer_only:
        raise ValueError(
            "model.layer_only = true has no training-config equivalent: a training config "
            "(and moesaic plan) prices whole transformer blocks, attention before each MoE layer"
        )
    if model.routing_skew:
        raise ValueError(
            f"model.routing_skew ({model.routing_skew}) != 0: the training config's cost "
            "model assumes uniform routing"
        )
    moe: dict[str, Any] = {
        "num_experts": model.experts,
        "top_k": model.top_k,
        "ffn_hidden_size": model.ffn_hidden,
        "activation": model.activation,
    }
    if model.capacity_factor > 0:
        moe["capacity_factor"] = model.capacity_factor
    return {
        "seq_len": model.seq_len,
        "d_model": model.hidden,
        "n_layers": model.layers,
        "n_heads": model.heads,
        "vocab_size": model.vocab,
        "moe": moe,
    }


def model_config_of(model: ModelSpec) -> MoEGPTConfig:
    """The training model (:class:`~moesaic.models.config.MoEGPTConfig`) a model file stands
    for (:func:`train_model_table`'s refusals)."""
    return MoEGPTConfig.from_dict(train_model_table(model))
