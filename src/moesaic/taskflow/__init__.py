"""Taskflow compiler (HyperParallel-MoE): operator graph -> split propagation -> a frozen task
graph with event counters -> a two-queue schedule, forward and backward; one event engine runs
the deadlock check, the sequential executor and the plan drawing.

See docs/taskflow.md. Typical use::

    bucket = ShapeBucket(tokens=4096, hidden=7168, ffn=2048, experts=256, top_k=8,
                         ep_size=8, slot_rows=128, tile_m=128)
    plan = compile_plan(bucket, "forward", rank)
    save_plan(plan, path); plan = load_plan(path)    # validated on load
    out = run_forward(plan, x_TH, routing, w1_eHF, w2_eFH, w3_eHF, group=ep_group)
"""

from moesaic.taskflow.bucket import CompileOptions, ShapeBucket, slot_rows_for
from moesaic.taskflow.compile import compile_plan, compile_world
from moesaic.taskflow.engine import DeadlockError, EventEngine, Job, Lane, Timeline
from moesaic.taskflow.graph import (
    GraphCycleError,
    GraphError,
    OperatorGraph,
    OperatorNode,
    SplitSpec,
    propagate_splits,
)
from moesaic.taskflow.layout import (
    LayoutWrite,
    SymmetricLayout,
    WriteConflictError,
    all_to_all_writes,
    check_write_conflicts,
    symmetric_layout_bytes,
)
from moesaic.taskflow.layout_memory import LayoutMemory, compare_layout_memory
from moesaic.taskflow.moe_graphs import TASK_TYPES, backward_graph, forward_graph, task_count
from moesaic.taskflow.plan import PLAN_VERSION, Plan, Schedule, TaskGraph
from moesaic.taskflow.plan_io import load_plan, plan_from_dict, plan_to_dict, save_plan
from moesaic.taskflow.tasks import CompileError, Event, Region, TaskDescriptor, TaskType
from moesaic.taskflow.validate import (
    PlanDeadlockError,
    PlanError,
    PlanEventError,
    PlanFormatError,
    PlanRegionError,
    PlanVersionError,
    check_plan,
    ensure_validated,
    simulate,
)
from moesaic.taskflow.validate_world import PlanWorldError, check_world

__all__ = [
    "PLAN_VERSION",
    "TASK_TYPES",
    "CompileError",
    "CompileOptions",
    "DeadlockError",
    "Event",
    "EventEngine",
    "GraphCycleError",
    "GraphError",
    "Job",
    "Lane",
    "LayoutMemory",
    "LayoutWrite",
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
    "Schedule",
    "ShapeBucket",
    "SplitSpec",
    "SymmetricLayout",
    "TaskDescriptor",
    "TaskGraph",
    "TaskType",
    "Timeline",
    "WriteConflictError",
    "all_to_all_writes",
    "backward_graph",
    "check_plan",
    "check_world",
    "check_write_conflicts",
    "compare_layout_memory",
    "compile_plan",
    "compile_world",
    "ensure_validated",
    "forward_graph",
    "load_plan",
    "plan_from_dict",
    "plan_to_dict",
    "propagate_splits",
    "save_plan",
    "simulate",
    "slot_rows_for",
    "symmetric_layout_bytes",
    "task_count",
]
