"""The layer under ``torch.compile`` (what torchtitan's trainer does to its blocks, and a user may
do to a model holding ours): forward and gradients equal the eager layer's, and later steps
compile nothing new. On an H200 the compiled dropless layer first failed in AOTAutograd (the
router kernel's Function), then recompiled every step on the layer's int statistics (its
recompile limit hit); both are run eagerly now (``moesaic.eager``).

CPU, fp32, kernels "torch" (the Triton kernels need a GPU; ``benchmarks/gpu_layer.py`` compiles
the fused layer there). Tolerance: 1e-5 relative (and of each tensor's largest element), the
schedules' rule: Inductor fuses the glue (softmax, top-k weights, the combine), which sums in
another order than eager.

Each check runs in a fresh interpreter: Dynamo and Inductor leave threads and caches in the
process that compiles (the live-bytes tests of the same pytest worker counted their
allocations), and import Triton (tests/kernels must set ``TRITON_INTERPRET`` first).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_COMPILED_EQUALS_EAGER = textwrap.dedent(
    """
    import sys, torch
    from torch._dynamo.utils import counters
    from moesaic import MoEConfig, MoELayer

    for dispatcher in sys.argv[1:]:
        torch._dynamo.reset()
        counters.clear()
        cfg = MoEConfig(hidden_size=32, ffn_hidden_size=64, num_experts=4, top_k=2,
                        kernels="torch", dispatcher=dispatcher)
        torch.manual_seed(0)
        eager, compiled = MoELayer(cfg), MoELayer(cfg)
        compiled.load_state_dict(eager.state_dict())
        compiled.compile()
        graphs = []
        for step in range(4):
            x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
            outs = []
            for layer in (eager, compiled):
                layer.zero_grad()
                xi = x.clone().requires_grad_()
                y = layer(xi)
                (y * torch.arange(32.0)).sum().backward()
                outs.append([y, xi.grad, *(p.grad for p in layer.parameters())])
            for got, want in zip(outs[1], outs[0], strict=True):
                atol = 1e-5 * float(want.abs().max())
                torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
            graphs.append(counters["stats"]["unique_graphs"])
        assert compiled.stats.tokens == eager.stats.tokens == 4 * 64
        assert graphs[1] > 0 and graphs[3] == graphs[1], graphs  # steps 3 and 4: nothing new
        print("ok", dispatcher, graphs)
    """
)


_ONE_GRAPH = textwrap.dedent(
    """
    import sys, torch
    import moesaic.experts
    from moesaic import MoEConfig, MoELayer, aux_loss
    from moesaic.testing import GraphCounter

    # bf16 experts through torch._grouped_mm as on a GPU (this CPU would compute them in fp32
    # through the per-expert loop, whose host-read split sizes break graphs by design)
    moesaic.experts._CPU_NATIVE_MATMUL[torch.bfloat16] = True
    for kernels in sys.argv[1:]:
        torch._dynamo.reset()
        graphs = GraphCounter("aot_eager")
        cfg = MoEConfig(hidden_size=16, ffn_hidden_size=32, num_experts=4, top_k=2,
                        kernels=kernels, dispatcher="dropless")
        torch.manual_seed(0)
        eager = MoELayer(cfg).to(torch.bfloat16)
        compiled = MoELayer(cfg).to(torch.bfloat16)
        compiled.load_state_dict(eager.state_dict())
        compiled.compile(backend=graphs)
        # a new token count at step 2 (Dynamo recompiles once, with T symbolic); step 3's
        # third count compiles nothing
        for step, T in enumerate((8, 12, 10)):
            graphs.runs.clear()
            made_before = graphs.made
            x = torch.randn(T, 16, generator=torch.Generator().manual_seed(step))
            outs = []
            for layer in (eager, compiled):
                layer.zero_grad()
                xi = x.to(torch.bfloat16).requires_grad_()
                y = layer(xi)
                ((y.float() * torch.arange(16.0)).sum() + aux_loss(layer)).backward()
                outs.append([y, xi.grad, *(p.grad for p in layer.parameters())])
            for got, want in zip(outs[1], outs[0], strict=True):
                assert torch.equal(got, want), (kernels, step, (got - want).abs().max())
        # the third step: its forward one graph, nothing compiled anew
        assert sum(graphs.runs.values()) == 1 and graphs.made == made_before, (
            kernels, graphs.runs, graphs.made
        )
        assert compiled.stats.forwards == eager.stats.forwards == 3
        print("ok", kernels)
    """
)


def _python(
    code: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=None if env is None else {**os.environ, **env},
    )


def test_compiled_layer_equals_eager_and_compiles_once():
    """Both dispatchers in one interpreter (Dynamo reset between them): one start, not two."""
    out = _python(_COMPILED_EQUALS_EAGER, "dropless", "padded")
    oks = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("ok")]
    assert out.returncode == 0 and oks == ["dropless", "padded"], out.stdout + out.stderr[-3000:]


def test_the_layer_compiles_to_one_graph_equal_to_eager():
    """The fused path (Triton's router, permute, SwiGLU and combine: custom ops under
    ``torch.compile``), the triton path (its grouped GEMMs too) and the torch path, bf16,
    through AOTAutograd (``aot_eager``: the joint graph, the custom ops' fake kernels and
    backward traced, no Inductor). Each forward is one graph (the bookkeeping after it eager);
    a third token count compiles nothing (the second recompiled with T symbolic; a slot-map
    cache keyed by T's value had specialised it, a recompile for every count); output, input
    and weight gradients equal the eager layer's bit for bit (the same kernels in the same
    order: nothing fused, nothing reordered). With graph breaks at its kernels and
    bookkeeping, the fused layer was 18 graphs, and on an H200 slower than eager
    (docs/performance.md)."""
    out = _python(_ONE_GRAPH, "fused", "triton", "torch", env={"TRITON_INTERPRET": "1"})
    oks = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("ok")]
    assert out.returncode == 0 and oks == ["fused", "triton", "torch"], (
        out.stdout + out.stderr[-3000:]
    )


def test_importing_the_library_imports_neither_dynamo_nor_triton():
    """``eager_under_compile`` waits for Dynamo instead of importing it: an ``import moesaic``
    that pulled in Dynamo (and Triton with it) cost about a second and, in this suite, made
    every kernel test skip (Triton imported before tests/kernels set ``TRITON_INTERPRET``)."""
    code = (
        "import sys, moesaic, moesaic.layer, moesaic.experts, moesaic.train.loop; "
        "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))"
    )
    out = _python(code)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
