"""Both language models are block models (``moesaic.models.block_model``): MoEGPT and a
transformers causal LM made expert-parallel (``HFCausalLM``) satisfy the protocol, share one
``moe_layers`` and one ``generate``, and generate the same way: each step appends the sample of
the last position's logits over the last ``seq_len`` ids, below ``sample_vocab``, and the MoE
layers keep no aux loss or statistics afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moesaic.layer import MoELayer
from moesaic.models.block_model import BlockModel, SharedLMMethods, sample_next
from moesaic.models.config import MoEGPTConfig
from moesaic.models.gpt import MoEGPT

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "hf"
SEQ = 4


def _models() -> dict[str, SharedLMMethods]:
    from moesaic.interop.hf_families import apply_hf_shape, read_hf_config
    from moesaic.models.hf_causal_lm import HFCausalLM

    torch.manual_seed(0)
    gpt = MoEGPT(
        MoEGPTConfig.from_dict(
            {
                "d_model": 32,
                "n_heads": 2,
                "n_layers": 2,
                "seq_len": SEQ,
                "moe": {"num_experts": 4, "ffn_hidden_size": 32},
            }
        )
    )
    path = EXAMPLES / "mixtral.json"
    cfg = MoEGPTConfig.from_dict(apply_hf_shape({"seq_len": SEQ}, path))
    hf = HFCausalLM(read_hf_config(path), cfg)
    return {"MoEGPT": gpt, "HFCausalLM": hf}


def _by_hand(model: SharedLMMethods, idx_BT: torch.Tensor, new: int, vocab: int) -> torch.Tensor:
    """Greedy decoding written out: what ``generate`` must do at temperature 0."""
    with torch.no_grad():
        for _ in range(new):
            logits_BV = model(idx_BT[:, -SEQ:])[:, -1, :vocab].float()
            idx_BT = torch.cat([idx_BT, sample_next(logits_BV, 0.0, None)], dim=1)
    return idx_BT


@pytest.fixture(scope="module")
def models() -> dict[str, SharedLMMethods]:
    return _models()


@pytest.mark.parametrize("name", ["MoEGPT", "HFCausalLM"])
def test_both_are_block_models_sharing_one_implementation(models, name):
    model = models[name]
    assert isinstance(model, BlockModel)
    assert type(model).generate is SharedLMMethods.generate
    assert type(model).moe_layers is SharedLMMethods.moe_layers
    layers = model.moe_layers()
    assert layers and all(isinstance(m, MoELayer) for _, m in layers)
    assert [n for n, _ in layers] == [
        n for n, m in model.named_modules() if isinstance(m, MoELayer)
    ]


@pytest.mark.parametrize("name", ["MoEGPT", "HFCausalLM"])
def test_generate_is_greedy_decoding_over_the_context_below_sample_vocab(models, name):
    model = models[name].eval()
    model.sample_vocab = 200  # below both vocabularies: the restriction must hold
    prompt = torch.randint(0, 200, (1, 5), generator=torch.Generator().manual_seed(3))
    new = SEQ + 2  # past seq_len: the context window slides
    out = model.generate(prompt, new, temperature=0.0)
    assert out.shape == (1, 5 + new) and torch.equal(out[:, :5], prompt)
    assert int(out.max()) < 200
    for _, layer in model.moe_layers():  # inference keeps nothing for the next step
        assert layer.take_aux_loss() is None
        assert layer.take_stats().forwards == 0
    torch.testing.assert_close(out, _by_hand(model, prompt, new, 200), rtol=0, atol=0)
    sampled = [
        model.generate(
            prompt, 3, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(7)
        )
        for _ in range(2)
    ]
    assert torch.equal(sampled[0], sampled[1])  # the generator alone decides the samples


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_hf_layer_context_reads_nothing_on_the_host(family):
    """The pipelined schedules' per-layer context of a transformers model (its causal mask,
    rotary embeddings): no host sync. With position ids and no attention mask transformers
    looks for packed sequences in them, a read on the host each layer and chunk (one a step
    in ``gpu_train_step_h200.json``'s vanilla run, from its own forward); ours are one
    arange, so the mask is made without them, and equals the one made with them."""
    from transformers.masking_utils import create_causal_mask

    from moesaic.interop.hf_families import apply_hf_shape, read_hf_config
    from moesaic.models.hf_causal_lm import HFCausalLM
    from moesaic.testing import HostSyncCounter

    path = EXAMPLES / f"{family}.json"
    cfg = MoEGPTConfig.from_dict(apply_hf_shape({"seq_len": 8}, path))
    model = HFCausalLM(read_hf_config(path), cfg)
    x_BTD = model.embed(torch.randint(0, 256, (2, 8)))
    with HostSyncCounter() as syncs:
        ctx = model.layer_context(x_BTD, 0)
    syncs.check(at_most=0, what=f"{family} layer_context")
    pos_1T = torch.arange(8).unsqueeze(0)
    want = create_causal_mask(
        config=model.hf.config, inputs_embeds=x_BTD, attention_mask=None, cache=None,
        position_ids=pos_1T,
    )  # fmt: skip
    got = ctx["attention_mask"]
    assert (got is None and want is None) or torch.equal(got, want)
