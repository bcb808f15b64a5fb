"""The MoE-FFN plans on the device: ``PersistentRuntime`` runs a lowered plan through one
persistent Triton kernel per direction (``kernels.persistent``; the ``taskflow`` dispatcher with
``kernels="triton"``).

Shape legend: T tokens, H hidden, F expert hidden, E experts, e local experts.

Everything ``TaskflowRuntime`` does per bucket and step stays (the agreed bucket, plans compiled
once, the step checks and routing offsets); what differs is the executor: instead of host
threads running a handler per tile, ``taskflow.lower`` turns each plan into device tables once
(kept on the plan, moved to the device once per device), ``step_tables`` puts the step's routing
on the device, and one kernel launch walks the tables with its counters in device memory.

EP 1 only (the tiles' puts to other ranks need the device data plane); SwiGLU plans only.
"""

from __future__ import annotations

from typing import cast

import torch

from moesaic.checks import check_one_of
from moesaic.comm.collectives import EPGroup
from moesaic.kernels import require_triton
from moesaic.taskflow.lower import MODES, DeviceTables, lower, step_tables
from moesaic.taskflow.plan import Plan
from moesaic.taskflow.runtime.concurrent import TaskflowRuntime
from moesaic.taskflow.runtime.sequential import make_buffers, step_routing

__all__ = ["PersistentRuntime"]


class PersistentRuntime(TaskflowRuntime):
    """``TaskflowRuntime`` whose steps run in one persistent Triton kernel per direction.

    Args:
        group: the expert-parallel group (of one rank).
        mode: ``"single_program"`` (one program over the single-program order: the only mode
            Triton's interpreter can run) or ``"concurrent"`` (one program per queue, a GPU).
        activation: the layer's activation (SwiGLU only).
        **kwargs: ``TaskflowRuntime``'s (tile sizes, compile options, timeout, recorder).
    """

    def __init__(
        self,
        group: EPGroup,
        *,
        mode: str = "single_program",
        activation: str = "swiglu",
        **kwargs,
    ) -> None:
        if group.size != 1:
            raise ValueError(
                f"dispatcher 'taskflow' with kernels='triton' runs EP 1 only (got an expert-"
                f"parallel group of {group.size}): its persistent kernel has no device puts to "
                "other ranks yet; use kernels='torch'"
            )
        if activation != "swiglu":
            raise ValueError(
                f"dispatcher 'taskflow' with kernels='triton' runs SwiGLU experts only (got "
                f"activation {activation!r}); use kernels='torch'"
            )
        super().__init__(group, **kwargs)
        self.mode = check_one_of("mode", mode, MODES)
        self._tables: dict[tuple, DeviceTables] = {}

    def tables(self, plan: Plan, device: torch.device) -> DeviceTables:
        """``plan``'s device tables on ``device``, lowered and moved once."""
        key = (plan.bucket, plan.direction, str(device))
        if key not in self._tables:
            host = cast(DeviceTables, plan.memo("device_tables", lower))
            self._tables[key] = host.to(device)
        return self._tables[key]

    def _run(self, plan, inputs, routing, direction):
        group = self._check_step(plan, direction)
        ref = inputs["dy_TH" if direction == "backward" else "x_TH"]
        bufs = make_buffers(plan, inputs, ref)
        route = step_routing(plan, routing, group)
        tables = self.tables(plan, ref.device)
        step = step_tables(tables, route, ref.device)
        tasks, starts = tables.program_tables(self.mode)
        require_triton()
        from moesaic.kernels.persistent import run_tables  # imports Triton

        run_tables(
            direction,
            tasks,
            starts,
            tables.triggers,
            tables.counters(),
            {"count": step.count, "tok": step.tok, "wt": step.wt, "ret": step.ret, "wtk": step.wtk},
            bufs,
            hidden=tables.hidden,
            ffn=tables.ffn,
            top_k=tables.top_k,
            ep_size=tables.ep_size,
            slot_rows=tables.slot_rows,
        )
        return bufs, route
