"""Per-operation compute measurements of one model, and the rule that prices a simulated task
from them (``moesaic calibrate --model``; :mod:`moesaic.measure.opmeasure` measures).

One rate for every FLOP (a hot ``512^3`` GEMM) prices the small, overhead-bound operations of a
CPU training step 3-4x too fast (issue 24: 87 ms simulated against ~355 ms measured for H 160,
F 1536 on one core), and it cannot see that cutting a batch into R chunks pays every operation's
fixed cost R times. So ``calibrate --model`` times the model's own pieces (one block of the real
``MoEGPT``, one thread per rank as training runs them) and the simulator prices each task from
them:

* ``attention`` (per token): the block's attention stage (norm, QKV, causal attention, output
  projection, residual, the norm before the MoE layer): the ``AT`` task;
* ``moe_local`` (per token): the MoE layer's own work besides the expert GEMMs (the router's gate,
  softmax and top-k, the permutation to expert order and back, the weighted combine, the
  residual): measured as the whole expert stage at one rank minus its expert GEMMs, charged to
  ``AT`` (it runs on the compute thread next to it);
* ``experts`` (per routed row): the grouped expert GEMMs with the activation, at the rank's
  ``expert_count`` experts: the ``E`` task;
* ``head`` (per token): final norm, output projection, cross-entropy;
* ``optimizer`` (per parameter byte): the gradients' norm and AdamW's step;

each forward and backward separately (the backward is not assumed to be twice the forward).

**The scaling rule.** Each piece is timed at two sizes and fitted as ``t(n) = overhead_s +
per_unit_s * n`` (:class:`OpFit`: the line through the two medians, with both coefficients
clamped at >= 0), ``n`` the tokens (rows, bytes) of the task. A chunk of ``n / R`` tokens thus
costs ``overhead_s + per_unit_s * n / R``: R chunks pay the fixed part R times, which is what
makes a pipelined schedule's chunks dearer on a CPU.

**Another model.** A profile records the model it measured (:attr:`OpCal.model`). Priced for
another model (:class:`OpPrices`), each piece keeps its ``overhead_s`` (the same operations run,
whatever their size) and scales its ``per_unit_s`` by the ratio of the two models' FLOPs per unit
(attention and gate FLOPs per token, expert FLOPs per row, head FLOPs per token; ``moe_local``
by ``hidden x top_k``, the elements it moves per token; the optimizer not at all): the measured
rate of each piece is assumed to hold at the other shape. :attr:`OpPrices.notes` says which
fields differ, so a result shows what was extrapolated. Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from moesaic.checks import check_non_negative, check_positive, check_positive_int
from moesaic.sim.model import ModelSpec

__all__ = ["OPS", "SHAPE_FIELDS", "OpCal", "OpFit", "OpPrices", "fit_line"]

# The measured pieces, each with a forward and a backward fit.
OPS = ("attention", "moe_local", "experts", "head")

# ModelSpec fields that change an operation's shape (batch and layers only change how many).
SHAPE_FIELDS = (
    "seq_len",
    "hidden",
    "ffn_hidden",
    "experts",
    "top_k",
    "heads",
    "vocab",
    "activation",
)


@dataclass(kw_only=True, slots=True, frozen=True)
class OpFit:
    """``seconds(n) = overhead_s + per_unit_s * n``: one operation's time at size ``n``."""

    overhead_s: float
    per_unit_s: float

    def __post_init__(self) -> None:
        check_non_negative("overhead_s", self.overhead_s)
        check_non_negative("per_unit_s", self.per_unit_s)

    def seconds(self, n: float) -> float:
        return self.overhead_s + self.per_unit_s * n

    def scaled(self, factor: float) -> OpFit:
        """The same fixed cost, ``per_unit_s`` times ``factor``."""
        return dataclasses.replace(self, per_unit_s=self.per_unit_s * factor)

    def slowed(self, factor: float) -> OpFit:
        """Both coefficients times ``factor``: the operation on a machine ``factor`` times
        slower."""
        return OpFit(overhead_s=self.overhead_s * factor, per_unit_s=self.per_unit_s * factor)


def fit_line(n1: float, t1: float, n2: float, t2: float) -> OpFit:
    """The line through ``(n1, t1)`` and ``(n2, t2)`` (``n1 < n2``), both coefficients clamped
    at 0: a slope below 0 (noise: the larger size measured faster) gives the mean time as a
    fixed cost; an intercept below 0 gives the line through the origin and the larger point."""
    check_positive("n1", n1)
    if not n2 > n1:
        raise ValueError(f"n2 ({n2}) must be > n1 ({n1})")
    check_non_negative("t1", t1)
    check_non_negative("t2", t2)
    slope = (t2 - t1) / (n2 - n1)
    if slope <= 0:
        return OpFit(overhead_s=(t1 + t2) / 2, per_unit_s=0.0)
    overhead = t1 - slope * n1
    if overhead < 0:
        return OpFit(overhead_s=0.0, per_unit_s=t2 / n2)
    return OpFit(overhead_s=overhead, per_unit_s=slope)


@dataclass(kw_only=True, slots=True, frozen=True)
class OpCal:
    """One model's operations measured on this machine (see the module docstring).

    Attributes:
        model: The measured :class:`ModelSpec`.
        threads: Torch threads the pieces ran with (training's per-rank threads).
        expert_count: Experts per rank the expert GEMMs were timed with (``experts / world``).
        tokens: The two token counts each per-token piece was timed at.
        fwd: Forward fit per piece (``OPS``): per token, ``experts`` per routed row.
        bwd: Backward fit per piece.
        optimizer: the gradients' norm and AdamW's step, per parameter byte.
        op_overhead_s: One tiny torch op (a 1 x 1 matmul), for the record.
        reference_s: The speed reference timed with the pieces: one forward and backward of
            block 0's attention stage, expert stage and the head at the model's batch
            (:func:`moesaic.measure.opmeasure.reference_s`). Timed again later, it says how much
            faster or slower the machine runs than when the pieces were measured
            (:mod:`moesaic.measure.retime`); 0: not measured (older profiles).
        device: Where the pieces ran (``measure_ops`` runs them on the CPU): the ``padded``
            strategy skips its padding rows there (``strategies.padded``), so the simulator
            prices its experts on the kept rows only.
    """

    model: ModelSpec
    threads: int
    expert_count: int
    tokens: tuple[int, int]
    fwd: Mapping[str, OpFit]
    bwd: Mapping[str, OpFit]
    optimizer: OpFit
    op_overhead_s: float = 0.0
    reference_s: float = 0.0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelSpec):
            raise ValueError("ops.model must be a ModelSpec")
        check_positive_int("ops.threads", self.threads)
        check_positive_int("ops.expert_count", self.expert_count)
        check_non_negative("ops.op_overhead_s", self.op_overhead_s)
        check_non_negative("ops.reference_s", self.reference_s)
        for name, table in (("fwd", self.fwd), ("bwd", self.bwd)):
            if set(table) != set(OPS) or not all(isinstance(x, OpFit) for x in table.values()):
                raise ValueError(f"ops.{name} must map each of {list(OPS)} to an OpFit")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": dataclasses.asdict(self.model),
            "threads": self.threads,
            "expert_count": self.expert_count,
            "tokens": list(self.tokens),
            "fwd": {k: dataclasses.asdict(v) for k, v in self.fwd.items()},
            "bwd": {k: dataclasses.asdict(v) for k, v in self.bwd.items()},
            "optimizer": dataclasses.asdict(self.optimizer),
            "op_overhead_s": self.op_overhead_s,
            "reference_s": self.reference_s,
            "device": self.device,
        }

    def slowed(self, factor: float) -> OpCal:
        """Every measured time (the fits, the tiny op, the reference) times ``factor``: the
        same operations on the machine running ``factor`` times slower."""
        check_positive("factor", factor)
        return dataclasses.replace(
            self,
            fwd={k: v.slowed(factor) for k, v in self.fwd.items()},
            bwd={k: v.slowed(factor) for k, v in self.bwd.items()},
            optimizer=self.optimizer.slowed(factor),
            op_overhead_s=self.op_overhead_s * factor,
            reference_s=self.reference_s * factor,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OpCal:
        """From :meth:`to_dict`'s layout; errors name the field (``profile.ops.<field>``)."""
        if not isinstance(data, Mapping):
            raise ValueError("profile.ops must be an object")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(allowed))
        missing = sorted(set(allowed) - set(data) - {"op_overhead_s", "reference_s", "device"})
        if unknown or missing:
            raise ValueError(
                f"profile.ops: unknown field(s) {unknown}, missing {missing}; fields are {allowed}"
            )
        try:
            model = ModelSpec(**data["model"])
            tokens = tuple(int(x) for x in data["tokens"])
            fwd = {k: OpFit(**v) for k, v in data["fwd"].items()}
            bwd = {k: OpFit(**v) for k, v in data["bwd"].items()}
            optimizer = OpFit(**data["optimizer"])
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"profile.ops: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"profile.ops: {exc}") from None
        if len(tokens) != 2:
            raise ValueError(f"profile.ops.tokens must hold two counts, got {list(tokens)}")
        return cls(
            model=model,
            threads=data["threads"],
            expert_count=data["expert_count"],
            tokens=(tokens[0], tokens[1]),
            fwd=fwd,
            bwd=bwd,
            optimizer=optimizer,
            op_overhead_s=data.get("op_overhead_s", 0.0),
            reference_s=data.get("reference_s", 0.0),
            device=str(data.get("device", "cpu")),
        )


def _ratio(new: float, old: float) -> float:
    return new / old if old > 0 else 1.0


class OpPrices:
    """Task seconds of ``model`` from ``cal``: the measured fits, scaled per unit by the FLOP
    ratio where ``model``'s shape differs from the measured one (module docstring).

    Attributes:
        notes: What was extrapolated (empty: the measured model's shape).
    """

    def __init__(self, cal: OpCal, model: ModelSpec):
        self.cal, self.model = cal, model
        old = dataclasses.replace(cal.model, layer_only=False)
        new = dataclasses.replace(model, layer_only=False)
        factors = {
            "attention": _ratio(new.attention_flops(1), old.attention_flops(1)),
            "moe_local": _ratio(new.hidden * new.top_k, old.hidden * old.top_k),
            "experts": _ratio(new.expert_flops(1), old.expert_flops(1)),
            "head": _ratio(new.head_flops(1), old.head_flops(1)),
        }
        self.fwd = {k: cal.fwd[k].scaled(factors[k]) for k in OPS}
        self.bwd = {k: cal.bwd[k].scaled(factors[k]) for k in OPS}
        diffs = [
            f"{f} {getattr(cal.model, f)} vs {getattr(model, f)}"
            for f in SHAPE_FIELDS
            if getattr(cal.model, f) != getattr(model, f)
        ]
        self.notes: list[str] = []
        if diffs:
            scaled = ", ".join(f"{k} x{v:.3g}" for k, v in factors.items() if v != 1.0)
            self.notes.append(
                f"compute measured on model {cal.model.name!r}, extrapolated to "
                f"{model.name!r} ({'; '.join(diffs)}): per-unit times scaled by the FLOP "
                f"ratio ({scaled or 'none'}), fixed costs kept"
            )

    def stage_s(self, tokens: float, *, backward: bool = False) -> float:
        """The ``AT`` task: attention (none when ``layer_only``) and the MoE layer's local
        work for ``tokens`` tokens."""
        fits = self.bwd if backward else self.fwd
        local = fits["moe_local"].seconds(tokens)
        if self.model.layer_only:
            return local
        return fits["attention"].seconds(tokens) + local

    def expert_s(self, rows: float, *, backward: bool = False) -> float:
        """The ``E`` task: the expert GEMMs of ``rows`` routed rows."""
        return (self.bwd if backward else self.fwd)["experts"].seconds(rows)

    def head_s(self, tokens: float, *, backward: bool = False) -> float:
        """The head of ``tokens`` tokens (0 when ``layer_only``)."""
        if self.model.layer_only:
            return 0.0
        return (self.bwd if backward else self.fwd)["head"].seconds(tokens)

    def optimizer_s(self, param_bytes: float) -> float:
        """AdamW's step over ``param_bytes`` bytes of parameters."""
        return self.cal.optimizer.seconds(param_bytes)
