"""Configuration dataclasses, validated when built.

Every field is checked in ``__post_init__`` and a bad value raises ``ValueError`` naming the field
and the rule, so that a wrong config fails at construction time on every rank, never as a shape
error (or a hang) deep inside a collective.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from moesaic.checks import (
    check_bool,
    check_int,
    check_non_negative,
    check_one_of,
    check_positive,
    check_positive_int,
)
from moesaic.field_flags import ALIASES, FLAG, METAVAR
from moesaic.kernels import KERNELS, require_triton
from moesaic.strategy_options import StrategyOptions
from moesaic.strategy_table import options_class, strategy_names

__all__ = [
    "ACTIVATIONS",
    "SCORE_FUNCS",
    "MoEConfig",
    "capacity_slots",
    "check_positive_int",
    "check_top_k",
]

SCORE_FUNCS = ("softmax", "sigmoid")
ACTIVATIONS = ("swiglu", "gelu")
BALANCE_CHOICES = ("all", "first")
BALANCE_SCOPES = ("local", "global")
OptionsT = TypeVar("OptionsT", bound=StrategyOptions)


def capacity_slots(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """The capacity rule, the one place it is written: ``ceil(cf * T * K / E)`` token slots per
    expert for ``T`` tokens of one source rank routed ``K`` ways over ``E`` experts (the layer,
    the taskflow layout and the simulator's padded exchange all call this)."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def check_top_k(
    top_k: int, experts: int, *, names: tuple[str, str] = ("top_k", "num_experts")
) -> None:
    """The one ``top_k <= experts`` rule (a token picks ``top_k`` distinct experts), the two
    values named as their caller calls them."""
    if top_k > experts:
        raise ValueError(f"{names[0]} ({top_k}) must be <= {names[1]} ({experts})")


def _strategies() -> str:
    return "|".join(strategy_names())


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """Shape and behaviour of one MoE feed-forward layer.

    Attributes:
        hidden_size: H, the model width (input and output of the layer).
        ffn_hidden_size: F, the hidden width of each expert.
        num_experts: E, the number of routed experts (all ranks together).
        top_k: K, experts per token.
        score_func: "softmax" (Mixtral, Switch) or "sigmoid" (DeepSeek-V3) router scores.
        normalize_topk: rescale the K selected scores to sum to 1.
        capacity_factor: None = dropless. A value cf > 0 gives every expert a capacity of
            ``ceil(cf * T * K / E)`` token slots per source rank (T = that rank's tokens); the
            assignments past it are dropped (kept in token order, see ``routing.py``).
        activation: "swiglu" (``w2(silu(x w1) * (x w3))``) or "gelu" (``w2(gelu(x w1))``).
        aux_loss_coef: weight of the GShard/Switch load-balancing loss.
        z_loss_coef: weight of the router z-loss (ST-MoE).
        dispatcher: the execution strategy, a name of ``moesaic.strategy_table.strategy_names()``:
            "dropless" (all-to-all-v of routed tokens only), "padded" (capacity all-to-all
            with zero padding, the GShard/DeepSpeed baseline), "hybrid" (HybridEP: experts
            move inside domains) and "taskflow" (compiled tile plans on a concurrent executor
            with one-sided puts) built in.
        collective_timeout_s: every collective the layer issues fails with a clear error after
            this many seconds instead of hanging.
        init_std: std of the normal init of the router; experts use 1/sqrt(fan_in). None: 0.02.
        renormalize_after_drop: after capacity drops, rescale a token's kept top-k weights to
            their original sum (DeepSpeed-MoE does this); False keeps the original weights
            (GShard, Megatron, Tutel: a dropped choice just contributes zero).
        balance_loss_choices: "all" counts all K choices in the load fractions of the balance
            loss (Switch/Megatron); "first" counts first choices only (DeepSpeed-MoE, GShard).
        num_shared_experts: dense SwiGLU experts every token passes through (DeepSeek-MoE,
            Qwen2-MoE), added to the routed output; replicated like the router (their gradients
            all-reduce with the dense parameters). 0: none.
        shared_expert_hidden_size: hidden width of each shared expert; None: ``ffn_hidden_size``.
        shared_expert_gate: multiply the shared output by ``sigmoid(x @ g)`` (Qwen2-MoE's gate,
            a learned [1, H] vector); needs ``num_shared_experts > 0``.
        score_bias_update_rate: gamma of DeepSeek-V3's auxiliary-loss-free balancing. A
            per-expert bias (buffer ``router.score_bias``) is added to the scores for the top-k
            choice only (never to the combine weights); after each optimizer step
            ``bias += gamma * sign(mean_load - load_e)`` with the step's loads over every rank
            and forward (``MoELayer.update_score_bias``). 0: off (no bias).
        num_expert_groups: G, DeepSeek-V3's group-limited routing: the E experts split into G
            consecutive groups of E / G; 1: off.
        topk_groups: a token keeps the ``topk_groups`` groups with the highest sum of their two
            best (choice) scores and picks its top-k experts inside them; None: all G groups.
        routed_scaling_factor: multiplies the routed combine weights (after any
            ``normalize_topk``; DeepSeek-V2/V3). Shared experts are not scaled.
        seq_aux_loss_coef: weight of DeepSeek-V3's complementary sequence-wise balance loss:
            the balance loss of each sequence (the input's second-to-last dimension is the
            sequence; a 2-D input is one sequence), then the mean over sequences.
        balance_loss_scope: "local": the balance loss' load fractions f_e count this rank's
            tokens; "global": every rank's tokens of the step (the counts all-reduced over
            the layer's balance group, by default the whole world: Qwen3's global-batch
            balancing). Both are exact when a batch is split into microbatches or chunks.
        options: the options of the ``dispatcher`` (``moesaic.strategy_options``): its own
            dataclass (``HybridOptions``: domain sizes, compression; ``TaskflowOptions``:
            executor, tile rows; an empty ``StrategyOptions`` for a strategy without options),
            or a dict of its fields (a TOML ``[model.moe.options]`` table), or None for its
            defaults. Another strategy's options are refused; after construction it is always
            the dispatcher's options class (``options_as`` reads it typed).
        kernels: the expert path's implementation (``moesaic.kernels``): "torch" (plain
            torch), "triton" (every kernel from ``moesaic.kernels``: permute, grouped GEMMs
            with SwiGLU fused into the first, combine), "fused" (the library's grouped GEMMs,
            ``moesaic.kernels``' permute, SwiGLU and combine around them) or "auto" (the
            default: "fused" on a CUDA device with Triton installed, "torch" elsewhere).
            "triton" and "fused" need Triton, which is not a dependency of moesaic.
    """

    hidden_size: int = field(metadata={FLAG: None})  # a model's width sets it
    ffn_hidden_size: int = field(metadata={FLAG: "--expert-hidden"})
    num_experts: int = field(metadata={FLAG: "--experts"})
    top_k: int = 2
    score_func: str = "softmax"
    normalize_topk: bool = True
    capacity_factor: float | None = None
    activation: str = "swiglu"
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    dispatcher: str = field(
        default="dropless",
        metadata={FLAG: "--strategy", ALIASES: ("--dispatcher",), METAVAR: _strategies},
    )
    collective_timeout_s: float = field(default=300.0, metadata={FLAG: None})  # a run's timeout_s
    init_std: float | None = None
    renormalize_after_drop: bool = False
    balance_loss_choices: str = "all"
    num_shared_experts: int = field(default=0, metadata={FLAG: "--shared-experts"})
    shared_expert_hidden_size: int | None = field(
        default=None, metadata={FLAG: "--shared-expert-hidden"}
    )
    shared_expert_gate: bool = False
    score_bias_update_rate: float = 0.0
    num_expert_groups: int = field(default=1, metadata={FLAG: "--expert-groups"})
    topk_groups: int | None = None
    routed_scaling_factor: float = 1.0
    seq_aux_loss_coef: float = 0.0
    balance_loss_scope: str = "local"
    options: StrategyOptions | Mapping[str, Any] | None = None
    kernels: str = "auto"

    def __post_init__(self) -> None:
        check_positive_int("hidden_size", self.hidden_size)
        check_positive_int("ffn_hidden_size", self.ffn_hidden_size)
        check_positive_int("num_experts", self.num_experts)
        check_positive_int("top_k", self.top_k)
        check_top_k(self.top_k, self.num_experts)
        check_one_of("score_func", self.score_func, SCORE_FUNCS)
        check_one_of("activation", self.activation, ACTIVATIONS)
        check_one_of("dispatcher", self.dispatcher, strategy_names())
        check_bool("normalize_topk", self.normalize_topk)
        if self.capacity_factor is not None:
            check_non_negative("capacity_factor", self.capacity_factor)
            if self.capacity_factor <= 0:
                raise ValueError(
                    f"capacity_factor ({self.capacity_factor}) must be > 0, or None for dropless"
                )
        check_non_negative("aux_loss_coef", self.aux_loss_coef)
        check_non_negative("z_loss_coef", self.z_loss_coef)
        check_non_negative("collective_timeout_s", self.collective_timeout_s)
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s ({self.collective_timeout_s}) must be > 0")
        if self.init_std is not None:
            check_non_negative("init_std", self.init_std)
        check_bool("renormalize_after_drop", self.renormalize_after_drop)
        check_one_of("balance_loss_choices", self.balance_loss_choices, BALANCE_CHOICES)
        self._check_routing_features()
        self._resolve_options()
        check_one_of("kernels", self.kernels, KERNELS)
        if self.kernels in ("triton", "fused"):
            require_triton()

    def _resolve_options(self) -> None:
        """``options`` -> an instance of the dispatcher's options class (None or an empty
        ``StrategyOptions``: its defaults; a dict: its fields)."""
        cls = options_class(self.dispatcher)
        opts = self.options
        if opts is None or type(opts) is StrategyOptions:
            self.options = cls()
        elif isinstance(opts, StrategyOptions):
            if type(opts) is not cls:
                raise ValueError(
                    f"options ({type(opts).__name__}) are not those of dispatcher "
                    f"{self.dispatcher!r} ({cls.__name__}): give its own, or None for its "
                    "defaults (dataclasses.replace of the dispatcher needs options=None too)"
                )
        elif isinstance(opts, Mapping):
            self.options = cls.from_dict(opts, strategy=self.dispatcher)
        else:
            raise ValueError(
                f"options ({opts!r}) must be the dispatcher's options ({cls.__name__}), a dict "
                "of its fields, or None"
            )

    def options_as(self, cls: type[OptionsT]) -> OptionsT:
        """``options``, typed as the options class ``cls`` of the dispatcher.

        Raises:
            TypeError: the dispatcher's options are not ``cls`` (another strategy's config).
        """
        if not isinstance(self.options, cls):
            raise TypeError(
                f"dispatcher {self.dispatcher!r} has options {type(self.options).__name__}, "
                f"not {cls.__name__}"
            )
        return self.options

    def _check_routing_features(self) -> None:
        """Shared experts, bias balancing, group-limited routing, scaling, sequence loss."""
        check_int("num_shared_experts", self.num_shared_experts, 0)
        if self.shared_expert_hidden_size is not None:
            check_positive_int("shared_expert_hidden_size", self.shared_expert_hidden_size)
        check_bool("shared_expert_gate", self.shared_expert_gate)
        if self.shared_expert_gate and self.num_shared_experts == 0:
            raise ValueError("shared_expert_gate (True) needs num_shared_experts > 0, got 0")
        check_non_negative("score_bias_update_rate", self.score_bias_update_rate)
        check_positive_int("num_expert_groups", self.num_expert_groups)
        if self.num_experts % self.num_expert_groups:
            raise ValueError(
                f"num_expert_groups ({self.num_expert_groups}) must divide num_experts "
                f"({self.num_experts})"
            )
        if self.topk_groups is not None:
            check_int("topk_groups", self.topk_groups, 1, self.num_expert_groups)
            reachable = self.topk_groups * (self.num_experts // self.num_expert_groups)
            if self.top_k > reachable:
                raise ValueError(
                    f"top_k ({self.top_k}) must be <= topk_groups ({self.topk_groups}) x experts "
                    f"per group ({self.num_experts // self.num_expert_groups}) = {reachable}"
                )
        check_positive("routed_scaling_factor", self.routed_scaling_factor)
        check_non_negative("seq_aux_loss_coef", self.seq_aux_loss_coef)
        check_one_of("balance_loss_scope", self.balance_loss_scope, BALANCE_SCOPES)

    @property
    def shared_hidden(self) -> int:
        """Hidden width of all shared experts together (they run as one SwiGLU); 0: none."""
        per_expert = self.shared_expert_hidden_size or self.ffn_hidden_size
        return self.num_shared_experts * per_expert

    def capacity(self, num_tokens: int) -> int | None:
        """Token slots per expert for ``num_tokens`` local tokens; None when dropless."""
        if self.capacity_factor is None:
            return None
        return capacity_slots(self.capacity_factor, num_tokens, self.top_k, self.num_experts)

    def check_ep_size(self, ep_size: int) -> None:
        """Raise unless ``num_experts`` splits evenly over ``ep_size`` ranks."""
        check_positive_int("ep_size", ep_size)
        if self.num_experts % ep_size:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by the expert-parallel "
                f"size ({ep_size})"
            )
