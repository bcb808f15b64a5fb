"""``moesaic train --compile`` (``compile_dense``): each block's dense parts compiled in place,
the MoE layers eager; a step of the compiled model equals the eager one, loss and every
gradient, for an MoEGPT and a transformers Qwen3-MoE (a dense first layer, qk-norm, RoPE), and
the state dict keeps its keys (checkpoints and ``export`` read the same names).

CPU, fp32, in a fresh interpreter (Dynamo and Inductor leave threads and caches behind:
``tests/test_compile.py``). Tolerance: 1e-5 relative (and of each tensor's largest element):
Inductor fuses the norms' and the rotary embedding's elementwise chains, which round once
where eager rounds after each op.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

_QWEN = Path(__file__).resolve().parents[2] / "examples" / "hf" / "qwen3_moe.json"

_COMPILED_STEP_EQUALS_EAGER = textwrap.dedent(
    """
    import copy, json, sys, torch
    from moesaic.config import MoEConfig
    from moesaic.interop.hf_families import apply_hf_shape, read_hf_config
    from moesaic.layer import MoELayer
    from moesaic.models.config import MoEGPTConfig
    from moesaic.models.gpt import MoEGPT
    from moesaic.models.hf_causal_lm import HFCausalLM
    from moesaic.train.lm_loss import lm_loss

    for name in sys.argv[2:]:
        torch._dynamo.reset()
        moe = MoEConfig(hidden_size=32, ffn_hidden_size=48, num_experts=4, top_k=2)
        cfg = MoEGPTConfig(vocab_size=256, d_model=32, n_heads=4, n_layers=2, seq_len=16, moe=moe)
        torch.manual_seed(0)
        if name == "moegpt":
            eager = MoEGPT(cfg)
        else:
            cfg = MoEGPTConfig.from_dict(apply_hf_shape({"seq_len": 16}, sys.argv[1]))
            eager = HFCausalLM(read_hf_config(sys.argv[1]), cfg)
        compiled = copy.deepcopy(eager)
        keys = list(compiled.state_dict())
        compiled.compile_dense()
        assert list(compiled.state_dict()) == keys
        n = len(compiled.dense_modules())
        assert n and all(m._compiled_call_impl is not None for m in compiled.dense_modules())
        assert not any(m._compiled_call_impl is not None for _, m in compiled.moe_layers())
        gen = torch.Generator().manual_seed(1)
        for step in range(2):
            idx = torch.randint(0, 256, (2, 16), generator=gen)
            y = torch.randint(0, 256, (2, 16), generator=gen)
            out = []
            for model in (eager, compiled):
                model.zero_grad()
                loss = lm_loss(model(idx), y)
                for _, layer in model.moe_layers():
                    loss = loss + layer.take_aux_loss()
                loss.backward()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                out.append([loss.detach(), *grads])
            assert len(out[0]) == len(out[1])
            for got, want in zip(out[1], out[0]):
                atol = 1e-5 * float(want.abs().max())
                torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
        print("ok", name, n)
    """
)


def test_compiled_dense_parts_step_equals_eager():
    """Both models in one interpreter (Dynamo reset between them): one start, not two."""
    out = subprocess.run(
        [sys.executable, "-c", _COMPILED_STEP_EQUALS_EAGER, str(_QWEN), "moegpt", "qwen3_moe"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    oks = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("ok")]
    assert out.returncode == 0 and oks == ["moegpt", "qwen3_moe"], out.stdout + out.stderr[-3000:]
