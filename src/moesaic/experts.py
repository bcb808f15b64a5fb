"""Grouped experts and the grouped matmul they run on.

Shape legend: M rows (expert-grouped tokens), H hidden, F expert hidden, e local experts.

Weight layout (per rank, e = num_experts / ep_size local experts):
    w1 [e, H, F]  gate projection   (Mixtral ``w1.weight.T``, HF ``gate_proj.weight.T``)
    w3 [e, H, F]  up projection     (Mixtral ``w3.weight.T``; SwiGLU only)
    w2 [e, F, H]  down projection   (Mixtral ``w2.weight.T``)
so that an expert is ``y = act(x @ w1[i]) [* (x @ w3[i])] @ w2[i]`` with row-major activations.
Experts have no biases: a zero padding row then maps to a zero output row, which is what lets the
padded dispatcher compute on its padding without changing results.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moesaic.config import MoEConfig
from moesaic.eager import constant_under_compile
from moesaic.kernels import KernelChoice
from moesaic.kernels import load as load_kernels


class GroupCounts(list[int]):
    """Rows per group on the host (this list) and, when the caller has them, on the device too.

    The grouped matmul's offsets are then a cumsum on the device; from the list alone they
    would be a copy of host memory to the device (on CUDA a blocking one) every forward. A
    list, so that code written for ``list[int]`` counts takes it unchanged.

    Attributes:
        on_device: the same counts, int64 [e] on the rows' device, or None.
    """

    __slots__ = ("on_device",)

    def __init__(self, counts: Iterable[int], on_device: torch.Tensor | None = None) -> None:
        super().__init__(counts)
        self.on_device = on_device


class DeviceCounts(Sequence[int]):
    """Rows per group known on the device, with their total known on the host.

    What a strategy hands the experts when nothing else needs the counts on the host (dropless
    at EP 1: every one of the T*K assignments is a row, and no all-to-all needs split sizes):
    the grouped matmul takes its offsets from ``on_device`` and checks the row count against
    ``total``, so the step never waits for the GPU. Reading it as a sequence (the loop
    fallback does) copies the counts to the host once, a host sync on a GPU.

    Attributes:
        on_device: int64 [e] counts on the rows' device.
        total: their sum, the rows M.
    """

    __slots__ = ("_host", "on_device", "total")

    def __init__(self, on_device: torch.Tensor, total: int) -> None:
        self.on_device = on_device
        self.total = total
        self._host: list[int] | None = None

    def __len__(self) -> int:
        return self.on_device.numel()

    def _values(self) -> list[int]:
        if self._host is None:
            self._host = self.on_device.tolist()
        return self._host

    def __getitem__(self, i):
        return self._values()[i]

    def __iter__(self):
        return iter(self._values())


def count_total(counts_e: Sequence[int]) -> int:
    """Rows in all groups, without a host read when the counts carry their total."""
    total = getattr(counts_e, "total", None)
    return sum(counts_e) if total is None else total


def group_offsets(counts_e: Sequence[int], device: torch.device) -> torch.Tensor:
    """End row of each group, int32 [e] on ``device`` (what ``torch._grouped_mm`` takes).

    From ``GroupCounts.on_device`` when given (no host data moves), else from the host list.
    """
    on_device = getattr(counts_e, "on_device", None)
    if on_device is not None:
        return torch.cumsum(on_device.to(device), 0, dtype=torch.int32)
    return torch.tensor(list(counts_e), device=device).cumsum(0).to(torch.int32)


def grouped_mm_reference(
    x_MH: torch.Tensor, w_eHF: torch.Tensor, counts_e: Sequence[int]
) -> torch.Tensor:
    """Plain torch: one matmul per group. Rows of group i are ``x_MH[off_i : off_i + counts_e[i]]``.

    Empty groups (and M = 0) still run their zero-row matmul, so the output stays in the graph of
    ``x_MH`` and every weight: a rank that received no tokens must still run the backward
    all-to-all its peers wait for, and its expert gradients are zeros rather than None.
    """
    # unbind, not w_eHF[i]: its backward stacks the e gradients once instead of adding e
    # zero-filled [e, H, F] tensors (measured 6% of a CPU training step).
    weights = w_eHF.unbind(0)
    return torch.cat([chunk @ w for chunk, w in zip(x_MH.split(list(counts_e)), weights)])


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` with an explicit backward, for builds where its own backward fails
    its self-check (``_fast_path_ok(..., native=True)``)."""

    @staticmethod
    def forward(ctx, x_MH, w_eHF, offs_e):
        ctx.save_for_backward(x_MH, w_eHF, offs_e)
        return torch._grouped_mm(x_MH, w_eHF, offs=offs_e)

    @staticmethod
    def backward(ctx, dy_MF):
        x_MH, w_eHF, offs_e = ctx.saved_tensors
        dy_MF = dy_MF.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch._grouped_mm(dy_MF, w_eHF.transpose(-2, -1), offs=offs_e)
        if ctx.needs_input_grad[1]:
            dw = torch._grouped_mm(x_MH.t(), dy_MF, offs=offs_e)
        return dx, dw, None


def _grouped_mm_op(x_MH, w_eHF, offs_e, native: bool) -> torch.Tensor:
    if native:  # torch's own backward: measured 9% faster fwd+bwd of the CPU layer step
        return torch._grouped_mm(x_MH, w_eHF, offs=offs_e)
    return _GroupedMM.apply(x_MH, w_eHF, offs_e)


@functools.cache
def _fast_path_ok(device: torch.device, dtype: torch.dtype, native: bool = False) -> bool:
    """Does torch._grouped_mm exist, run (forward, and torch's own backward if ``native`` else
    ours) and agree with the loop on this device and dtype? Probed once per process; a wrong or
    failing fast path is never used. The probe runs with autograd on whatever the caller's
    mode (a first forward under ``no_grad`` or ``inference_mode`` must not cache "no")."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    # Its own small graph, whatever the caller's context: an enclosing activation checkpoint
    # must not pack it (its unpack would recompute the caller's block mid-forward, and the
    # recomputation, cached here, would save fewer tensors), nor autocast change its dtype.
    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is),
        torch.autocast(device.type, enabled=False),
    ):
        return _probe(device, dtype, native)


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def _probe(device: torch.device, dtype: torch.dtype, native: bool) -> bool:
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(13, 16, generator=gen).to(device, dtype).requires_grad_()
        w = torch.randn(3, 16, 8, generator=gen).to(device, dtype).requires_grad_()
        offs = torch.tensor([5, 5, 13], dtype=torch.int32, device=device)
        fast = _grouped_mm_op(x, w, offs, native)
        gx, gw = torch.autograd.grad(fast.float().square().sum(), (x, w))
        ref = grouped_mm_reference(x, w, [5, 0, 8])
        rx, rw = torch.autograd.grad(ref.float().square().sum(), (x, w))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    return all(
        torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
        for a, b in ((fast, ref), (gx, rx), (gw, rw))
    )


@constant_under_compile
def _probed(device: torch.device, dtype: torch.dtype, native: bool) -> bool:
    """``_fast_path_ok``, a constant under ``torch.compile``: Dynamo runs it on real tensors
    when it traces the call (its answer, cached, holds for the process), with no graph break."""
    return _fast_path_ok(device, dtype, native)


def _fast_mode(x_MH: torch.Tensor, w_eHF: torch.Tensor, use_fast: bool = True) -> bool | None:
    """How ``grouped_mm`` runs: None the loop, True ``torch._grouped_mm`` with torch's own
    backward, False with ours (``_GroupedMM``)."""
    # torch._grouped_mm wants 16-byte-aligned row strides (in both operands, and for the
    # transposed operands of the backward): H and F a multiple of 16 bytes.
    aligned = all((n * x_MH.element_size()) % 16 == 0 for n in w_eHF.shape[1:])
    if not (use_fast and aligned and x_MH.shape[0] > 0):
        return None
    if torch.compiler.is_compiling() and x_MH.dtype != torch.bfloat16:
        return None  # torch._grouped_mm's fake kernel takes bf16 only (torch 2.13): the loop

    if _probed(x_MH.device, x_MH.dtype, native=True):
        return True
    return False if _probed(x_MH.device, x_MH.dtype, native=False) else None


def grouped_mm(
    x_MH: torch.Tensor,
    w_eHF: torch.Tensor,
    counts_e: Sequence[int],
    *,
    use_fast: bool = True,
    offs_e: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped matmul: rows of group i times ``w_eHF[i]``; returns [M, F].

    Args:
        x_MH: expert-grouped rows, group i first ``counts_e[i]`` rows after group i-1.
        w_eHF: one weight per group.
        counts_e: rows per group; must sum to M (a ``GroupCounts`` carries them on the device
            too).
        use_fast: allow ``torch._grouped_mm`` (False forces the loop). It is used only when
            it exists, the strides are aligned and it passed its self-check for this device and
            dtype. On CPU (torch 2.13, H=256, F=512, 8 groups of 256 rows) it measured 1.6x the
            loop's fwd+bwd speed, interleaved in one run.
        offs_e: ``group_offsets(counts_e, device)`` when the caller made them already (the
            experts share one per forward between their three weights and the backward).
    """
    if count_total(counts_e) != x_MH.shape[0]:
        raise ValueError(
            f"counts_e sums to {count_total(counts_e)}, but x_MH has {x_MH.shape[0]} rows"
        )
    if len(counts_e) != w_eHF.shape[0]:
        raise ValueError(f"counts_e has {len(counts_e)} groups, but w_eHF has {w_eHF.shape[0]}")
    native = _fast_mode(x_MH, w_eHF, use_fast)
    if native is not None:
        offs = offs_e if offs_e is not None else group_offsets(counts_e, x_MH.device)
        return _grouped_mm_op(x_MH, w_eHF.to(x_MH.dtype), offs, native)
    return grouped_mm_reference(x_MH, w_eHF.to(x_MH.dtype), counts_e)


def cpu_has_native_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` natively (fast), from its instruction sets.

    bf16 needs AVX512-BF16 or AMX tiles, fp16 AMX-FP16. Without them oneDNN emulates the half
    type, which measured 15x slower than fp32 for the layer's fwd+bwd on such a CPU (1,641 vs
    108 ms, H=256 F=512 E=8 K=2, 1024 tokens); with them bf16 was 2x faster than fp32 (32 vs
    64 ms on a Xeon with AMX).
    """
    return _CPU_NATIVE_MATMUL.get(dtype, True)


def _cpu_native_matmul() -> dict[torch.dtype, bool]:
    """The flags ``cpu_has_native_matmul`` reads, read once at import: torch.compile does not
    trace torch's CPU feature queries (a graph break in every compiled expert forward)."""
    cpu = getattr(torch, "cpu", None)

    def flag(name: str) -> bool:
        fn = getattr(cpu, name, None)
        return bool(fn()) if callable(fn) else False

    return {
        torch.bfloat16: flag("_is_avx512_bf16_supported") or flag("_is_amx_tile_supported"),
        torch.float16: flag("_is_amx_fp16_supported"),
    }


_CPU_NATIVE_MATMUL = _cpu_native_matmul()


def expert_compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the experts compute in for activations of ``dtype`` on ``device``.

    Half types on a CPU without a native matmul for them compute in fp32 (inputs and weights
    cast up, the output cast back): correct to the half type's rounding and no slower than
    fp32. Everywhere else the activations' own dtype.
    """
    half = dtype in (torch.bfloat16, torch.float16)
    if device.type == "cpu" and half and not cpu_has_native_matmul(dtype):
        return torch.float32
    return dtype


def expert_seed(base_seed: int, expert_id: int) -> int:
    """Seed of one global expert's init, independent of how experts are split over ranks."""
    return (base_seed * 1_000_003 + expert_id * 0x9E3779B1) % (2**63 - 1)


class GroupedExperts(nn.Module):
    """The ``e`` local experts of one rank, computed with grouped matmuls.

    Args:
        config: the layer config.
        expert_ids: global ids of the local experts, in local order (e of them; ``range(r*e,
            (r+1)*e)`` on rank r with the default contiguous placement).
    """

    def __init__(self, config: MoEConfig, expert_ids: Sequence[int]) -> None:
        super().__init__()
        self.config = config
        self.expert_ids = tuple(expert_ids)
        self.num_local_experts = len(self.expert_ids)
        H, Fh, e = config.hidden_size, config.ffn_hidden_size, self.num_local_experts
        self.w1 = nn.Parameter(torch.empty(e, H, Fh))
        self.w3 = nn.Parameter(torch.empty(e, H, Fh)) if config.activation == "swiglu" else None
        self.w2 = nn.Parameter(torch.empty(e, Fh, H))
        self.kernel_choice = KernelChoice(config.kernels, self.w1.device)
        for p in self.parameters():
            # Data-parallel code keeps these out of the all-reduce over the EP group (see docs).
            setattr(p, "_moesaic_expert", True)  # noqa: B010 (a new attribute on a Parameter)

    @property
    def first_expert(self) -> int:
        """Global id of local expert 0; the local experts must be consecutive ids."""
        if self.expert_ids != tuple(
            range(self.expert_ids[0], self.expert_ids[0] + self.num_local_experts)
        ):
            raise ValueError(f"local experts {self.expert_ids} are not consecutive ids")
        return self.expert_ids[0]

    @torch.no_grad()
    def reset_parameters(self, base_seed: int) -> None:
        """Init each expert from its own generator so EP size never changes the weights."""
        H, Fh = self.config.hidden_size, self.config.ffn_hidden_size
        for i in range(self.num_local_experts):
            gen = torch.Generator().manual_seed(expert_seed(base_seed, self.expert_ids[i]))
            for w, fan_in in ((self.w1, H), (self.w3, H), (self.w2, Fh)):
                if w is None:
                    continue
                block = torch.randn(w.shape[1:], generator=gen) / math.sqrt(fan_in)
                w[i].copy_(block)

    def forward(self, x_MH: torch.Tensor, counts_e: Sequence[int]) -> torch.Tensor:
        kernels = self.kernel_choice.for_device(x_MH.device)
        return expert_ffn(x_MH, counts_e, self.w1, self.w3, self.w2, kernels=kernels)


def expert_ffn(
    x_MH: torch.Tensor,
    counts_e: Sequence[int],
    w1_eHF: torch.Tensor,
    w3_eHF: torch.Tensor | None,
    w2_eFH: torch.Tensor,
    *,
    kernels: str = "torch",
) -> torch.Tensor:
    """The experts' FFN on expert-grouped rows with the given weights (any e of them).

    ``GroupedExperts.forward`` with its own weights; the ``hybrid`` strategy passes experts it
    gathered from other ranks. ``w3_eHF`` None means GELU, else SwiGLU. The grouped matmuls'
    offsets are made once (on the device from a ``GroupCounts``) for the three weights.
    ``kernels="triton"``: the Triton grouped GEMMs (``moesaic.kernels``, SwiGLU fused into the
    first) on the same device offsets; "fused": these grouped GEMMs with SwiGLU's elementwise
    part from ``moesaic.kernels.swiglu_act`` (one kernel each way instead of two and three);
    ``kernels`` is a resolved choice ("auto" is refused): ``GroupedExperts.kernel_choice``.
    """
    if kernels == "auto":
        raise ValueError(
            'expert_ffn: kernels must be resolved for the rows\' device ("torch", "triton" or '
            '"fused"; GroupedExperts.kernel_choice), got "auto"'
        )
    dtype = x_MH.dtype
    compute = expert_compute_dtype(x_MH.device, dtype)
    x_MH = x_MH.to(compute)  # a no-op unless a half type is emulated on this CPU
    if kernels == "triton":
        ends_e = group_offsets(counts_e, x_MH.device)
        return load_kernels().expert_ffn(x_MH, ends_e, w1_eHF, w3_eHF, w2_eFH).to(dtype)
    # w1, w3 [e, H, F] and w2 [e, F, H] have the same strides to align: one decision for all
    fast = _fast_mode(x_MH, w1_eHF) is not None
    offs_e = group_offsets(counts_e, x_MH.device) if fast else None
    h_MF = grouped_mm(x_MH, w1_eHF, counts_e, offs_e=offs_e)
    if w3_eHF is not None:
        b_MF = grouped_mm(x_MH, w3_eHF, counts_e, offs_e=offs_e)
        if kernels == "fused":
            h_MF = load_kernels().swiglu_act(h_MF, b_MF)
        else:
            h_MF = F.silu(h_MF) * b_MF
    else:
        h_MF = F.gelu(h_MF)
    return grouped_mm(h_MF, w2_eFH, counts_e, offs_e=offs_e).to(dtype)


class SharedExperts(nn.Module):
    """The ``num_shared_experts`` dense SwiGLU experts every token passes through (DeepSeek-MoE,
    Qwen2-MoE), replicated on every rank (their gradients all-reduce with the dense parameters).

    S experts of width Fs are one SwiGLU of width ``S * Fs`` (the sum of S FFNs is the FFN of
    their concatenated hidden units), so they run as three plain matmuls:
    ``w1``, ``w3`` [H, S*Fs] and ``w2`` [S*Fs, H]; expert s owns hidden units
    ``[s*Fs, (s+1)*Fs)``. With ``shared_expert_gate`` (Qwen2-MoE) the output is multiplied by
    ``sigmoid(x @ gate.T)``, ``gate`` [1, H].
    """

    gate: nn.Parameter | None

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        H, Fs = config.hidden_size, config.shared_hidden
        self.w1 = nn.Parameter(torch.empty(H, Fs))
        self.w3 = nn.Parameter(torch.empty(H, Fs))
        self.w2 = nn.Parameter(torch.empty(Fs, H))
        self.gate = nn.Parameter(torch.empty(1, H)) if config.shared_expert_gate else None

    @torch.no_grad()
    def reset_parameters(self, gate_std: float) -> None:
        """From the default RNG (replicated: ranks seeded alike draw alike): experts with std
        1/sqrt(fan_in), as the routed ones, and the gate N(0, gate_std), as the router."""
        H, Fs = self.w1.shape
        self.w1.normal_(0.0, 1.0 / math.sqrt(H))
        self.w3.normal_(0.0, 1.0 / math.sqrt(H))
        self.w2.normal_(0.0, 1.0 / math.sqrt(Fs))
        if self.gate is not None:
            self.gate.normal_(0.0, gate_std)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        dtype = x_TH.dtype
        compute = expert_compute_dtype(x_TH.device, dtype)
        x_TH = x_TH.to(compute)
        w1, w3, w2 = (w.to(compute) for w in (self.w1, self.w3, self.w2))
        y_TH = (F.silu(x_TH @ w1) * (x_TH @ w3)) @ w2
        if self.gate is not None:
            y_TH = y_TH * torch.sigmoid(x_TH @ self.gate.to(compute).t())
        return y_TH.to(dtype)
