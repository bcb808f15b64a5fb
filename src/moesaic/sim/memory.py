"""Bytes one rank holds while training an ``MoEGPT``: parameters, gradients, AdamW state and a
step's peak, for a plan (EP, FSDP2's ``dp_shard``/``dp_replicate``, prefetch, HybridEP's
domains, activation checkpointing, batch). Torch-free; ``moesaic.train.memory`` measures the
same figures and ``benchmarks/fsdp_memory.py`` sets them side by side.

Elements of the model (``model_elements``, counted from the config): dense (embedding, norms,
attention, routers, shared experts, dense MLPs) and expert (every routed expert's matrices).
Per rank, fp32 (``P``: parameters, as ``train.fsdp`` shards them)::

    P = 4 (dense / (dp_shard x ep) + expert / (ep x dp_shard))     unsharded: dense / 1
    G = P                              gradients (the local shards after the reduce-scatter)
    O = 2 P + 4 x tensors              AdamW's two moments and a 4-byte step per tensor

``dp_replicate`` (HSDP) holds a whole sharded copy per replica: it changes no rank's bytes.
FSDP2 gives a rank whole rows of a tensor's first dimension, so the first ranks may hold one row
more than ``P`` says (0.2% at dp_shard 4 in ``benchmarks/results/fsdp_memory.json``).

A step (the second, AdamW's state present from its start; gradients dropped after each
update) peaks in one of two phases above ``P + O``::

    backward's start   A + T + U               activations still all held
    optimizer step     G + P_matrices          foreach AdamW's sqrt(v) temporaries (one group)

``A``, the activations saved for the backward, per token of the rank's batch and per block
(fp32 elements; the storages ``torch.autograd.graph.saved_tensors_hooks`` sees, tallied on
``models/gpt.py``'s blocks at two shapes and matched within 1.5%): attention 10 D (Q K V in one
3 D storage, the block input, the norms' inputs and outputs, the attention output and its
contiguous copy, the residual) plus one per head (the log-sum-exp) and 4 (the norms'
statistics); an MoE layer 3 D (the router's input, the combine's sum and its weights' rows)
+ 2 k D (the dispatched rows, the expert output rows) + 4 k F (the gate, up, activated and
gated hidden rows) + 2 E (router logits and probabilities) + 8 k (top-k weights, int64
indices and their inverse) + 2; a dense block's MLP 3 Fd + D; the head 2 D + V (final norm in
and out, the logits the loss keeps; below). ``T``, what the backward adds at its peak: at its
start V (the logits' gradient) and the loss's chunk, or in the last block's feed-forward, the
head's tensors freed, gradients of the size of that layer's activations, whichever is larger. With activation checkpointing only
each block's input (D per token) is kept and one block is recomputed at a time. Uniform
routing is assumed: a rank receiving more than its share of the tokens holds more expert rows
(the measured peak is the largest rank's).

``U``, FSDP2's working set (sharded runs): the root unit (embedding, final norm) stays gathered
from the forward through the backward. Entering a block's backward, FSDP2 copies the block's
dense part out of its all-gather's flat buffer (two copies at once) while, with explicit
prefetch, the next block's all-gather (its dense part, router and this EP rank's experts) is
in flight: ``U = root + 2 block + (block + experts)``, without prefetch (``prefetch`` False:
the pipelined schedules) ``root + 2 block``. The backward peaks at its start (``A + 3 V`` per
token ``+ root``) or at a block's (``A +`` the feed-forward's gradients ``+ U``), whichever is
larger. Unsharded: ``U`` = 0.

``gathered``, HybridEP (``domain_size`` S, the product of its domain sizes): a rank caches the
(S - 1) e experts of its domain peers per MoE layer across the step, and holds one layer's S e
gathered gradients in the backward. Not measured yet (hybrid does not run sharded; its
unsharded peak is measured by ``benchmarks/step_memory.py``).

``compute_bytes`` 2 (bf16): activations and FSDP2's gathered units in bf16, the fp32 state as
above (FSDP2's ``MixedPrecisionPolicy``); measured only on CUDA, where it runs.

The loss (``train.lm_loss``) keeps the logits in the compute dtype (V a token, with 3 fp32
elements: its log-sum-exp and int64 target) and makes their gradient in it (V), upcasting one
chunk at a time (``loss_chunk.LOSS_CHUNK_ELEMENTS``: at the backward's start one fp32 chunk,
its softmax, and with half-precision logits their upcast copy too). ``F.cross_entropy(logits.float())``, before it, saved an fp32 log-softmax and
made two fp32 gradients (12 V bytes a token, against 4 V in bf16 now): on an H200 a bf16
Qwen3-MoE step (V 151936) measured 80.6 GiB where this model, pricing those in bf16, said 55.6
(``gpu_train_step_h200.json``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from moesaic.checks import check_bool, check_positive_int
from moesaic.loss_chunk import LOSS_CHUNK_ELEMENTS
from moesaic.models.config import MoEGPTConfig
from moesaic.schedule_table import schedule_spec
from moesaic.sim.model import ModelSpec, model_config_of

__all__ = [
    "MemoryPrediction",
    "ModelElements",
    "StateBytes",
    "model_elements",
    "predict_memory",
    "predict_run",
    "state_bytes",
]

FP32 = 4  # bytes of a parameter, a gradient and each AdamW moment
STEP_BYTES = 4  # AdamW's per-tensor step count (a 0-d float32 tensor)


@dataclass(frozen=True, slots=True)
class ModelElements:
    """An MoEGPT's parameters: dense elements, expert elements (all experts) and tensors;
    ``vectors`` the elements of its 1-D tensors (norms: AdamW's group without decay);
    ``root`` the dense elements of FSDP2's root unit (embeddings, final norm); ``block`` the
    largest block's dense elements (attention, norms, router, shared experts or dense MLP) and
    ``block_experts`` its routed experts' elements (all of them)."""

    dense: int
    expert: int
    tensors: int
    vectors: int
    root: int
    block: int
    block_experts: int


def model_elements(cfg: MoEGPTConfig) -> ModelElements:
    """Count an ``MoEGPT``'s parameters from its config, without building it (torch-free):
    the tied byte embedding (and learned positions), every block's two norms, attention (QKV
    and output, no biases), and its router, routed experts (3 matrices for SwiGLU, 2 for GELU)
    and shared experts, or its dense SwiGLU MLP; the final norm (LayerNorm: weight and bias)."""
    D, moe = cfg.d_model, cfg.moe
    norm_tensors = 1 if cfg.norm == "rmsnorm" else 2
    root = cfg.vocab_size * D + norm_tensors * D
    tensors, vectors = 1 + norm_tensors, norm_tensors * D
    if cfg.positions == "learned":
        root, tensors = root + cfg.seq_len * D, tensors + 1
    dense, expert, block, block_experts = root, 0, 0, 0
    for i in range(cfg.n_layers):
        here = 2 * norm_tensors * D + 4 * D * D
        tensors += 2 * norm_tensors + 2
        vectors += 2 * norm_tensors * D
        experts_here = 0
        if cfg.is_moe_block(i):
            mats = 3 if moe.activation == "swiglu" else 2
            here += moe.num_experts * D  # the router
            experts_here = mats * moe.num_experts * D * moe.ffn_hidden_size
            tensors += 1 + mats
            if moe.num_shared_experts:
                gate = D if moe.shared_expert_gate else 0
                here += 3 * D * moe.shared_hidden + gate
                tensors += 3 + bool(gate)
        else:
            here += 3 * D * (cfg.dense_hidden or 4 * D)
            tensors += 3
        dense, expert = dense + here, expert + experts_here
        if here + experts_here > block + block_experts:
            block, block_experts = here, experts_here
    return ModelElements(
        dense=dense,
        expert=expert,
        tensors=tensors,
        vectors=vectors,
        root=root,
        block=block,
        block_experts=block_experts,
    )


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Predicted bytes one rank holds of fp32 parameters, gradients and AdamW state."""

    params: float
    grads: float
    optimizer: float


def _shards(ep: int, dp_shard: int | None) -> tuple[int, int]:
    """(ranks the dense part is sharded over, ranks each expert's bytes are split over)."""
    check_positive_int("ep", ep)
    if dp_shard is None:
        return 1, ep
    check_positive_int("dp_shard", dp_shard)
    return dp_shard * ep, ep * dp_shard


def state_bytes(cfg: MoEGPTConfig, *, ep: int, dp_shard: int | None) -> StateBytes:
    """``P``, ``G`` and ``O`` of the module docstring: what ``train.memory.memory_bytes``
    measures after the first optimizer step. ``dp_shard`` None: not sharded (every rank holds
    the whole dense part; EP alone splits the experts)."""
    n = model_elements(cfg)
    dense_ranks, expert_ranks = _shards(ep, dp_shard)
    params = FP32 * (n.dense / dense_ranks + n.expert / expert_ranks)
    return StateBytes(params=params, grads=params, optimizer=2 * params + STEP_BYTES * n.tensors)


@dataclass(frozen=True, slots=True)
class MemoryPrediction:
    """One rank's predicted bytes (module docstring).

    Attributes:
        params, grads, optimizer: ``P``, ``G``, ``O``.
        activations: ``A`` (the activations saved for the backward, at its start).
        transient: ``T`` (the backward's first gradients of activations).
        fsdp_gathered: ``U`` (FSDP2's gathered units at the backward's start; 0 unsharded).
        gathered_experts: HybridEP's cached and gathered experts and their gradients.
        optimizer_temp: foreach AdamW's temporaries (the larger parameter group's bytes).
        peak: ``P + O + max(backward's start, optimizer step)`` (+ HybridEP's).
        phase: "backward" or "optimizer": where the peak is.
    """

    params: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    fsdp_gathered: float
    gathered_experts: float
    optimizer_temp: float
    peak: float
    phase: str

    def to_dict(self) -> dict[str, float | str]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


LOSS_SAVED_FP32 = 3  # per token, fp32 elements the loss saves: the log-sum-exp, the int64 target


def _moe_layers(cfg: MoEGPTConfig) -> int:
    return sum(cfg.is_moe_block(i) for i in range(cfg.n_layers))


def _activation_elements(
    cfg: MoEGPTConfig, checkpointing: bool
) -> tuple[float, float, float, float]:
    """Per token, in elements: ``A`` in the compute dtype, ``A``'s fp32 part (the loss's),
    ``T`` at the head (compute dtype; the loss's chunk besides: ``predict_memory``), and the
    last block's feed-forward activations less the head's (``T`` there: those gradients less
    the freed head). Uniform routing (a rank's expert rows are its tokens' k rows on average,
    whatever EP)."""
    D, moe = cfg.d_model, cfg.moe
    k, E, F = moe.top_k, moe.num_experts, moe.ffn_hidden_size
    blocks, ffn_largest, block_largest = 0.0, 0.0, 0.0
    for i in range(cfg.n_layers):
        attention = 10 * D + cfg.n_heads + 4  # (module docstring)
        if cfg.is_moe_block(i):
            ffn = 3 * D + 2 * k * D + 4 * k * F + 2 * E + 8 * k + 2
            if moe.num_shared_experts:
                ffn += 3 * moe.shared_hidden + D
        else:
            ffn = 3 * (cfg.dense_hidden or 4 * D) + D
        blocks += attention + ffn
        ffn_largest = max(ffn_largest, ffn)
        block_largest = max(block_largest, attention + ffn)
    if checkpointing:  # each block's input, and one block recomputed at a time
        blocks = cfg.n_layers * D + block_largest
    V = cfg.vocab_size
    head = 2 * D + V  # the final norm's input and output, the logits the loss keeps
    # at the backward's start: the logits' gradient (V); in the last block's feed-forward, the
    # head's tensors freed, gradients of the size of its activations
    return blocks + head, LOSS_SAVED_FP32, V, ffn_largest - head


def predict_memory(
    cfg: MoEGPTConfig,
    *,
    batch_size: int,
    ep: int,
    dp_shard: int | None = None,
    prefetch: bool = True,
    activation_checkpointing: bool = False,
    domain_size: int = 1,
    compute_bytes: int = FP32,
) -> MemoryPrediction:
    """One rank's bytes in a steady training step (module docstring).

    Args:
        cfg: the model.
        batch_size: sequences per rank per step (``seq_len`` tokens each).
        ep: expert parallelism.
        dp_shard: FSDP2's degree beside EP (``--dp-shard``); None: not sharded.
        prefetch: FSDP2's explicit prefetch (two block units gathered at once).
        activation_checkpointing: keep each block's input only.
        domain_size: HybridEP's ranks per expert domain (1: no gathered experts).
        compute_bytes: 4 (fp32) or 2 (bf16 compute).

    Raises:
        ValueError: one line naming the parameter and the rule.
    """
    check_positive_int("batch_size", batch_size)
    check_bool("prefetch", prefetch)
    check_bool("activation_checkpointing", activation_checkpointing)
    check_positive_int("domain_size", domain_size)
    if compute_bytes not in (2, 4):
        raise ValueError(f"compute_bytes ({compute_bytes!r}) must be 2 (bf16) or 4 (fp32)")
    if ep % domain_size and domain_size % ep:
        raise ValueError(f"domain_size ({domain_size}) must divide ep ({ep})")
    n = model_elements(cfg)
    state = state_bytes(cfg, ep=ep, dp_shard=dp_shard)
    dense_ranks, expert_ranks = _shards(ep, dp_shard)
    tokens = batch_size * cfg.seq_len
    per_token, per_token_fp32, at_head, in_block = _activation_elements(
        cfg, activation_checkpointing
    )
    activations = tokens * (compute_bytes * per_token + FP32 * per_token_fp32)
    root = blocks = 0.0
    if dp_shard is not None:
        root = compute_bytes * n.root
        blocks = 2 * compute_bytes * n.block  # copied out of the flat buffer: two copies
        if prefetch:  # the next block's all-gather in flight: its dense part and its experts
            blocks += compute_bytes * (n.block + n.block_experts / ep)
    # the backward's start (the root unit gathered), or a block's (module docstring)
    # the loss's backward: one fp32 chunk (the softmax), two from half logits (their upcast too)
    chunks = 1 if compute_bytes == FP32 else 2
    at_head_b = compute_bytes * tokens * at_head + chunks * FP32 * min(
        LOSS_CHUNK_ELEMENTS, tokens * cfg.vocab_size
    )
    at_head_u = root
    in_block_b = tokens * max(0.0, compute_bytes * in_block - FP32 * per_token_fp32)
    in_block_u = root + blocks
    transient_b, gathered = (
        (at_head_b, at_head_u)
        if at_head_b + at_head_u >= in_block_b + in_block_u
        else (in_block_b, in_block_u)
    )
    local_experts_per_layer = n.block_experts / ep  # elements of one layer's local experts
    hybrid = 0.0
    if domain_size > 1:
        moe_layers = _moe_layers(cfg)
        hybrid = FP32 * local_experts_per_layer * ((domain_size - 1) * moe_layers + domain_size)
    matrices = n.dense - n.vectors  # AdamW's decay group: every tensor of 2 or more dims
    opt_temp = FP32 * max(matrices / dense_ranks + n.expert / expert_ranks, n.vectors / dense_ranks)
    backward = activations + transient_b + gathered
    optimizer_phase = state.grads + opt_temp
    phase = "backward" if backward >= optimizer_phase else "optimizer"
    peak = state.params + state.optimizer + max(backward, optimizer_phase) + hybrid
    return MemoryPrediction(
        params=state.params,
        grads=state.grads,
        optimizer=state.optimizer,
        activations=activations,
        transient=transient_b,
        fsdp_gathered=gathered,
        gathered_experts=hybrid,
        optimizer_temp=opt_temp,
        peak=peak,
        phase=phase,
    )


def predict_run(
    model: ModelSpec,
    strategy: str,
    schedule: str,
    ep: int,
    *,
    domain_sizes: Sequence[int] | None = None,
    dp_shard: int | None = None,
) -> MemoryPrediction:
    """The per-rank memory of ``model`` trained by ``strategy`` under ``schedule`` at ``ep``
    (:func:`predict_memory`): HybridEP's domains, the schedule's prefetch
    (none when pipelined), the model's ``act_bytes`` as the compute dtype.

    Raises:
        ValueError: a model a training config cannot express (``model_config_of``).
    """
    return predict_memory(
        model_config_of(model),
        batch_size=model.batch,
        ep=ep,
        dp_shard=dp_shard,
        prefetch=not schedule_spec(schedule).pipelined,
        domain_size=math.prod(domain_sizes) if strategy == "hybrid" and domain_sizes else 1,
        compute_bytes=model.act_bytes if model.act_bytes in (2, 4) else 4,
    )
