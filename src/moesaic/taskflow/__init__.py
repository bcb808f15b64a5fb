"""Taskflow compiler (HyperParallel-MoE): operator graph -> split propagation -> task
descriptors -> a static two-queue plan with event counters, forward and backward.

See docs/taskflow.md. Typical use::

    bucket = ShapeBucket(tokens=4096, hidden=7168, ffn=2048, experts=256, top_k=8,
                         ep_size=8, slot_rows=128, tile_m=128)
    plan = compile_plan(bucket, "forward", rank)
    save_plan(plan, path); plan = load_plan(path)    # validated on load
    out = run_forward(plan, x_TH, routing, w1_eHF, w2_eFH, w3_eHF, group=ep_group)
"""

from moesaic.taskflow.bucket import CompileOptions, ShapeBucket, slot_rows_for
from moesaic.taskflow.compile import compile_plan, compile_world
from moesaic.taskflow.graph import (
    GraphCycleError,
    GraphError,
    OperatorGraph,
    OperatorNode,
    SplitSpec,
    propagate_splits,
)
from moesaic.taskflow.moe_graphs import backward_graph, forward_graph
from moesaic.taskflow.plan import PLAN_VERSION, Plan
from moesaic.taskflow.plan_io import load_plan, plan_from_dict, plan_to_dict, save_plan
from moesaic.taskflow.tasks import CompileError, Event, Region, TaskDescriptor
from moesaic.taskflow.validate import (
    PlanDeadlockError,
    PlanError,
    PlanEventError,
    PlanFormatError,
    PlanRegionError,
    PlanVersionError,
    PlanWorldError,
    check_plan,
    check_world,
    simulate,
)

__all__ = [
    "PLAN_VERSION",
    "CompileError",
    "CompileOptions",
    "Event",
    "GraphCycleError",
    "GraphError",
    "OperatorGraph",
    "OperatorNode",
    "Plan",
    "PlanDeadlockError",
    "PlanError",
    "PlanEventError",
    "PlanFormatError",
    "PlanRegionError",
    "PlanVersionError",
    "PlanWorldError",
    "Region",
    "ShapeBucket",
    "SplitSpec",
    "TaskDescriptor",
    "backward_graph",
    "check_plan",
    "check_world",
    "compile_plan",
    "compile_world",
    "forward_graph",
    "load_plan",
    "plan_from_dict",
    "plan_to_dict",
    "propagate_splits",
    "save_plan",
    "simulate",
    "slot_rows_for",
]
