"""Draw a plan: one lane per queue, tasks placed at their simulated start, dependency arrows.

The timeline comes from the event engine (``validate.simulate``) with a nominal cost per task
(``nominal_cost``, from the task type's cost class): it shows the shape of the overlap the static
order allows, not a measurement. Needs matplotlib (the ``viz`` extra), imported only when drawing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from moesaic.taskflow.moe_graphs import NOMINAL_WEIGHT, TASK_TYPES
from moesaic.taskflow.plan import Plan
from moesaic.taskflow.tasks import TaskDescriptor
from moesaic.taskflow.validate import simulate

MAX_ARROWS = 400


def nominal_cost(t: TaskDescriptor, tile_m: int) -> float:
    """Nominal duration of a task: rows over ``tile_m`` times its cost class's weight
    (``moe_graphs.NOMINAL_WEIGHT``); a put moves the rows of all its output regions."""
    kind = TASK_TYPES[t.task_type]
    rows = sum(r.rows for r in t.outputs) if kind.put else t.split_value
    return NOMINAL_WEIGHT[kind.cost_class] * max(rows, 1) / tile_m


def draw_plan(
    plan: Plan,
    path: str | os.PathLike,
    *,
    world: Sequence[Plan] | None = None,
    arrows: bool | None = None,
) -> Path:
    """Write a PNG of ``plan``'s two queues.

    Args:
        plan: the plan to draw.
        path: output file.
        world: every rank's plan; when given, remote writes arrive when their senders finish
            them (a whole-world simulation), else they count as arrived at time 0.
        arrows: draw producer -> consumer arrows (default: only when there are at most
            ``MAX_ARROWS`` local dependencies).

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError as exc:
        raise RuntimeError("drawing a plan needs matplotlib: pip install 'moesaic[viz]'") from exc
    tile_m = plan.bucket.tile_m

    def cost(t: TaskDescriptor) -> float:
        return nominal_cost(t, tile_m)

    tl = simulate(world if world is not None else [plan], world=world is not None, cost=cost)
    start = {uid: tl.start[(plan.rank, uid)] for uid in range(len(plan.tasks))}
    end = {uid: tl.end[(plan.rank, uid)] for uid in range(len(plan.tasks))}
    ops = list(plan.task_num)
    cmap = plt.get_cmap("tab10")
    color = {op: cmap(i % 10) for i, op in enumerate(ops)}
    names = plan.schedule.names  # one lane per queue, the first at the top
    lane_y = {name: float(len(names) - 1 - i) for i, name in enumerate(names)}
    queue_of = plan.schedule.queue_of()
    lane = {uid: lane_y[q] for uid, q in queue_of.items()}
    makespan = max(end.values(), default=1.0)
    fig, ax = plt.subplots(figsize=(min(40.0, 6 + makespan * 0.35), 3.2))
    for t in plan.tasks:
        s, e = start[t.uid], end[t.uid]
        ax.add_patch(
            Rectangle(
                (s, lane[t.uid] - 0.35),
                max(e - s, 1e-3),
                0.7,
                facecolor=color[t.op],
                edgecolor="black",
                linewidth=0.3,
            )
        )
    by_key = {(t.op, t.task_index): t for t in plan.tasks}
    deps = [
        (by_key[(p.op, p.task_index)], t)
        for t in plan.tasks
        if t.dependent_event >= 0
        for p in plan.events[t.dependent_event].producers
        if p.rank == plan.rank
    ]
    if arrows if arrows is not None else len(deps) <= MAX_ARROWS:
        for p, c in deps:
            ax.annotate(
                "",
                xy=(start[c.uid], lane[c.uid]),
                xytext=(end[p.uid], lane[p.uid]),
                arrowprops={"arrowstyle": "->", "lw": 0.4, "alpha": 0.5},
            )
    ax.set_xlim(0, makespan * 1.02)
    ax.set_ylim(-0.7, len(names) - 0.3)
    ax.set_yticks([lane_y[n] for n in names], [f"{n} queue" for n in names])
    ax.set_xlabel("simulated time (nominal tile costs)")
    b = plan.bucket
    ax.set_title(
        f"{plan.direction} plan, rank {plan.rank} of EP {b.ep_size}: {len(plan.tasks)} tasks, "
        f"{len(plan.events)} events (T={b.tokens} E={b.experts} K={b.top_k} S={b.slot_rows})",
        fontsize=9,
    )
    ax.legend(
        handles=[Patch(facecolor=color[o], label=o) for o in ops],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
