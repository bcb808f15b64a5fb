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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from moesaic.checks import check_bool, check_number, check_one_of, check_positive_int, read_toml

__all__ = ["ModelSpec", "expert_shares"]


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
        if self.top_k > self.experts:
            raise ValueError(f"model.top_k ({self.top_k}) must be <= model.experts")
        if self.hidden % self.heads:
            raise ValueError(f"model.hidden ({self.hidden}) must be divisible by model.heads")
        check_number("model.capacity_factor", self.capacity_factor, 0.0, 1e3)
        check_number("model.routing_skew", self.routing_skew, 0.0, 10.0)
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
        gate = 2.0 * tokens * H * self.experts
        if self.layer_only:
            return gate
        qkv_o = 2.0 * tokens * H * 4 * H
        scores = 2.0 * 2 * tokens * self.seq_len * H / 2  # causal: half the square
        return qkv_o + scores + gate

    def expert_flops(self, rows: float) -> float:
        """Forward FLOPs of ``rows`` routed rows through their experts."""
        return self.mats * 2.0 * rows * self.hidden * self.ffn_hidden

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

    def head_params(self) -> int:
        return self.vocab * self.hidden

    def expert_param_bytes(self) -> int:
        """Bytes of one expert's weights."""
        return self.mats * self.hidden * self.ffn_hidden * self.param_bytes


def expert_shares(model: ModelSpec) -> list[float]:
    """Share of routed rows each expert receives: Zipf(``routing_skew``), uniform at 0.

    With a capacity factor, an expert's share is capped at ``cf / E`` of the rows and the
    rest is dropped (the shares then sum to less than 1).
    """
    E = model.experts
    w = [(e + 1) ** -model.routing_skew for e in range(E)]
    total = math.fsum(w)
    shares = [x / total for x in w]
    if model.capacity_factor > 0:
        cap = model.capacity_factor / E
        shares = [min(s, cap) for s in shares]
    return shares
