"""Operator dependency graph (ODG) and split propagation (HyperParallel-MoE §4.2, Algorithm 1).

An ODG describes data flow and legal decompositions only, never an execution order or a queue
(those are the schedule's, ``plan.Schedule``): operator
nodes name their input and output tensors and carry a ``SplitSpec`` saying

* ``split_inputs``: which input partitions the operator inherits, as ``(input index, dim)``
  pairs (None: the operator is a partition origin and does not inherit anything);
* ``split_output_dims``: along which dimension each output carries the partition on (-1: none);
* ``task_num_fn``: how many tasks it splits into for a shape and parallel configuration.

``propagate_splits`` is Algorithm 1, line by line: tensors start unlabelled (split_dim -1,
split_num 1); in topological order an operator whose required input labels are present gets
``task_num_fn(C)`` tasks, one whose labels are missing falls back to one unsplit task, and
outputs are labelled with the operator's split dimension only when it split into more than one
task. Inputs not named in ``split_inputs`` (routing metadata, weights, saved activations) are
ignored by the check, as Combine ignores its offset and size tensors in the paper.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from moesaic.checks import is_int

UNSPLIT_DIM = -1


class GraphError(ValueError):
    """A malformed operator graph (unknown tensor, two producers, a cycle, a bad SplitSpec)."""


class GraphCycleError(GraphError):
    """The operator graph is not a DAG; the message names one cycle."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SplitSpec:
    """Legal tiling of one operator (see the module docstring)."""

    split_inputs: tuple[tuple[int, int], ...] | None
    split_output_dims: tuple[int, ...]
    task_num_fn: Callable[[Any], int]


@dataclass(kw_only=True, slots=True, frozen=True)
class TensorNode:
    """A tensor of the ODG: an edge between its producer (if any) and its consumers."""

    name: str
    ndim: int


@dataclass(kw_only=True, slots=True, frozen=True)
class OperatorNode:
    """One operator: its task type, tensors and SplitSpec (no queue: that is the schedule's)."""

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    split: SplitSpec


@dataclass(kw_only=True, slots=True, frozen=True)
class SplitLabel:
    """Partition label of a tensor: split along ``dim`` into ``num`` parts (-1: unsplit)."""

    dim: int
    num: int


@dataclass(kw_only=True, slots=True, frozen=True)
class SplitResult:
    """Output of Algorithm 1.

    Attributes:
        order: operator names in the topological order used.
        task_num: tasks per operator.
        labels: split label per tensor.
        fell_back: operators that required an input partition which was absent.
    """

    order: tuple[str, ...]
    task_num: dict[str, int]
    labels: dict[str, SplitLabel]
    fell_back: tuple[str, ...]


class OperatorGraph:
    """A directed acyclic graph of operators connected by tensors.

    Args:
        name: a label used in error messages.
    """

    def __init__(self, name: str = "odg") -> None:
        self.name = name
        self.tensors: dict[str, TensorNode] = {}
        self.ops: dict[str, OperatorNode] = {}
        self._producer: dict[str, str] = {}

    def add_tensor(self, name: str, ndim: int) -> TensorNode:
        """Declare a tensor (graph input, intermediate or output)."""
        if name in self.tensors:
            raise GraphError(f"{self.name}: tensor {name!r} is declared twice")
        if not is_int(ndim) or ndim < 0:
            raise GraphError(f"{self.name}: tensor {name!r} ndim ({ndim!r}) must be an int >= 0")
        node = TensorNode(name=name, ndim=ndim)
        self.tensors[name] = node
        return node

    def add_op(self, op: OperatorNode) -> OperatorNode:
        """Add an operator; its tensors must be declared and each tensor has one producer."""
        where = f"{self.name}: operator {op.name!r}"
        if op.name in self.ops:
            raise GraphError(f"{where} is added twice")
        for t in (*op.inputs, *op.outputs):
            if t not in self.tensors:
                raise GraphError(f"{where} uses undeclared tensor {t!r}")
        for t in op.outputs:
            if t in self._producer:
                raise GraphError(
                    f"{where} writes {t!r}, already produced by {self._producer[t]!r} "
                    "(every tensor has at most one producer)"
                )
        s = op.split
        if len(s.split_output_dims) != len(op.outputs):
            raise GraphError(
                f"{where} split_output_dims has {len(s.split_output_dims)} entries for "
                f"{len(op.outputs)} outputs"
            )
        for t, d in zip(op.outputs, s.split_output_dims):
            if not UNSPLIT_DIM <= d < self.tensors[t].ndim:
                raise GraphError(f"{where} split_output_dims entry {d} is out of range for {t!r}")
        for i, d in s.split_inputs or ():
            if not 0 <= i < len(op.inputs):
                raise GraphError(f"{where} split_inputs names input {i}, it has {len(op.inputs)}")
            if not 0 <= d < self.tensors[op.inputs[i]].ndim:
                raise GraphError(f"{where} split_inputs dim {d} is out of range for input {i}")
        for t in op.outputs:
            self._producer[t] = op.name
        self.ops[op.name] = op
        return op

    def predecessors(self, op_name: str) -> list[str]:
        """Operators producing an input of ``op_name`` (deduplicated, in input order)."""
        seen: list[str] = []
        for t in self.ops[op_name].inputs:
            p = self._producer.get(t)
            if p is not None and p not in seen:
                seen.append(p)
        return seen

    def topological_order(self) -> list[OperatorNode]:
        """Kahn's algorithm, ties broken by insertion order (so the result is deterministic).

        Raises:
            GraphCycleError: naming the operators of one cycle.
        """
        index = {name: i for i, name in enumerate(self.ops)}
        indeg = {name: len(self.predecessors(name)) for name in self.ops}
        succ: dict[str, list[str]] = {name: [] for name in self.ops}
        for name in self.ops:
            for p in self.predecessors(name):
                succ[p].append(name)
        heap = [index[n] for n, d in indeg.items() if d == 0]
        heapq.heapify(heap)
        names = list(self.ops)
        order: list[OperatorNode] = []
        while heap:
            n = names[heapq.heappop(heap)]
            order.append(self.ops[n])
            for s in succ[n]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(heap, index[s])
        if len(order) < len(self.ops):
            cycle = self._find_cycle({n for n, d in indeg.items() if d > 0})
            raise GraphCycleError(
                f"{self.name}: operator graph has a cycle: {' -> '.join(cycle)} "
                "(an ODG must be a DAG)"
            )
        return order

    def _find_cycle(self, stuck: set[str]) -> list[str]:
        """Walk predecessors inside the unsorted set until a node repeats."""
        node = min(stuck, key=list(self.ops).index)
        path: list[str] = []
        while node not in path:
            path.append(node)
            node = next(p for p in self.predecessors(node) if p in stuck)
        cycle = path[path.index(node) :]
        cycle.reverse()  # predecessor walk -> data-flow direction
        first = min(range(len(cycle)), key=lambda i: list(self.ops).index(cycle[i]))
        cycle = cycle[first:] + cycle[:first]  # start at the earliest-added operator
        return [*cycle, cycle[0]]


def propagate_splits(
    graph: OperatorGraph, config: Any, *, unsplit: Iterable[str] = ()
) -> SplitResult:
    """Algorithm 1 (split propagation): task counts per operator and labels per tensor.

    Args:
        graph: the ODG.
        config: the shape and parallel configuration handed to every ``task_num_fn``.
        unsplit: operators forced to one task (their ``task_num_fn`` is replaced by 1).

    Raises:
        GraphCycleError: the graph is not a DAG.
        GraphError: a ``task_num_fn`` returned something other than an int >= 1, or ``unsplit``
            names an unknown operator.
    """
    forced = set(unsplit)
    unknown = forced - set(graph.ops)
    if unknown:
        raise GraphError(f"{graph.name}: unsplit names unknown operators {sorted(unknown)}")
    labels = {name: SplitLabel(dim=UNSPLIT_DIM, num=1) for name in graph.tensors}  # lines 1-4
    task_num: dict[str, int] = {}
    fell_back: list[str] = []
    order = graph.topological_order()
    for op in order:  # line 5
        s = op.split
        inherited = s.split_inputs is None or all(
            labels[op.inputs[i]].dim == d for i, d in s.split_inputs
        )
        if inherited:  # lines 7-10
            n = 1 if op.name in forced else s.task_num_fn(config)
            if not is_int(n) or n < 1:
                raise GraphError(
                    f"{graph.name}: task_num_fn of {op.name!r} returned {n!r}; must be an int >= 1"
                )
        else:  # lines 11-12: fall back to one unsplit task
            n = 1
            fell_back.append(op.name)
        task_num[op.name] = n
        for y, d in zip(op.outputs, s.split_output_dims):  # lines 15-24
            if n > 1 and d >= 0:
                labels[y] = SplitLabel(dim=d, num=n)
            else:
                labels[y] = SplitLabel(dim=UNSPLIT_DIM, num=n)
    return SplitResult(
        order=tuple(op.name for op in order),
        task_num=task_num,
        labels=labels,
        fell_back=tuple(fell_back),
    )
