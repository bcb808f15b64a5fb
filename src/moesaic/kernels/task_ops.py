"""The device task table's vocabulary: opcodes and columns (no Triton here).

``taskflow.lower`` writes task tables with these numbers and ``kernels.persistent`` executes
them; both import this module, which imports nothing, so the torch path (and the lowering and
its validation) never needs Triton.

A task table is ``int32 [n, NCOL]``, one row per device task, columns:

* ``OP``: the opcode (``OPCODES``, by the plan's task type).
* ``UID``: the plan task it comes from (several rows when the task spans several slots or
  experts: each waits and bumps; an event's threshold counts its producers' rows).
* ``WAIT``, ``THRESH``: the local event it waits on (-1: none) and that event's threshold.
* ``TRIG0``, ``NTRIG``: its triggers, ``triggers[TRIG0 : TRIG0 + NTRIG]`` (event ids), each on
  rank ``trigger_ranks[k]`` (a put's arrival signal lands on the put's target).
* ``EXPERT``: local expert of a GEMM tile or weight-gradient task (-1: none).
* ``SLOT``, ``VOFF``: the entry of the step's count table (``count[:e * P]``: rows received
  per local slot ``j * P + s``; ``count[e * P + g]``: rows sent to global expert ``g``, what a
  dispatch put carries) that gives the valid rows, and the row offset of the tile inside that
  slot: ``valid = clamp(count[SLOT] - VOFF, 0, ROWS)`` (-1: every row).
* ``ROW0``: first row read (receive rows; tokens for token tiles; for a dispatch, the
  return-layout position ``expert * S + VOFF`` of its first row in the step's token table).
* ``DST0``: first row written (the destination rows of a put: the window offset in rows).
* ``ROWS``: rows of the tile (tokens for token tiles; for a weight gradient, unused).
* ``PEER``: the rank whose buffer a put writes (the row's own rank for other rows).
* ``HOME``: the launch slot of the rank that runs the row: 0 in one rank's table; a
  virtual-rank launch (several ranks' tables in one launch) numbers the ranks 0 .. V - 1.
"""

from __future__ import annotations

# Opcodes by plan task type (``moe_graphs.TASK_TYPES``); 0 is never used (an unset row).
OPCODES: dict[str, int] = {
    "put_dispatch": 1,
    "gmm_gate_up": 2,
    "swiglu": 3,
    "gmm_down": 4,
    "put_combine": 5,
    "topk_combine": 6,
    "put_dispatch_grad": 7,
    "gmm_act_grad": 8,
    "gmm_w2_grad": 9,
    "swiglu_grad": 10,
    "gmm_gate_grad": 11,
    "gmm_w1_grad": 12,
    "sum_combine": 13,
    "topk_weight_grad": 14,
}
# The opcodes each direction's kernel executes (any other opcode is refused by the lowering).
FORWARD_OPS = frozenset(
    OPCODES[n]
    for n in ("put_dispatch", "gmm_gate_up", "swiglu", "gmm_down", "put_combine", "topk_combine")
)
BACKWARD_OPS = frozenset(
    OPCODES[n]
    for n in (
        "put_dispatch_grad",
        "gmm_act_grad",
        "gmm_w2_grad",
        "swiglu_grad",
        "gmm_gate_grad",
        "put_combine",
        "gmm_w1_grad",
        "sum_combine",
        "topk_weight_grad",
    )
)
# Weight-gradient opcodes: one task per local expert, over all P slots of that expert.
WEIGHT_GRAD_OPS = frozenset((OPCODES["gmm_w2_grad"], OPCODES["gmm_w1_grad"]))
# Token-tiled opcodes: ROW0 / ROWS are tokens.
TOKEN_OPS = frozenset(OPCODES[n] for n in ("topk_combine", "sum_combine", "topk_weight_grad"))

COLUMNS = (
    "OP",
    "UID",
    "WAIT",
    "THRESH",
    "TRIG0",
    "NTRIG",
    "EXPERT",
    "SLOT",
    "VOFF",
    "ROW0",
    "DST0",
    "ROWS",
    "PEER",
    "HOME",
)
NCOL = len(COLUMNS)
OP, UID, WAIT, THRESH, TRIG0, NTRIG, EXPERT, SLOT, VOFF, ROW0, DST0, ROWS, PEER, HOME = range(NCOL)
