"""The per-rank memory model (``moesaic.sim.memory``) against built models and measured
steps.

Element counts are exact (deterministic). The peak is compared with ``LiveBytes``'s count of a
real step's live tensors in one process (EP 1, unsharded; the sharded runs' peaks are checked
end to end in ``tests/train/test_fsdp_resume.py``) within 10%, the issue's bound for the
prediction: the model counts the saved activations from the code's ops but assumes uniform
routing, and the measurement also holds what the model leaves out (the batch, buffers).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from moesaic.layer import is_expert_param
from moesaic.models import MoEGPT, MoEGPTConfig
from moesaic.sim.memory import model_elements, predict_memory, state_bytes
from moesaic.train.memory import LiveBytes, memory_bytes

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}
MOE = {"num_experts": 4, "ffn_hidden_size": 32}


@pytest.mark.parametrize(
    "shape",
    [
        {},  # RMSNorm, rotary positions, every block MoE
        {"norm": "layernorm", "positions": "learned", "n_layers": 4, "dense_layers": 1,
         "moe_layer_freq": 2},  # biases, position table, dense blocks between MoE ones
        {"moe": {**MOE, "activation": "gelu", "num_shared_experts": 2,
                 "shared_expert_gate": True}},  # 2 expert matrices, gated shared experts
    ],
    ids=["default", "layernorm-learned-dense", "gelu-shared"],
)  # fmt: skip
def test_model_elements_count_the_model(shape):
    cfg = MoEGPTConfig.from_dict({**TINY, "moe": MOE, **shape})
    model = MoEGPT(cfg)
    params = list(model.parameters())
    n = model_elements(cfg)
    assert n.dense == sum(p.numel() for p in params if not is_expert_param(p))
    assert n.expert == sum(p.numel() for p in params if is_expert_param(p))
    assert n.tensors == len(params)
    assert n.vectors == sum(p.numel() for p in params if p.dim() < 2)
    root = [p for name, p in model.named_parameters() if not name.startswith("blocks.")]
    assert n.root == sum(p.numel() for p in root)
    sizes = [
        (
            sum(p.numel() for p in b.parameters() if not is_expert_param(p)),
            sum(p.numel() for p in b.parameters() if is_expert_param(p)),
        )
        for b in model.blocks
    ]
    assert (n.block, n.block_experts) == max(sizes, key=sum)


def test_state_bytes_shard_dense_and_experts():
    cfg = MoEGPTConfig.from_dict({**TINY, "moe": MOE})
    n = model_elements(cfg)
    whole = state_bytes(cfg, ep=1, dp_shard=None)
    assert whole.params == 4 * (n.dense + n.expert)
    assert whole.optimizer == 2 * whole.params + 4 * n.tensors
    # dense over dp_shard x ep, experts over ep x dp_shard; unsharded EP splits the experts only
    assert state_bytes(cfg, ep=2, dp_shard=4).params == 4 * (n.dense / 8 + n.expert / 8)
    assert state_bytes(cfg, ep=2, dp_shard=None).params == 4 * (n.dense + n.expert / 2)


def _measured_step(cfg: MoEGPTConfig, batch: int, recompute: bool) -> tuple[int, int, int]:
    """(peak, bytes at the start, parameters + AdamW state) of a second training step, each
    without the tensors this process held before the model was built (the counter sees every
    tensor alive: in the whole suite, other tests' leftovers, 14 MB at one run)."""
    gc.collect()
    before = LiveBytes()
    before.start()
    torch.manual_seed(0)
    model = MoEGPT(cfg)
    model.activation_checkpointing = recompute
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)  # the CPU run's kernel
    x_BT = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    y_BT = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))

    def step() -> None:  # as the vanilla schedule: no reference to the logits kept
        F.cross_entropy(model(x_BT).flatten(0, 1), y_BT.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    state = memory_bytes(model, opt)
    counter = LiveBytes()
    counter.start()
    with counter.mode():
        step()
    held = before.start_bytes
    return counter.peak - held, counter.start_bytes - held, state.params + state.optimizer


@pytest.mark.parametrize(
    ("batch", "recompute", "phase"),
    [(1, False, "optimizer"), (16, False, "backward"), (16, True, "backward")],
)
def test_peak_within_ten_percent(batch, recompute, phase):
    """A model whose dense part outweighs its experts: at batch 1 the peak is the optimizer's
    (gradients and AdamW's temporaries), at 16 the backward's start (activations; measured
    within 0.4%), and with activation checkpointing a block's recomputation (1.1%)."""
    cfg = MoEGPTConfig.from_dict(
        {"d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 32, "moe": MOE}
    )
    peak, start, state = _measured_step(cfg, batch, recompute)
    want = predict_memory(cfg, batch_size=batch, ep=1, activation_checkpointing=recompute)
    assert want.phase == phase
    assert state == want.params + want.optimizer  # exact
    # what the model leaves out: the batch, buffers (with checkpointing 0.6 MB more is alive at
    # the step's start, 5% of the peak: not identified, and inside the measured peak below)
    assert start - state < (0.06 if recompute else 0.01) * peak
    assert peak == pytest.approx(want.peak, rel=0.10), (peak, want.to_dict())


def test_bad_input_is_refused():
    cfg = MoEGPTConfig.from_dict({**TINY, "moe": MOE})
    with pytest.raises(ValueError, match=r"^batch_size \(0\)"):
        predict_memory(cfg, batch_size=0, ep=1)
    with pytest.raises(ValueError, match=r"^compute_bytes \(3\) must be 2 \(bf16\) or 4"):
        predict_memory(cfg, batch_size=1, ep=1, compute_bytes=3)
    with pytest.raises(ValueError, match=r"^dp_shard \(0\)"):
        state_bytes(cfg, ep=1, dp_shard=0)
