"""What may run with FSDP2 sharding (``--dp-shard``, ``--dp-replicate``): read from the
strategies' and schedules' declarations (``Supports.unsharded_why``, ``ScheduleSpec.unsharded_why``)
by the trainer's config (``train.mesh``) and the planner's memory fit (``plan_memory``).
Torch-free.
"""

from __future__ import annotations

from moesaic.schedule_table import schedule_names, schedule_spec
from moesaic.strategies.registry import check_supported

__all__ = ["check_sharding"]


def check_sharding(strategy: str, schedule: str) -> None:
    """Refuse a strategy or a schedule that does not run with FSDP2 sharding, through their
    declarations (``Supports.unsharded_why``, ``ScheduleSpec.unsharded_why``), naming why.

    Raises:
        ValueError: one line naming the strategy or schedule, the options and the reason.
    """
    check_supported(strategy, sharded=True)
    why = schedule_spec(schedule).unsharded_why
    if why:
        runs = [n for n in schedule_names() if not schedule_spec(n).unsharded_why]
        raise ValueError(
            f"schedule {schedule!r} does not run with FSDP sharding (--dp-shard, "
            f"--dp-replicate): {why}; choose --schedule {' or '.join(runs)}"
        )
