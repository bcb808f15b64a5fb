"""The fused dropless layer under ``torch.compile`` on a GPU, with Inductor: one graph per
forward (its Triton kernels are custom ops, ``moesaic.kernels``), nothing recompiled after a
second token count, and output and gradients equal to the eager layer within bf16 rounding.
tests/test_compile.py checks the same graph count on CPU under the interpreter (``aot_eager``:
bit for bit); here Inductor fuses the glue (softmax, top-k weights, the residual casts) and
rounds to bf16 once where eager rounds after each op, so the tolerance is bf16's: 2**-7 of the
tensor's largest element."""

from __future__ import annotations

import pytest
import torch
from _gpu_helpers import NEEDS_CUDA

from moesaic import MoEConfig, MoELayer, aux_loss
from moesaic.testing import GraphCounter

# Inductor compiles the forward and backward twice (the second token count makes T symbolic):
# longer than gpu_run.sh's 60 s default for a test
pytestmark = [*NEEDS_CUDA, pytest.mark.timeout(140)]


def test_fused_layer_compiles_to_one_graph_on_cuda():
    pytest.importorskip("triton")
    graphs = GraphCounter("inductor")
    torch._dynamo.reset()
    cfg = MoEConfig(hidden_size=1024, ffn_hidden_size=512, num_experts=16, top_k=4)
    torch.manual_seed(0)
    eager = MoELayer(cfg).cuda().to(torch.bfloat16)
    compiled = MoELayer(cfg).cuda().to(torch.bfloat16)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(backend=graphs)
    # a second token count recompiles once with T symbolic; the later ones compile nothing
    for step, T in enumerate((2048, 3072, 2560, 2048)):
        graphs.runs.clear()
        made_before = graphs.made
        x = torch.randn(T, 1024, generator=torch.Generator().manual_seed(step))
        outs = []
        for layer in (eager, compiled):
            layer.zero_grad()
            xi = x.cuda().to(torch.bfloat16).requires_grad_()
            y = layer(xi)
            (
                (y.float() * torch.linspace(-1, 1, 1024, device="cuda")).sum() + aux_loss(layer)
            ).backward()
            outs.append([y, xi.grad, *(p.grad for p in layer.parameters())])
        for got, want in zip(outs[1], outs[0], strict=True):
            atol = 2**-7 * float(want.float().abs().max())
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=atol)
    assert sum(graphs.runs.values()) == 1 and graphs.made == made_before, graphs.runs
