"""``taskflow``'s options (``MoEConfig.options`` when ``dispatcher = "taskflow"``):
:class:`TaskflowOptions`.

Torch-free (its own module, not :mod:`moesaic.strategies.taskflow`, which imports torch), so that
a config is validated without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from moesaic.checks import check_bool, check_one_of, check_positive_int
from moesaic.comm.signals import TRANSPORTS
from moesaic.kernels.persistent_steps import persistent_steps
from moesaic.strategy_options import StrategyOptions

__all__ = ["EXECUTORS", "TaskflowOptions"]

EXECUTORS = ("static", "dynamic")


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskflowOptions(StrategyOptions):
    """How ``taskflow`` compiles and runs its tile plans (``moesaic.strategies.taskflow``).

    Attributes:
        executor: "static" (one worker per queue in compiled order, HyperParallel-MoE) or
            "dynamic" (a scheduler and a processor pool deciding at run time, FlashDMoE).
        tile_m: rows of a dispatch / GMM tile (the bucket's slot rows are a power-of-two number
            of tiles).
        pipeline: compile the plans with the list-scheduled queue order
            (``CompileOptions.pipeline``: GMM2 and combine tiles start while GMM1 tiles remain)
            instead of the kernel-by-kernel order. Off by default: on the emulated CPU cluster
            it measured 3-5% slower (benchmarks/results/taskflow_cluster.json).
        transport: how tiles reach other ranks (``moesaic.comm.signals.TRANSPORTS``): "gloo"
            (the default: point-to-point messages, CPU tensors), "auto" (torch's symmetric
            memory for CUDA tensors on several ranks when available, else gloo) or
            "symmetric" (always symmetric memory; CUDA only). Symmetric memory is opt-in: its
            CUDA path has not run on a GPU yet (docs/taskflow.md).
    """

    executor: str = "static"
    tile_m: int = 128
    pipeline: bool = False
    transport: str = "gloo"

    def __post_init__(self) -> None:
        check_one_of("executor", self.executor, EXECUTORS)
        check_positive_int("tile_m", self.tile_m)
        check_bool("pipeline", self.pipeline)
        check_one_of("transport", self.transport, TRANSPORTS)

    def check_run(
        self, *, ep: int, device: str, ep_hosts: int, kernels: str, activation: str
    ) -> None:
        """Device tiles between ranks. In the persistent kernel (``persistent_steps``) they
        are stores into the peers' memory, which torch's symmetric memory maps on one host
        only; ``transport`` is not used there. On a host runtime ``transport`` carries them:
        the gloo channel takes CPU tensors only (a CUDA run at EP > 1 would fail at its first
        forward), and symmetric memory maps the peers of one host only."""
        if ep == 1 or device == "cpu":
            return
        if persistent_steps(kernels, activation, device):
            if ep_hosts > 1:
                raise ValueError(
                    f"kernels ({kernels!r}): taskflow's persistent kernel stores tiles into peer "
                    f"GPUs of one host, but an expert-parallel group of {ep} ranks spans "
                    f"{ep_hosts} hosts: make ep at most the ranks per host, or use dispatcher "
                    "'dropless'"
                )
            return
        if self.transport == "gloo":
            raise ValueError(
                f"options.transport ('gloo') puts CPU tensors only: taskflow on {device} at "
                f"ep {ep} on the host runtime (kernels {kernels!r}, activation {activation!r}) "
                "needs transport 'symmetric' or 'auto' (torch's symmetric memory, one host), "
                "kernels 'auto' or 'triton' (the persistent kernel, SwiGLU), or dispatcher "
                "'dropless'"
            )
        if ep_hosts > 1:
            raise ValueError(
                f"options.transport ({self.transport!r}) maps peers' memory on one host, but "
                f"an expert-parallel group of {ep} ranks spans {ep_hosts} hosts: make ep at "
                "most the ranks per host, or use dispatcher 'dropless'"
            )
