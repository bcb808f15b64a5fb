"""``hybrid``'s options (``MoEConfig.options`` when ``dispatcher = "hybrid"``):
:class:`HybridOptions`.

Torch-free (its own module, not :mod:`moesaic.strategies.hybrid`, which imports torch): a config
is validated, and ``moesaic plan`` reads the compression ratio, without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moesaic.checks import check_number, check_one_of, check_positive_int
from moesaic.field_flags import FLAG, METAVAR
from moesaic.strategy_options import StrategyOptions

__all__ = ["SHARED_EXPERTS", "HybridOptions"]

# What a compressed gather encodes against (``HybridOptions.shared_expert``).
SHARED_EXPERTS = ("domain", "all", "none")


@dataclass(frozen=True, slots=True, kw_only=True)
class HybridOptions(StrategyOptions):
    """How HybridEP moves experts (``moesaic.strategies.hybrid``).

    Attributes:
        domain_sizes: expert-domain sizes ``S_ED^l`` per level, outermost first (``moesaic
            plan`` chooses them). The levels are those of the layer's cluster description, or
            one level of the whole expert-parallel group when it has none. None: the innermost
            level whole, 1 at the outer ones (``placement.topology.default_domain_sizes``: one
            node's ranks, never a domain across nodes); without a cluster description one
            domain of the whole group (every expert gathered everywhere, tokens never leave
            their rank: the paper's p = 0).
        compression_ratio: CR of the SR compression (``moesaic.placement.compress``) of the
            experts it gathers; 1.0 gathers them exactly.
        shared_expert_every: compressed gathers recompute the shared expert (the domain's mean
            expert: an all-reduce of one expert's size) every this many gathers and reuse it in
            between (1: every gather, as the paper). Encoder and decoder always use the same
            one; a stale one only leaves larger residuals for the top-k to keep.
        shared_expert: what the shared expert of a compressed gather is the mean of:
            "domain" (the experts of this rank's expert domain: an all-reduce over the domain's
            level groups), "all" (every expert of the expert-parallel group, the paper's
            §IV-B: one more all-reduce over the offset group, one rank per domain; the same as
            "domain" when one domain is the whole group) or "none" (no shared expert: the
            top-k of the weights themselves, the paper's "w/o S" ablation of Fig. 14; no
            all-reduce). Only compressed gathers (``compression_ratio > 1``) have one;
            "none" has nothing to recompute, so it takes ``shared_expert_every = 1``.
    """

    domain_sizes: tuple[int, ...] | None = field(
        default=None, metadata={FLAG: "--domains", METAVAR: "auto|S0,S1,..."}
    )
    compression_ratio: float = field(
        default=1.0, metadata={FLAG: "--expert-compression-ratio", METAVAR: "CR"}
    )
    shared_expert_every: int = 1
    shared_expert: str = "domain"

    def __post_init__(self) -> None:
        if self.domain_sizes is not None:
            if isinstance(self.domain_sizes, (str, bytes)) or not isinstance(
                self.domain_sizes, (tuple, list)
            ):
                raise ValueError(
                    f"domain_sizes ({self.domain_sizes!r}) must be a list of positive ints "
                    "(one per cluster level, outermost first) or None"
                )
            object.__setattr__(self, "domain_sizes", tuple(self.domain_sizes))
            if not self.domain_sizes:
                raise ValueError("domain_sizes must not be empty (None: not set)")
            for i, s in enumerate(self.domain_sizes):
                check_positive_int(f"domain_sizes[{i}]", s)
        # one rule for every bad value (nan said ">= 0" while 0.5 said ">= 1"); 1: exact
        check_number("compression_ratio", self.compression_ratio, 1.0)
        check_positive_int("shared_expert_every", self.shared_expert_every)
        check_one_of("shared_expert", self.shared_expert, SHARED_EXPERTS)
        if self.shared_expert != "domain" and self.compression_ratio == 1.0:
            raise ValueError(
                f"shared_expert ({self.shared_expert!r}) applies to compressed gathers only: "
                "set compression_ratio above 1, or leave shared_expert 'domain'"
            )
        if self.shared_expert == "none" and self.shared_expert_every != 1:
            raise ValueError(
                f"shared_expert_every ({self.shared_expert_every}) must be 1 with "
                "shared_expert 'none' (there is no shared expert to recompute)"
            )
