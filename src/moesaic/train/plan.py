"""``moesaic train --plan FILE.json|auto``: train with the combination ``moesaic plan`` ranked first.

A plan entry is one object of ``moesaic plan --json``'s list: ``strategy``, ``schedule`` and
``options`` (and its prediction, which training does not need). ``--plan FILE.json`` reads that
list and takes its first entry (or a file holding one such object). ``strategy`` sets
``model.moe.dispatcher`` (``--strategy``), ``schedule`` the schedule; among the options,
``pipeline_degree``, ``ar_chunk``, ``dp_shard`` and ``ep`` (``RUN_OPTIONS``; ``dp_shard`` only
where ``moesaic plan --memory-per-rank`` sharded the pick to fit, ``ep`` only where ``moesaic plan
--ep`` priced EP groups below the world) set the run options of those names, and
``capacity_factor`` (``MODEL_OPTIONS``: in an entry only when ``moesaic plan
--capacity-factor`` allowed the planner to change the model's capacity) sets
``model.moe.capacity_factor``, and every other one is an option of the strategy's options class
(``MoEConfig.options``: the domain sizes, compression ratio, plan order, ...), as its flag
would set it (``--domains``).

A flag that sets one of them to another value than the plan is refused (naming both); a TOML
key is overridden with a note (a config file is often shared by runs, as ``option_rules`` says).
The strategy options go through :func:`strategy_option_dest`, the one place that knows where a
strategy's options live in the configuration.

An entry of ``moesaic plan --json`` also records the job it was priced for (``made_for``: the
world size, the cluster, the model's shape in ``PLAN_SHAPE_FIELDS`` and the machine profile).
A run whose world, model or cluster differs is refused (:func:`check_plan_fits`) unless
``--force-plan``; either way the run prints the combination it applies. An error that a value
set by the plan causes names the plan (:func:`blame_plan`).

``--plan auto`` chooses at the start of the run instead (:mod:`moesaic.train.plan_auto`): it
needs ``--cluster``, and the options it chooses may not be given too, nor options that apply to
some strategies or schedules only (which the plan may not pick). Torch-free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from moesaic.checks import check_number
from moesaic.cluster.spec import ClusterSpec
from moesaic.schedule import schedule_names
from moesaic.strategy_table import options_class, strategy_names
from moesaic.train.domains import parse_domain_sizes
from moesaic.train.option_rules import rule_of
from moesaic.train.schedule_options import parse_ar_chunk, parse_pipeline_degree

__all__ = [
    "AUTO",
    "MODEL_OPTIONS",
    "PLAN_SHAPE_FIELDS",
    "RUN_OPTIONS",
    "apply_plan_option",
    "blame_plan",
    "check_auto_options",
    "check_entry",
    "check_plan_fits",
    "cluster_name",
    "combination_record",
    "made_for",
    "plan_record",
    "plan_settings",
    "ranking_json",
    "read_plan",
    "set_plan",
    "strategy_option_dest",
    "strategy_options",
]

AUTO = "auto"
# The plan options that are run options of the same name; the others are strategy options.
RUN_OPTIONS = ("pipeline_degree", "ar_chunk", "dp_shard", "ep")
# The plan options that change the model, by their dest: a plan has them only when the planner
# was allowed to (``moesaic plan --capacity-factor``).
MODEL_OPTIONS = {"capacity_factor": "model.moe.capacity_factor"}
# The dests a plan decides besides its strategy's options.
# (``--plan auto`` does not shard: a given ``--dp-shard`` stays the user's.)
CHOSEN = ("model.moe.dispatcher", "schedule", "pipeline_degree", "ar_chunk")
# The model's shape a plan is priced for, by the names of the simulator's ``ModelSpec`` fields
# (MoE blocks, one rank's batch); :func:`run_shape` reads the same from a training config.
PLAN_SHAPE_FIELDS = ("layers", "batch", "seq_len", "hidden", "ffn_hidden", "experts", "top_k")


def strategy_option_dest(option: str) -> str:
    """Where strategy option ``option`` lives in a training configuration (an argparse dest and
    a path in the TOML layout): ``model.moe.options.<option>`` (``MoEConfig.options``). The one
    place that knows it."""
    return f"model.moe.options.{option}"


def strategy_options(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The strategy options among ``settings`` (by dest, :func:`plan_settings`), by option name:
    what ``MoEConfig.options`` takes."""
    prefix = strategy_option_dest("")
    return {k.removeprefix(prefix): v for k, v in settings.items() if k.startswith(prefix)}


def _chosen(dest: str) -> bool:
    """Whether a plan decides ``dest``: the strategy, the schedule, the run options it sets and
    every strategy option (the plan picks the strategy, and with it whose options apply)."""
    return dest in CHOSEN or dest.startswith(strategy_option_dest(""))


def check_entry(entry: object, where: str) -> dict[str, Any]:
    """``entry`` is a plan entry: an object with a registered ``strategy``, a ``schedule`` and
    ``options`` that are ``RUN_OPTIONS`` or options of the strategy (errors name ``where``)."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where}: a plan entry must be an object, got {type(entry).__name__}")
    missing = [k for k in ("strategy", "schedule", "options") if k not in entry]
    if missing:
        raise ValueError(f"{where}: the plan entry has no {', '.join(missing)}")
    strategy, schedule, options = entry["strategy"], entry["schedule"], entry["options"]
    if strategy not in strategy_names():
        raise ValueError(
            f"{where}: strategy {strategy!r} is not registered ({', '.join(strategy_names())})"
        )
    if schedule not in schedule_names():
        raise ValueError(
            f"{where}: schedule {schedule!r} is not one of {', '.join(schedule_names())}"
        )
    if not isinstance(options, Mapping):
        raise ValueError(f"{where}: options must be an object, got {options!r}")
    own = options_class(strategy).names()
    for name in options:
        if name not in RUN_OPTIONS and name not in MODEL_OPTIONS and name not in own:
            raise ValueError(
                f"{where}: option {name!r} is neither a run option ({', '.join(RUN_OPTIONS)}), "
                f"a model option ({', '.join(MODEL_OPTIONS)}) nor one of strategy {strategy!r} "
                f"({', '.join(own) or 'it has none'})"
            )
    if "capacity_factor" in options:
        check_number(
            f"{where}: option capacity_factor", options["capacity_factor"], 0.0, lo_open=True
        )
    return dict(entry)


def read_plan(path: str) -> dict[str, Any]:
    """The entry of ``--plan FILE.json``: the first of ``moesaic plan --json``'s list, or the
    file's one object."""
    where = f"--plan {path}"
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: not a JSON plan ({exc})") from None
    if isinstance(data, list):
        if not data:
            raise ValueError(f"{where}: the plan lists no combination")
        data = data[0]
    return check_entry(data, where)


def plan_settings(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The options an entry sets, by dest (``schedule``, ``model.moe.dispatcher``, ...): the
    pipeline degree 1 when the entry has none; Sp only when it has one (``ar_chunk`` applies
    to the pooled schedules only)."""
    options = entry["options"]
    out: dict[str, Any] = {
        "model.moe.dispatcher": entry["strategy"],
        "schedule": entry["schedule"],
        "pipeline_degree": options.get("pipeline_degree", 1),
    }
    if "ar_chunk" in options:
        out["ar_chunk"] = options["ar_chunk"]
    if "dp_shard" in options:  # (moesaic plan --memory-per-rank: the sharding that fits)
        out["dp_shard"] = options["dp_shard"]
    if "ep" in options:  # (moesaic plan --ep: replicas of an EP group below the world)
        out["ep"] = options["ep"]
    for name, value in options.items():
        if name in MODEL_OPTIONS:
            out[MODEL_OPTIONS[name]] = value
        elif name not in RUN_OPTIONS:
            out[strategy_option_dest(name)] = value
    return out


def _normal(dest: str, value: Any) -> Any:
    """A value as its option's parser reads it, so that ``--ar-chunk 4KiB`` equals 4096."""
    if dest == "pipeline_degree":
        return parse_pipeline_degree(value)
    if dest == "ar_chunk":
        return parse_ar_chunk(value)
    if dest == strategy_option_dest("domain_sizes"):
        return parse_domain_sizes(value)
    if dest in (strategy_option_dest("compression_ratio"), MODEL_OPTIONS["capacity_factor"]):
        return float(value) if isinstance(value, (int, float)) else value
    return value


def _get(d: Mapping[str, Any], dest: str) -> Any:
    node: Any = d
    for part in dest.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _set(d: dict[str, Any], dest: str, value: Any) -> None:
    *path, last = dest.split(".")
    node = d
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def set_plan(
    d: dict[str, Any],
    given: dict[str, str],
    path: str,
    *,
    note: Callable[[str], None],
) -> None:
    """``--plan FILE.json`` applied to the merged options ``d`` (TOML layout, flags in):
    ``given`` (dest -> a flag or the TOML file) says what the user set.

    Raises:
        ValueError: a flag sets an option of the plan to another value (all of them named), or
            the file is not a plan entry.
    """
    settings = plan_settings(read_plan(path))
    conflicts = []
    for dest, value in settings.items():
        source = given.get(dest)
        if source is None:
            continue
        mine = _get(d, dest)
        if _normal(dest, mine) == _normal(dest, value):
            continue
        if source.startswith("--"):
            conflicts.append(f"{source} {mine} (the plan: {value})")
        else:
            note(f"{dest} = {mine!r} in {source} is overridden by --plan {path}: {value!r}")
    if conflicts:
        raise ValueError(
            f"--plan {path} sets what these flags set, to other values: {'; '.join(conflicts)}; "
            "drop the flags or the plan"
        )
    for dest, value in settings.items():
        _set(d, dest, value)
        given[dest] = f"--plan {path}"  # judged like a flag: a plan option must apply


def check_auto_options(given: Mapping[str, str], note: Callable[[str], None]) -> list[str]:
    """``--plan auto``: the options given that it would contradict. A flag among the options
    the plan chooses, or among those that apply to some strategies or schedules only, is
    refused; such a TOML key gets a note (it is overridden, or may have no effect). Returns
    the dests to leave out of ``option_rules.check_applicable`` (the plan decides them).

    Raises:
        ValueError: naming every such flag.
    """
    refused, judged = [], []
    for dest, source in given.items():
        if dest in ("cluster", "plan"):  # what the plan is made from
            judged.append(dest)
            continue
        rule = rule_of(dest)
        limited = rule is not None and (
            rule.strategies is not None or rule.schedule_trait is not None
        )
        if not _chosen(dest) and not limited:
            continue
        judged.append(dest)
        why = "chooses it"
        if not _chosen(dest) and rule is not None:
            why = f"may pick what it does not apply to ({rule.what})"
        if source.startswith("--"):
            refused.append(f"{source} (--plan auto {why})")
        else:
            note(f"{dest} in {source}: --plan auto {why}; the plan decides")
    if refused:
        raise ValueError(
            f"--plan auto chooses the strategy, schedule and their options itself: drop "
            f"{'; '.join(refused)}, or plan first (moesaic plan --json > plan.json) and train "
            "with --plan plan.json"
        )
    return judged


def apply_plan_option(
    d: dict[str, Any], given: dict[str, str], note: Callable[[str], None]
) -> set[str]:
    """``d["plan"]`` (the merged options of ``moesaic train``), applied: a file's entry set into
    ``d`` (:func:`set_plan`), ``auto``'s options checked (:func:`check_auto_options`). Returns
    the dests ``option_rules.check_applicable`` must leave to the plan (``cluster``, which a
    plan is made on, is noted rather than refused when the pick does not read it)."""
    plan = d.get("plan")
    if plan is None:
        return set()
    if plan == AUTO:
        return set(check_auto_options(given, note))
    if not isinstance(plan, str) or not plan:
        raise ValueError(f"plan must be 'auto' or a JSON file of moesaic plan, got {plan!r}")
    set_plan(d, given, plan, note=note)
    # The cluster a plan was made on is worth giving whatever it picked: a note, not a refusal,
    # when the pick does not read it.
    rule = rule_of("cluster")
    strategy = _get(d, "model.moe.dispatcher")
    if "cluster" in given and rule is not None and rule.misfit(strategy, d["schedule"]):
        note(f"cluster ({given['cluster']}) has no effect with the plan's strategy {strategy!r}")
    return {"cluster"}


def combination_record(cfg: Any) -> dict[str, Any]:
    """The combination a run trained (a ``TrainConfig``, after ``auto`` was resolved): its
    strategy, schedule, the run options a plan sets and the strategy's options, every one
    resolved; two runs with equal records trained the same combination, however it was asked
    for (flags, a TOML file or ``--plan``)."""
    moe = cfg.model.moe
    return {
        "strategy": moe.dispatcher,
        "schedule": cfg.schedule,
        "pipeline_degree": cfg.pipeline_degree,
        "ar_chunk": cfg.ar_chunk,
        "capacity_factor": moe.capacity_factor,
        "options": moe.options.to_dict(),
    }


def plan_record(cfg: Any) -> dict[str, Any] | None:
    """What a run with ``--plan`` trained: its source and :func:`combination_record` (None
    without ``--plan``)."""
    if cfg.plan is None:
        return None
    return {"source": cfg.plan, **combination_record(cfg)}


def ranking_json(
    plan: Any, job: dict[str, Any], peaks: Sequence[float] = ()
) -> list[dict[str, Any]]:
    """A ranking (``moesaic.planning.planner.Plan``) as the plan file's entries: every
    candidate, fastest first, with its rank and the job it was made for (``made_for``:
    ``moesaic train --plan`` refuses it for another), the first with the reason, and each its
    predicted per-rank peak when ``peaks`` are given (``planning.plan_memory``)."""
    rows = [{"rank": i + 1, **c.to_dict(), "made_for": job} for i, c in enumerate(plan.ranked)]
    rows[0]["reason"] = plan.reason
    for row, peak in zip(rows, peaks):
        row["peak_bytes_per_rank"] = peak
    return rows


def made_for(
    *, world_size: int, cluster: str, shape: Mapping[str, int], profile: str
) -> dict[str, Any]:
    """The ``made_for`` record of a plan entry (``moesaic plan --json``)."""
    return {
        "world_size": world_size,
        "cluster": cluster,
        "model": {name: shape[name] for name in PLAN_SHAPE_FIELDS},
        "profile": profile,
    }


def run_shape(cfg: Any) -> dict[str, int]:
    """A training config's model shape as a plan records it (``PLAN_SHAPE_FIELDS``)."""
    model, moe = cfg.model, cfg.model.moe
    return dict(
        zip(
            PLAN_SHAPE_FIELDS,
            (
                model.num_moe_layers,
                cfg.batch_size,
                model.seq_len,
                model.d_model,
                moe.ffn_hidden_size,
                moe.num_experts,
                moe.top_k,
            ),
            strict=True,
        )
    )


def _mismatches(record: Any, cfg: Any, world_size: int | None, cluster: str | None) -> list[str]:
    """What differs between a plan's ``made_for`` and this run, one phrase each."""
    if not isinstance(record, Mapping) or not isinstance(record.get("model"), Mapping):
        return ["its made_for record is not an object with a model"]
    out = []
    if world_size is not None and record.get("world_size") != world_size:
        out.append(f"world_size {record.get('world_size')} (this run: {world_size})")
    if cluster is not None and record.get("cluster") != cluster:
        out.append(f"cluster {record.get('cluster')!r} (this run: {cluster!r})")
    mine = run_shape(cfg)
    for name in PLAN_SHAPE_FIELDS:
        if record["model"].get(name) != mine[name]:
            out.append(f"model {name} {record['model'].get(name)} (this run: {mine[name]})")
    return out


def _applied(entry: Mapping[str, Any], path: str) -> str:
    options = ", ".join(f"{k} {v}" for k, v in entry["options"].items())
    rank = f" (ranked {entry['rank']})" if "rank" in entry else ""
    what = f"{entry['strategy']} / {entry['schedule']}" + (f" with {options}" if options else "")
    record = entry.get("made_for")
    if isinstance(record, Mapping):
        made = (
            f"; made for {record.get('world_size')} ranks on cluster {record.get('cluster')!r}, "
            f"profile {record.get('profile')}"
        )
    else:
        made = "; it records no job it was made for (an older moesaic plan)"
    return f"--plan {path}: training {what}{rank}{made}"


def cluster_name(cfg: Any) -> str | None:
    """The name of the cluster a run describes (``--cluster``, else ``--emulate``), or None."""
    path = cfg.cluster or cfg.emulate
    return None if path is None else ClusterSpec.from_toml(path).name


def check_plan_fits(
    cfg: Any, world_size: int | None, cluster: str | None, note: Callable[[str], None]
) -> str | None:
    """``--plan FILE.json``: refuse a plan made for another world, cluster or model (unless
    ``cfg.force_plan``, then a note); returns the line saying which combination the run
    applies, for the caller to print once the rest of the run is checked (None without a
    plan file).

    Args:
        cfg: the run's ``TrainConfig`` (its ``plan`` a file; anything else is not checked).
        world_size: the run's world size, None where not known yet.
        cluster: the name of the run's ``--cluster``, None without one.
        note: where the lines go (one each).

    Raises:
        ValueError: naming every difference, and the flag that applies the plan anyway.
    """
    if cfg.plan is None or cfg.plan == AUTO:
        return None
    entry = read_plan(cfg.plan)
    record = entry.get("made_for")
    if record is not None:
        differ = _mismatches(record, cfg, world_size, cluster)
        if differ:
            line = f"--plan {cfg.plan} was made for another job: {'; '.join(differ)}"
            if not cfg.force_plan:
                raise ValueError(
                    f"{line}; plan this job (moesaic plan --json) or pass --force-plan"
                )
            note(f"{line}; applied anyway (--force-plan)")
    return _applied(entry, cfg.plan)


def blame_plan(exc: ValueError, path: str) -> ValueError:
    """``exc`` (raised by the configuration ``--plan path`` was applied to) naming the plan
    when it is about an option the plan set: ``pipeline_degree (4) must divide batch_size
    (2)`` came from the plan, not from a flag."""
    settings = plan_settings(read_plan(path))
    for dest, value in settings.items():
        name = dest.rsplit(".", 1)[-1]
        if re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", str(exc)):
            return ValueError(f"--plan {path} sets {name} {value}: {exc}")
    return exc
