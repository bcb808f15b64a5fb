"""The MoE-FFN operator graphs (paper Fig. 2) and the buffers their tasks read and write.

Shape legend: T tokens per rank, H hidden, F expert hidden, A = 2F (SwiGLU: gate | up) or F
(GELU), E experts, e local experts, K top-k, P ranks, S slot rows, R = e * P * S.

Forward (Fig. 2a): ``dispatch -> gmm1 -> act -> gmm2 -> combine``, then ``reduce``. Backward
(Fig. 2b): the seven nodes ``dispatch_bwd``, ``gmm_act_grad``, ``gmm_w2_grad``, ``act_grad``,
``gmm_gate_grad``, ``combine_bwd``, ``gmm_w1_grad``, then ``reduce_bwd`` and ``topk_grad``.

Two nodes are ours, not the paper's, and the docs say why: the paper's Combine also accumulates
the K expert outputs of a token on its source rank. Which return rows a block of tokens needs is
decided by the routing of the step, so a static plan cannot tie token tiles to combine tiles;
we keep Combine as pure per-tile communication aligned with GMM2 and add ``reduce`` (a
deterministic, token-tiled weighted sum on the source rank that waits for all return tiles).
``topk_grad`` gives the gradient of the routing weights (``<dy_t, y_tk>``), so the router, which
stays outside the plan, can be trained through it.

Buffers (per rank, 2-D, row-major; expert weights are flattened to ``[e * rows, cols]``):

    forward  inputs  x_TH [T,H]  w1 [eH,F]  w3 [eH,F] (SwiGLU)  w2 [eF,H]
             work    x_recv [R,H]  h [R,A]  a [R,F]  y_rows [R,H]  y_ret [E*S,H]
             output  y_TH [T,H]
    backward inputs  dy_TH [T,H]  weights  x_recv  h  a  y_ret (saved by the forward)
             work    g_recv [R,H]  da [R,F]  dh [R,A]  dx_rows [R,H]  dx_ret [E*S,H]
             output  dx_TH [T,H]  dtopk_TK [T,K]  dw1 [eH,F]  dw3 [eH,F]  dw2 [eF,H]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from moesaic.taskflow.bucket import ShapeBucket
from moesaic.taskflow.graph import OperatorGraph, OperatorNode, SplitSpec, propagate_splits
from moesaic.taskflow.tasks import BufferSpec, TaskType


def _types(*rows: TaskType) -> Mapping[str, TaskType]:
    return MappingProxyType({t.name: t for t in rows})  # read-only: a table, not state


def _t(name: str, queue_class: str, cost_class: str, **facts: Any) -> TaskType:
    """A row of the table: a task type whose handler has the type's name."""
    return TaskType(
        name=name, queue_class=queue_class, handler=name, cost_class=cost_class, **facts
    )


# The task-type table: every per-type fact in one place. GMMs run on the matrix queue, everything
# else on the vector/communication queue; puts carry a message tag class; row types are the
# compute over receive slots whose tiles follow the GMM row partition (RATR orders them).
TASK_TYPES: Mapping[str, TaskType] = _types(
    _t("put_dispatch", "vector", "put", put=True, comm="dispatch", put_tag=1),
    _t("put_dispatch_grad", "vector", "put", put=True, comm="dispatch", put_tag=2),
    _t("put_combine", "vector", "put", put=True, comm="combine", put_tag=3),
    _t("gmm_gate_up", "matrix", "gmm", rows=True),
    _t("swiglu", "vector", "act", rows=True),
    _t("gelu", "vector", "act", rows=True),
    _t("gmm_down", "matrix", "gmm", rows=True),
    _t("topk_combine", "vector", "reduce"),
    _t("gmm_act_grad", "matrix", "gmm", rows=True),
    _t("gmm_w2_grad", "matrix", "gmm"),
    _t("swiglu_grad", "vector", "act", rows=True),
    _t("gelu_grad", "vector", "act", rows=True),
    _t("gmm_gate_grad", "matrix", "gmm", rows=True),
    _t("gmm_w1_grad", "matrix", "gmm"),
    _t("sum_combine", "vector", "reduce"),
    _t("topk_weight_grad", "vector", "reduce"),
)
# The queues of the two-queue executor (a schedule lists them in this order).
QUEUE_CLASSES = ("matrix", "vector")
# Nominal relative cost of one tile-row of work per cost class: a GMM tile does ~2x the work of
# moving the same rows, activations and reductions ~0.5x (a picture, not a measured model).
NOMINAL_WEIGHT: Mapping[str, float] = MappingProxyType(
    {"put": 1.0, "gmm": 2.0, "act": 0.5, "reduce": 0.5}
)
# Fill kinds: how an operator's tasks tile its buffers (see moe_fills.py).
FILL_KINDS = ("send_tokens", "send_rows", "rows", "experts", "tokens")


@dataclass(kw_only=True, slots=True, frozen=True)
class OpLayout:
    """How one operator's tasks map onto buffers.

    Attributes:
        kind: fill kind (``FILL_KINDS``).
        task_type: handler type of its tasks.
        row_inputs: buffers read at the task's own rows (receive rows or token rows).
        weight_inputs: per-expert weight buffers (the block of the task's expert).
        whole_inputs: buffers read entirely (data-dependent gathers by routing).
        outputs: buffers written at the task's rows (or expert block, or remote slot).
    """

    kind: str
    task_type: str
    row_inputs: tuple[str, ...] = ()
    weight_inputs: tuple[str, ...] = ()
    whole_inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()


@dataclass(kw_only=True, slots=True, frozen=True)
class MoEGraph:
    """An ODG plus what the task generator needs to know about each operator."""

    direction: str
    graph: OperatorGraph
    layouts: dict[str, OpLayout]


def _n_dispatch(b: ShapeBucket) -> int:
    return b.experts * b.slot_rows // b.tile_m


def _n_rows(b: ShapeBucket) -> int:
    return b.recv_rows // b.gmm_rows


def _n_experts(b: ShapeBucket) -> int:
    return b.local_experts


def _n_tokens(b: ShapeBucket) -> int:
    return math.ceil(b.tokens / b.tile_m)


_TASK_NUM = {
    "send_tokens": _n_dispatch,
    "send_rows": _n_rows,
    "rows": _n_rows,
    "experts": _n_experts,
    "tokens": _n_tokens,
}


def _add(g: OperatorGraph, name: str, layout: OpLayout, inputs, split_inputs) -> OperatorNode:
    """Add an op whose outputs all propagate along dim 0 (rows, experts or tokens)."""
    spec = SplitSpec(
        split_inputs=split_inputs,
        split_output_dims=(0,) * len(layout.outputs),
        task_num_fn=_TASK_NUM[layout.kind],
    )
    return g.add_op(
        OperatorNode(
            name=name,
            op_type=layout.task_type,
            inputs=tuple(inputs),
            outputs=layout.outputs,
            split=spec,
        )
    )


def _build(direction: str, specs, tensors) -> MoEGraph:
    g = OperatorGraph(f"moe-ffn {direction}")
    for t in tensors:
        g.add_tensor(t, 1 if t == "routing" else 2)
    layouts = {}
    for name, layout, extra_inputs, split_inputs in specs:
        inputs = (*layout.row_inputs, *layout.whole_inputs, *layout.weight_inputs, *extra_inputs)
        _add(g, name, layout, inputs, split_inputs)
        layouts[name] = layout
    return MoEGraph(direction=direction, graph=g, layouts=layouts)


ROWS = ((0, 0),)  # inherit the row partition of input 0


def forward_graph(activation: str = "swiglu") -> MoEGraph:
    """Fig. 2(a): Dispatch -> GMM1 -> SwiGLU/GELU -> GMM2 -> Combine, then the top-k reduce."""
    swiglu = activation == "swiglu"
    w_up = ("w1", "w3") if swiglu else ("w1",)
    L = OpLayout
    specs = [
        # Dispatch is the partition origin: its tiles partition x_recv by rows.
        (
            "dispatch",
            L(
                kind="send_tokens",
                task_type="put_dispatch",
                whole_inputs=("x_TH",),
                outputs=("x_recv",),
            ),
            ("routing",),
            None,
        ),
        (
            "gmm1",
            L(
                kind="rows",
                task_type="gmm_gate_up",
                row_inputs=("x_recv",),
                weight_inputs=w_up,
                outputs=("h",),
            ),
            (),
            ROWS,
        ),
        (
            "act",
            L(
                kind="rows",
                task_type="swiglu" if swiglu else "gelu",
                row_inputs=("h",),
                outputs=("a",),
            ),
            (),
            ROWS,
        ),
        (
            "gmm2",
            L(
                kind="rows",
                task_type="gmm_down",
                row_inputs=("a",),
                weight_inputs=("w2",),
                outputs=("y_rows",),
            ),
            (),
            ROWS,
        ),
        # Combine checks only its data input (index 0), not the routing metadata.
        (
            "combine",
            L(
                kind="send_rows",
                task_type="put_combine",
                row_inputs=("y_rows",),
                outputs=("y_ret",),
            ),
            ("routing",),
            ROWS,
        ),
        (
            "reduce",
            L(kind="tokens", task_type="topk_combine", whole_inputs=("y_ret",), outputs=("y_TH",)),
            ("routing",),
            None,
        ),
    ]
    tensors = ["x_TH", "routing", *w_up, "w2", "x_recv", "h", "a", "y_rows", "y_ret", "y_TH"]
    return _build("forward", specs, tensors)


def backward_graph(activation: str = "swiglu") -> MoEGraph:
    """Fig. 2(b): the seven backward nodes, then the two source-side reductions."""
    swiglu = activation == "swiglu"
    w_up = ("w1", "w3") if swiglu else ("w1",)
    dw_up = ("dw1", "dw3") if swiglu else ("dw1",)
    L = OpLayout
    specs = [
        (
            "dispatch_bwd",
            L(
                kind="send_tokens",
                task_type="put_dispatch_grad",
                whole_inputs=("dy_TH",),
                outputs=("g_recv",),
            ),
            ("routing",),
            None,
        ),
        (
            "gmm_act_grad",
            L(
                kind="rows",
                task_type="gmm_act_grad",
                row_inputs=("g_recv",),
                weight_inputs=("w2",),
                outputs=("da",),
            ),
            (),
            ROWS,
        ),
        # Weight gradients reduce over rows: they never inherit the row split, one task per expert.
        (
            "gmm_w2_grad",
            L(
                kind="experts",
                task_type="gmm_w2_grad",
                row_inputs=("a", "g_recv"),
                outputs=("dw2",),
            ),
            (),
            None,
        ),
        (
            "act_grad",
            L(
                kind="rows",
                task_type="swiglu_grad" if swiglu else "gelu_grad",
                row_inputs=("da", "h"),
                outputs=("dh",),
            ),
            (),
            ROWS,
        ),
        (
            "gmm_gate_grad",
            L(
                kind="rows",
                task_type="gmm_gate_grad",
                row_inputs=("dh",),
                weight_inputs=w_up,
                outputs=("dx_rows",),
            ),
            (),
            ROWS,
        ),
        (
            "combine_bwd",
            L(
                kind="send_rows",
                task_type="put_combine",
                row_inputs=("dx_rows",),
                outputs=("dx_ret",),
            ),
            ("routing",),
            ROWS,
        ),
        (
            "gmm_w1_grad",
            L(kind="experts", task_type="gmm_w1_grad", row_inputs=("x_recv", "dh"), outputs=dw_up),
            (),
            None,
        ),
        (
            "reduce_bwd",
            L(kind="tokens", task_type="sum_combine", whole_inputs=("dx_ret",), outputs=("dx_TH",)),
            ("routing",),
            None,
        ),
        (
            "topk_grad",
            L(
                kind="tokens",
                task_type="topk_weight_grad",
                row_inputs=("dy_TH",),
                whole_inputs=("y_ret",),
                outputs=("dtopk_TK",),
            ),
            ("routing",),
            None,
        ),
    ]
    tensors = [
        "dy_TH",
        "routing",
        *w_up,
        "w2",
        "x_recv",
        "h",
        "a",
        "y_ret",
        "g_recv",
        "da",
        "dh",
        "dx_rows",
        "dx_ret",
        "dx_TH",
        "dtopk_TK",
        *dw_up,
        "dw2",
    ]
    return _build("backward", specs, tensors)


def moe_graph(direction: str, activation: str) -> MoEGraph:
    """The forward or backward MoE-FFN graph."""
    if direction == "forward":
        return forward_graph(activation)
    if direction == "backward":
        return backward_graph(activation)
    raise ValueError(f"direction ({direction!r}) must be 'forward' or 'backward'")


def buffer_table(b: ShapeBucket, direction: str) -> tuple[BufferSpec, ...]:
    """Every buffer of one rank for a bucket and direction, in a fixed order."""
    T, H, F, K, e = b.tokens, b.hidden, b.ffn, b.top_k, b.local_experts
    R, A, Er = b.recv_rows, b.act_cols, b.return_rows
    swiglu = b.activation == "swiglu"

    def buf(name, rows, cols, kind):
        return BufferSpec(name=name, rows=rows, cols=cols, kind=kind)

    weights = [buf("w1", e * H, F, "input")]
    if swiglu:
        weights.append(buf("w3", e * H, F, "input"))
    weights.append(buf("w2", e * F, H, "input"))
    saved = [
        buf("x_recv", R, H, ""),
        buf("h", R, A, ""),
        buf("a", R, F, ""),
        buf("y_ret", Er, H, ""),
    ]
    if direction == "forward":
        return (
            buf("x_TH", T, H, "input"),
            *weights,
            *(BufferSpec(name=s.name, rows=s.rows, cols=s.cols, kind="work") for s in saved),
            buf("y_rows", R, H, "work"),
            buf("y_TH", T, H, "output"),
        )
    if direction != "backward":
        raise ValueError(f"direction ({direction!r}) must be 'forward' or 'backward'")
    grads = [buf("dw1", e * H, F, "output")]
    if swiglu:
        grads.append(buf("dw3", e * H, F, "output"))
    grads.append(buf("dw2", e * F, H, "output"))
    return (
        buf("dy_TH", T, H, "input"),
        *weights,
        *(BufferSpec(name=s.name, rows=s.rows, cols=s.cols, kind="input") for s in saved),
        buf("g_recv", R, H, "work"),
        buf("da", R, F, "work"),
        buf("dh", R, A, "work"),
        buf("dx_rows", R, H, "work"),
        buf("dx_ret", Er, H, "work"),
        buf("dx_TH", T, H, "output"),
        buf("dtopk_TK", T, K, "output"),
        *grads,
    )


def task_count(bucket: ShapeBucket, direction: str, unsplit: tuple[str, ...] = ()) -> int:
    """Tasks of one rank's plan, from split propagation alone (nothing is built).

    Cheap for any bucket (one ``task_num_fn`` call per operator), so callers can refuse an
    absurd size before compiling. Raises ``GraphError`` for an unknown ``unsplit`` operator.
    """
    split = propagate_splits(moe_graph(direction, bucket.activation).graph, bucket, unsplit=unsplit)
    return sum(split.task_num.values())
