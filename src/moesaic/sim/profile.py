"""A machine profile: the rates a simulation turns FLOPs and bytes into seconds.

``moesaic calibrate`` writes one (JSON); ``moesaic simulate --profile FILE`` reads it. What is
measured and what is taken from elsewhere:

* ``flops_per_s``, ``half_flops_per_s``: measured, the median rate of square fp32 and bf16
  matmuls (512 on a CPU, 4096 on a GPU) on this machine's CPU (one process, the threads torch
  uses), or a GPU's when one is present; a model with 2-byte activations is simulated at the
  bf16 rate (:meth:`Profile.for_model`);
* ``task_overhead_s``: measured, the time of a tiny matmul op times the ops a stage runs
  (``OPS_PER_TASK``): framework cost a FLOP count does not see;
* ``floor_s``: the latency floor of one collective step: the one-way latency of an unshaped
  pair of emulated ranks (100 Gbit/s, 0 ms), measured by ``calibrate --cluster`` (see
  :mod:`moesaic.measure.calibrate`) or read from a cluster check result (``--links``), else 0;
* ``bandwidth_scale``: the links' measured share of their configured rate (the median over the
  levels of measured / configured bandwidth), or 1.0: the spec's figures;
* ``collectives``: with ``--cluster``, the emulated cluster's all-to-all and all-reduce timed at
  a few sizes, each as the bandwidth share (:class:`CollectiveShare`) that makes the simulator's
  own closed form (:mod:`moesaic.sim.collectives`, on the point-to-point links above) reproduce
  the measured time: what the collective loses beyond its links. Two regimes: ``"idle"``
  (isolated calls after a barrier on an otherwise idle machine) and ``"loaded"`` (an unbroken
  stream of calls after a warm-up while every rank computes in a thread, as a training step
  does: CPU-starved ranks push TCP on a shaped link into a mode about half as fast; see
  :mod:`moesaic.measure.calibrate`). The simulation prices all-to-all(-v)s and all-reduces /
  all-gathers with the loaded shares when the profile has them, else the idle ones (profiles
  written before the regime existed), interpolated in log size; point-to-point messages with
  the link share only;
* ``tile_cpu_s``, ``put_cpu_s``, ``put_cpu_per_byte_s``: CPU seconds the taskflow runtime
  spends per tile beyond its FLOPs (the static executor's per-task overhead; not measured by
  ``calibrate``: ``benchmarks/results/taskflow_sched.json`` has it) and per remote put and
  byte (gloo's header and payload messages, the kernel's stack, the receiver's subscriber
  thread; ``calibrate --cluster`` measures them on the emulated link), charged to the rank's
  queues (:mod:`moesaic.sim.taskflow`); ``tile_elem_cpu_s``: the handlers' CPU per element of
  an elementwise, reduction or put tile (:mod:`moesaic.measure.cpucal`, one rank, no network);
* ``cores``, ``ranks_per_machine``: when both are > 0, a taskflow step takes at least its
  rank's CPU time / (cores / ranks_per_machine) (its queues' threads share those cores); with
  ``comm_cpu_per_byte_s`` or ``ops`` too, the other strategies' compute slows down where the
  rank's threads and its communication's CPU want more than its cores (:mod:`moesaic.sim.contention`);
* ``comm_cpu_s``, ``comm_cpu_per_byte_s``: CPU seconds a rank spends per collective call and
  per byte it sends (the communication thread, gloo, the kernel's stack and the emulated link's
  queue), measured by ``calibrate --cluster`` as the remote puts' (sender and receiver
  together: a rank of an all-to-all sends and receives about as many bytes); 0: not modelled;
* ``a2a_call_s``, ``allreduce_call_s``: with ``--cluster``, the time of a tiny all-to-all
  (per call, issued back to back and each waited; before 2026-12-05 one call alone after a
  barrier, its slowest rank) and of a tiny all-reduce (per call, in a stream issued at once):
  floors of the collectives' latency terms (:mod:`moesaic.sim.collectives`, "Measured call
  floors"); 0: not measured (profiles written before them); ``allreduce_loaded_call_s``: one
  tiny all-reduce issued alone while every rank computes (FlowMoE's chunks in the backward);
  ``allreduce_alone_call_s``: one tiny all-reduce issued alone on the idle machine (a
  training step's control collective, :mod:`moesaic.sim.steptail`);
* ``sync_waits``: with ``--cluster``, what a blocking all-to-all waits beyond its price when
  the ranks reach it after a stretch of compute rather than together (:class:`SyncWait`,
  :mod:`moesaic.sim.syncwait`); empty: not measured;
* ``comm_cpu_busy``: cores a rank's communication keeps busy for as long as a collective is in
  flight beyond those two, measured by ``calibrate --cluster`` as its compute's slowdown while
  an all-to-all stream runs (:mod:`moesaic.measure.cpuload`); 0: not modelled;
* ``ops``: with ``calibrate --model``, the model's own operations timed on this machine
  (:class:`moesaic.sim.opcal.OpCal`): the pipelined strategies price their tasks from them
  instead of ``flops_per_s`` (:class:`moesaic.sim.opcal.OpPrices`); None in older profiles;
* ``links``: with ``--cluster``, every level's configured and measured bandwidth and latency
  (:class:`LinkLevel`). A simulation of a cluster whose level has the same name, bandwidth and
  latency as a measured one runs that level at its measured bandwidth; other levels run at
  ``bandwidth_scale`` (:meth:`Profile.link_spec`);
* ``cluster``: with ``--cluster``, the measured cluster itself (name, world size, every level's
  name, size, bandwidth and latency). ``moesaic simulate`` refuses a profile whose cluster
  differs from the one simulated (:meth:`Profile.cluster_differences`): its collective shares
  and link rates were measured on other levels and another world. None in profiles written
  before it was recorded, and in those measured without a cluster;
* ``routing``: with ``calibrate --model`` on a training config, the expert loads of the job's
  first steps on its own data (:class:`RoutingLoads`, :mod:`moesaic.train.routing_run`), which
  ``simulate`` and ``plan`` price instead of uniform routing when the model has as many
  experts; None otherwise.

Torch-free (the measuring is :mod:`moesaic.measure.machine`'s).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from moesaic.checks import (
    check_int,
    check_non_negative,
    check_number,
    check_one_of,
    check_positive,
)
from moesaic.cluster.spec import ClusterSpec
from moesaic.sim.interp import log_linear
from moesaic.sim.model import ModelSpec, load_rows
from moesaic.sim.opcal import OpCal

__all__ = [
    "COLLECTIVE_KINDS",
    "COLLECTIVE_REGIMES",
    "OPS_PER_TASK",
    "CollectiveShare",
    "LevelShare",
    "LinkLevel",
    "Profile",
    "RoutingLoads",
    "cluster_differences",
    "describe_cluster",
    "links_from_cluster_check",
]

# Torch ops in one pipeline stage's forward (norm, QKV, split, SDPA, projection, residual,
# router softmax/top-k, permutation...): counted on models/gpt.py's attention stage (~30).
OPS_PER_TASK = 30

# Where a profile's compute was measured (``Profile.device``).
DEVICES = ("cpu", "cuda")

# Collectives whose measured efficiency a profile may hold.
COLLECTIVE_KINDS = ("all_to_all", "all_reduce")

# How a collective was timed: isolated calls after a barrier on an idle machine ("idle", the
# only regime of profiles from before it was recorded), or in an unbroken stream while every
# rank computes ("loaded", what a training step sees). A simulation prefers "loaded".
COLLECTIVE_REGIMES = ("idle", "loaded")


@dataclass(kw_only=True, slots=True, frozen=True)
class CollectiveShare:
    """One collective measured at one size on an emulated cluster.

    Attributes:
        kind: ``"all_to_all"`` or ``"all_reduce"``.
        bytes_per_rank: Bytes every rank contributed (``all_to_all_single``'s send buffer, the
            all-reduced tensor).
        share: Multiplier of the point-to-point link rates under which the simulator's closed
            form gives the measured time (its latencies unchanged).
        measured_s: The measured mean time (slowest rank), for the record.
        regime: ``"idle"`` (isolated calls) or ``"loaded"`` (an unbroken stream while the
            ranks compute); see ``COLLECTIVE_REGIMES``.
    """

    kind: str
    bytes_per_rank: float
    share: float
    measured_s: float = 0.0
    regime: str = "idle"

    def __post_init__(self) -> None:
        check_one_of("collectives.kind", self.kind, COLLECTIVE_KINDS)
        check_one_of("collectives.regime", self.regime, COLLECTIVE_REGIMES)
        check_positive("collectives.bytes_per_rank", self.bytes_per_rank)
        check_positive("collectives.share", self.share)
        check_non_negative("collectives.measured_s", self.measured_s)


@dataclass(kw_only=True, slots=True, frozen=True)
class LevelShare:
    """One level's exchange measured at one size on an emulated cluster of several levels: an
    all-to-all over every group of ranks that differ only in that level's coordinate, all
    groups at once (HybridEP's gathers, gradient reduces and an offset group's exchange inside
    one level run so; ``calibrate.level_shares``).

    Attributes:
        level: The level's index (outermost 0).
        bytes_per_rank: Bytes every rank sent in the call (``all_to_all_single``'s buffer).
        share: Multiplier of the link rates under which
            :func:`~moesaic.sim.collectives.level_exchange_s` gives the measured time.
        measured_s: The measured mean time (slowest rank), for the record.
        regime: ``"idle"`` or ``"loaded"``, as :class:`CollectiveShare`'s.
    """

    level: int
    bytes_per_rank: float
    share: float
    measured_s: float = 0.0
    regime: str = "idle"

    def __post_init__(self) -> None:
        check_int("level_shares.level", self.level, 0)
        check_one_of("level_shares.regime", self.regime, COLLECTIVE_REGIMES)
        check_positive("level_shares.bytes_per_rank", self.bytes_per_rank)
        check_positive("level_shares.share", self.share)
        check_non_negative("level_shares.measured_s", self.measured_s)


@dataclass(kw_only=True, slots=True, frozen=True)
class SyncWait:
    """What a blocking all-to-all issued after a stretch of compute waits for the ranks'
    desynchronisation, at one segment and size (:mod:`moesaic.sim.syncwait`).

    Attributes:
        compute_s: The compute each rank ran before the call (every rank at once), seconds.
        bytes_per_rank: Bytes every rank sent in the call.
        wait_s: A round's time beyond that compute and the same call issued back to back
            (may be below 0: noise; priced as 0).
    """

    compute_s: float
    bytes_per_rank: float
    wait_s: float

    def __post_init__(self) -> None:
        check_positive("sync_waits.compute_s", self.compute_s)
        check_positive("sync_waits.bytes_per_rank", self.bytes_per_rank)
        if not isinstance(self.wait_s, (int, float)) or not math.isfinite(self.wait_s):
            raise ValueError(f"sync_waits.wait_s ({self.wait_s!r}) must be a finite number")


@dataclass(kw_only=True, slots=True, frozen=True)
class LinkLevel:
    """One level of an emulated cluster as ``calibrate --cluster`` measured it (one rank pair).

    Attributes:
        level_name: The level's name in the cluster file.
        configured_bandwidth_gbps: The spec's rate, Gbit/s.
        measured_bandwidth_gbps: Measured point-to-point rate (two sizes differenced), Gbit/s.
        configured_latency_ms: The spec's one-way latency, ms.
        measured_latency_ms: Measured one-way latency (fastest round trip halved), ms.
    """

    level_name: str
    configured_bandwidth_gbps: float
    measured_bandwidth_gbps: float
    configured_latency_ms: float
    measured_latency_ms: float

    def __post_init__(self) -> None:
        if not isinstance(self.level_name, str) or not self.level_name:
            raise ValueError("links.level_name must be a non-empty string")
        check_positive("links.configured_bandwidth_gbps", self.configured_bandwidth_gbps)
        check_positive("links.measured_bandwidth_gbps", self.measured_bandwidth_gbps)
        check_non_negative("links.configured_latency_ms", self.configured_latency_ms)
        check_non_negative("links.measured_latency_ms", self.measured_latency_ms)

    @property
    def bandwidth_share(self) -> float:
        """Measured / configured bandwidth."""
        return self.measured_bandwidth_gbps / self.configured_bandwidth_gbps


@dataclass(kw_only=True, slots=True, frozen=True)
class RoutingLoads:
    """Expert loads a job's router produced on its data (:mod:`moesaic.train.routing_run`).

    Attributes:
        loads: Rows each expert received, one row per MoE layer, experts in placement order
            (``ModelSpec.measured_loads``).
        source: What was run, for the notes (config, steps, tokens).
    """

    loads: tuple[tuple[float, ...], ...]
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("profile.routing.source must be a non-empty string")
        name = "profile.routing.loads"  # the model's own rule for measured loads
        rows = load_rows(self.loads, name) if isinstance(self.loads, (list, tuple)) else ()
        if not rows:
            raise ValueError(f"{name} must be one non-empty row per MoE layer, all as long")
        object.__setattr__(self, "loads", rows)


@dataclass(kw_only=True, slots=True, frozen=True)
class Profile:
    """Rates of one machine (see the module docstring for what each field is and where from).

    Attributes:
        flops_per_s: Sustained matmul FLOP/s of one rank (fp32).
        half_flops_per_s: The same for 16-bit (bf16) matmuls, which a model with 2-byte
            activations (``act_bytes = 2``) computes at (``for_model``); 0: not measured, the
            fp32 rate stands in.
        task_overhead_s: Fixed seconds added to every compute task.
        floor_s: Latency floor of every collective step, seconds.
        bandwidth_scale: Multiplier of every link's configured bandwidth (but a level measured
            in ``links``, which runs at its measured rate).
        source: Where the figures come from (free text, kept in results).
        links: Per-level measurements behind ``bandwidth_scale`` (empty unless measured).
        collectives: Measured collective shares (empty: collectives run at the link rates).
        level_shares: Measured shares of the exchanges inside one level (empty: those are
            priced with ``collectives``' all-to-all and all-reduce shares).
        tile_cpu_s: CPU seconds per taskflow tile beyond its FLOPs and launch.
        put_cpu_s: CPU seconds per remote taskflow put (sender and receiver together).
        put_cpu_per_byte_s: CPU seconds per byte of a remote put.
        cores: CPU cores of one machine (0: not modelled).
        ranks_per_machine: Ranks sharing those cores (0: not modelled).
        tile_elem_cpu_s: CPU seconds per element of a taskflow elementwise, reduction or put
            tile's handler (memory-bound torch calls on a tile; ``moesaic.measure.cpucal``); 0: not
            measured, such tiles cost 10 FLOPs per element at ``flops_per_s``.
        copy_elem_cpu_s: CPU seconds per element of a large copy into fresh memory (the
            taskflow forward's copies of its receive windows for the backward;
            ``moesaic.measure.cpucal``); 0: not measured, not priced.
        cluster: The cluster ``links``, ``collectives`` and ``ranks_per_machine`` were measured
            on (``calibrate --cluster``); None: not recorded (older profiles) or no cluster.
        comm_cpu_s: CPU seconds of one rank per collective call (0: not modelled).
        comm_cpu_per_byte_s: CPU seconds of one rank per byte it sends (0: not modelled).
        comm_cpu_busy: Cores a rank's communication keeps busy while a collective is in
            flight, beyond the per-call and per-byte CPU (0: not modelled).
        ops: The per-operation measurements of one model (``calibrate --model``); None: every
            task is priced at ``flops_per_s``.
        routing: The expert loads of a training job's first steps (``calibrate --model`` on a
            training config); None: not measured.
        device: Where the compute ran when measured: "cpu" (the host does the work, so a
            task's ``task_overhead_s`` adds to it) or "cuda" (the host launches, the GPU works
            asynchronously: a task costs its device work, its launches overlap it).
        mem_bytes_per_s: Device memory bandwidth, bytes read plus written per second of a
            large device-to-device copy (``machine.measure``): on a GPU the memory-bound passes of a
            task (permutes, activation, combine: ``ModelSpec.expert_bytes``) are priced with
            it; 0: not measured, not priced. Unused on a CPU, whose measured rates (and
            operation timings) include them.
        router_flops_per_s: The router's matmul rate: it computes fp32 logits whatever the
            activations' dtype (``moesaic.routing``): on a CPU in fp32, so for a bf16 model
            ``for_model`` keeps the fp32 rate here while ``flops_per_s`` becomes the bf16 one;
            on a GPU on bf16 tensor cores (``router_gate.gate_logits``), the bf16 rate; 0:
            ``flops_per_s``.
        gemm_efficiency: ``(rows_per_group, efficiency)`` points, by rows: the experts' grouped
            GEMMs (forward and backward) as a fraction of the dense matmul rate at that many
            rows per expert (``moesaic.measure.gpucal``, on a GPU); empty: 1 (the dense rate).
        launch_s: A GPU's seconds per small kernel queued ahead of it (``measure.gpucal``); 0:
            not measured, launches not priced.
        layer_kernels: Kernels of one MoE layer's forward + backward (``measure.gpucal``), each
            priced at ``launch_s`` on a GPU (``layer_launch_s``); 0: not measured.
        layer_host_s: The host's seconds to issue one MoE layer's forward + backward on a
            GPU (``measure.gpucal``): a layer's simulated forward and backward take at least
            their share of it (a third, two thirds); 0: not measured, no floor.
        a2a_call_s: An all-to-all of a few bytes per rank on the measured cluster, per call
            issued back to back (``calibrate --cluster``): the least an all-to-all's latency
            term is; 0: not measured.
        allreduce_call_s: Seconds per all-reduce of a few bytes in a stream of such calls
            issued back to back, as FlowMoE's pool issues its chunks: the least an
            all-reduce's latency terms sum to; 0: not measured.
        allreduce_loaded_call_s: One all-reduce of a few bytes issued alone and waited while
            a thread of every rank computes (``calibrate --cluster``): the least a gradient
            chunk issued beside the backward costs; 0: not measured (the stream's figure).
        allreduce_alone_call_s: One all-reduce of a few bytes issued alone after a barrier on
            the idle machine (``calibrate --cluster``): what a training step's one control
            collective costs at least; 0: not measured (the stream's figure).
        sync_waits: What a collective waits for the ranks' desynchronisation after a stretch
            of compute (``calibrate --cluster``, :mod:`moesaic.sim.syncwait`); empty: not
            measured, collectives start when the representative rank issues them.
    """

    flops_per_s: float
    half_flops_per_s: float = 0.0
    task_overhead_s: float = 0.0
    floor_s: float = 0.0
    bandwidth_scale: float = 1.0
    source: str = "given"
    links: tuple[LinkLevel, ...] = ()
    collectives: tuple[CollectiveShare, ...] = ()
    level_shares: tuple[LevelShare, ...] = ()
    tile_cpu_s: float = 0.0
    put_cpu_s: float = 0.0
    put_cpu_per_byte_s: float = 0.0
    cores: int = 0
    ranks_per_machine: int = 0
    tile_elem_cpu_s: float = 0.0
    copy_elem_cpu_s: float = 0.0
    cluster: ClusterSpec | None = None
    comm_cpu_s: float = 0.0
    comm_cpu_per_byte_s: float = 0.0
    comm_cpu_busy: float = 0.0
    ops: OpCal | None = None
    routing: RoutingLoads | None = None
    device: str = "cpu"
    mem_bytes_per_s: float = 0.0
    router_flops_per_s: float = 0.0
    gemm_efficiency: tuple[tuple[float, float], ...] = ()
    launch_s: float = 0.0
    layer_kernels: float = 0.0
    layer_host_s: float = 0.0
    a2a_call_s: float = 0.0
    allreduce_call_s: float = 0.0
    allreduce_loaded_call_s: float = 0.0
    allreduce_alone_call_s: float = 0.0
    sync_waits: tuple[SyncWait, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.sync_waits, tuple) or not all(
            isinstance(x, SyncWait) for x in self.sync_waits
        ):
            raise ValueError("profile.sync_waits must be a tuple of SyncWait")
        check_non_negative("profile.a2a_call_s", self.a2a_call_s)
        check_non_negative("profile.allreduce_call_s", self.allreduce_call_s)
        check_non_negative("profile.allreduce_loaded_call_s", self.allreduce_loaded_call_s)
        check_non_negative("profile.allreduce_alone_call_s", self.allreduce_alone_call_s)
        check_non_negative("profile.launch_s", self.launch_s)
        check_non_negative("profile.layer_host_s", self.layer_host_s)
        check_non_negative("profile.layer_kernels", self.layer_kernels)
        points = self.gemm_efficiency
        if not isinstance(points, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and p[0] > 0 and p[1] > 0 for p in points
        ):
            raise ValueError(
                "profile.gemm_efficiency must be a tuple of (rows_per_group, efficiency) "
                "pairs, both > 0"
            )
        if [p[0] for p in points] != sorted({p[0] for p in points}):
            raise ValueError("profile.gemm_efficiency's rows_per_group must strictly increase")
        check_one_of("profile.device", self.device, DEVICES)
        check_non_negative("profile.mem_bytes_per_s", self.mem_bytes_per_s)
        check_non_negative("profile.router_flops_per_s", self.router_flops_per_s)
        check_non_negative("profile.comm_cpu_s", self.comm_cpu_s)
        check_non_negative("profile.comm_cpu_per_byte_s", self.comm_cpu_per_byte_s)
        check_number("profile.comm_cpu_busy", self.comm_cpu_busy, 0.0, 1.0)
        if self.ops is not None and not isinstance(self.ops, OpCal):
            raise ValueError("profile.ops must be an OpCal or None")
        if self.routing is not None and not isinstance(self.routing, RoutingLoads):
            raise ValueError("profile.routing must be a RoutingLoads or None")
        check_non_negative("profile.tile_cpu_s", self.tile_cpu_s)
        check_non_negative("profile.tile_elem_cpu_s", self.tile_elem_cpu_s)
        check_non_negative("profile.copy_elem_cpu_s", self.copy_elem_cpu_s)
        check_non_negative("profile.put_cpu_s", self.put_cpu_s)
        check_non_negative("profile.put_cpu_per_byte_s", self.put_cpu_per_byte_s)
        check_int("profile.cores", self.cores, 0)
        check_int("profile.ranks_per_machine", self.ranks_per_machine, 0)
        check_positive("profile.flops_per_s", self.flops_per_s)
        check_non_negative("profile.half_flops_per_s", self.half_flops_per_s)
        check_non_negative("profile.task_overhead_s", self.task_overhead_s)
        check_non_negative("profile.floor_s", self.floor_s)
        check_positive("profile.bandwidth_scale", self.bandwidth_scale)
        if not isinstance(self.source, str):
            raise ValueError("profile.source must be a string")
        if not isinstance(self.links, tuple) or not all(
            isinstance(x, LinkLevel) for x in self.links
        ):
            raise ValueError("profile.links must be a tuple of LinkLevel")
        if not isinstance(self.collectives, tuple) or not all(
            isinstance(x, CollectiveShare) for x in self.collectives
        ):
            raise ValueError("profile.collectives must be a tuple of CollectiveShare")
        if not isinstance(self.level_shares, tuple) or not all(
            isinstance(x, LevelShare) for x in self.level_shares
        ):
            raise ValueError("profile.level_shares must be a tuple of LevelShare")
        if self.cluster is not None and not isinstance(self.cluster, ClusterSpec):
            raise ValueError("profile.cluster must be a ClusterSpec or None")

    @property
    def cluster_bound(self) -> bool:
        """Whether any figure belongs to one cluster (per-level links, collective shares, the
        ranks sharing the cores), as opposed to the machine's compute alone."""
        return bool(self.links or self.collectives or self.level_shares or self.ranks_per_machine)

    def cluster_differences(self, spec: ClusterSpec) -> list[str]:
        """What differs between the measured ``cluster`` and ``spec`` (empty: the same world
        and levels; the clusters' names are not compared). ``cluster`` must be recorded."""
        if self.cluster is None:
            raise ValueError("profile.cluster is not recorded")
        return cluster_differences(self.cluster, spec)

    @property
    def cores_per_rank(self) -> float | None:
        """``cores / ranks_per_machine``; None when either is 0 (not modelled)."""
        if self.cores == 0 or self.ranks_per_machine == 0:
            return None
        return self.cores / self.ranks_per_machine

    def collective_shares(
        self, kind: str, regime: str | None = None
    ) -> tuple[tuple[float, float], ...]:
        """``(bytes_per_rank, share)`` points of one collective kind, by size, of one regime:
        ``regime`` if given, else ``"loaded"`` where the profile has points of that kind
        measured so (what a training step sees), else ``"idle"``."""
        check_one_of("kind", kind, COLLECTIVE_KINDS)
        if regime is None:
            loaded = any(x.kind == kind and x.regime == "loaded" for x in self.collectives)
            regime = "loaded" if loaded else "idle"
        check_one_of("regime", regime, COLLECTIVE_REGIMES)
        return tuple(
            sorted(
                (x.bytes_per_rank, x.share)
                for x in self.collectives
                if x.kind == kind and x.regime == regime
            )
        )

    def level_share_points(
        self, regime: str | None = None
    ) -> tuple[tuple[tuple[float, float], ...], ...]:
        """Per level (index = level, up to the deepest measured one), its exchange's
        ``(bytes_per_rank, share)`` points of one regime, by size: ``regime`` if given, else
        ``"loaded"`` where the profile has such points, else ``"idle"``; empty for a level with
        none (:class:`LevelShare`)."""
        if not self.level_shares:
            return ()
        if regime is None:
            loaded = any(x.regime == "loaded" for x in self.level_shares)
            regime = "loaded" if loaded else "idle"
        check_one_of("regime", regime, COLLECTIVE_REGIMES)
        depth = 1 + max(x.level for x in self.level_shares)
        return tuple(
            tuple(
                sorted(
                    (x.bytes_per_rank, x.share)
                    for x in self.level_shares
                    if x.level == level and x.regime == regime
                )
            )
            for level in range(depth)
        )

    def link_spec(self, spec: Any) -> tuple[Any, float]:
        """``(spec, bandwidth_scale)`` to simulate ``spec`` (a ``ClusterSpec``) with: each level
        matching a measured one in ``links`` (same name, configured bandwidth and latency) at
        its measured bandwidth, every other level at ``bandwidth_scale`` of its own; unchanged
        (with ``bandwidth_scale``) when none matches."""
        measured = {
            (x.level_name, x.configured_bandwidth_gbps, x.configured_latency_ms): x
            for x in self.links
        }
        keys = [(lv.name, lv.bandwidth_gbps, lv.latency_ms) for lv in spec.levels]
        if not any(k in measured for k in keys):
            return spec, self.bandwidth_scale
        levels = tuple(
            dataclasses.replace(
                lv,
                bandwidth_gbps=measured[k].measured_bandwidth_gbps
                if k in measured
                else lv.bandwidth_gbps * self.bandwidth_scale,
            )
            for lv, k in zip(spec.levels, keys)
        )
        return dataclasses.replace(spec, levels=levels), 1.0

    def for_model(self, act_bytes: int) -> Profile:
        """This profile with the matmul rate of a model whose activations take ``act_bytes``:
        ``half_flops_per_s`` for 2 bytes when measured (on a CPU the router keeps the fp32
        rate; a GPU's computes on bf16 tensor cores), else unchanged."""
        if act_bytes == 2 and self.half_flops_per_s > 0:
            router = self.router_flops_per_s or self.flops_per_s
            if self.device != "cpu":
                router = self.half_flops_per_s
            return dataclasses.replace(
                self, flops_per_s=self.half_flops_per_s, router_flops_per_s=router
            )
        return self

    def slowed(self, factor: float, *, why: str = "") -> Profile:
        """This profile on the same machine running ``factor`` times slower (< 1: faster), as
        a speed reference timed again says (:mod:`moesaic.measure.retime`): every rate of its
        compute divided by ``factor`` and every CPU time (the operations, the task overhead,
        the taskflow runtime's and the communication's CPU) multiplied by it. The network's
        figures (links, collective shares, call floors, sync waits) stay as measured: they
        were timed on the emulated links, and this says nothing about them. ``why`` is added
        to ``source``."""
        check_positive("factor", factor)
        rate = 1.0 / factor
        return dataclasses.replace(
            self,
            flops_per_s=self.flops_per_s * rate,
            half_flops_per_s=self.half_flops_per_s * rate,
            router_flops_per_s=self.router_flops_per_s * rate,
            task_overhead_s=self.task_overhead_s * factor,
            tile_cpu_s=self.tile_cpu_s * factor,
            put_cpu_s=self.put_cpu_s * factor,
            put_cpu_per_byte_s=self.put_cpu_per_byte_s * factor,
            tile_elem_cpu_s=self.tile_elem_cpu_s * factor,
            copy_elem_cpu_s=self.copy_elem_cpu_s * factor,
            comm_cpu_s=self.comm_cpu_s * factor,
            comm_cpu_per_byte_s=self.comm_cpu_per_byte_s * factor,
            ops=None if self.ops is None else self.ops.slowed(factor),
            source=f"{self.source}; compute x{factor:.3g}" + (f" ({why})" if why else ""),
        )

    def stage_s(self, model: ModelSpec, tokens: int) -> float:
        """Forward seconds of a block's attention stage and router gate for ``tokens`` tokens
        at these rates: the gate at the router's rate (``router_flops_per_s``), the rest at
        ``flops_per_s`` (``compute_s``, with the gate's memory-bound bytes: an fp32 copy of
        the tokens on a CPU, none on a GPU)."""
        gate = model.gate_flops(tokens)
        nbytes = model.gate_bytes(tokens, fp32_copy=self.device == "cpu")
        rest = self.compute_s(model.attention_flops(tokens) - gate, nbytes)
        return rest + gate / (self.router_flops_per_s or self.flops_per_s)

    def gemm_efficiency_at(self, rows_per_group: float) -> float:
        """The grouped GEMMs' fraction of the dense rate at ``rows_per_group`` rows per expert:
        ``gemm_efficiency`` interpolated linearly in log(rows), held at its end points (1
        without points)."""
        return log_linear(self.gemm_efficiency, rows_per_group)

    def expert_gemm_s(self, flops: float, rows_per_group: float) -> float:
        """Seconds of the experts' grouped GEMMs of ``flops`` at ``rows_per_group`` rows per
        expert: ``flops_per_s`` times ``gemm_efficiency_at``."""
        return flops / (self.flops_per_s * self.gemm_efficiency_at(rows_per_group))

    def layer_launch_s(self) -> float:
        """A GPU's seconds for one MoE layer's small kernels, forward + backward:
        ``layer_kernels`` x ``launch_s`` (0 on a CPU, whose task overhead prices them)."""
        if self.device == "cpu":
            return 0.0
        return self.layer_kernels * self.launch_s

    def host_floor_s(self) -> float:
        """A GPU's floor on one MoE layer's forward + backward: the host's time to issue it
        (``layer_host_s``; 0 on a CPU, where the host's work is the compute itself)."""
        return 0.0 if self.device == "cpu" else self.layer_host_s

    def compute_s(self, flops: float, nbytes: float = 0.0) -> float:
        """Seconds of one compute task of ``flops`` whose memory-bound passes move ``nbytes``
        (read plus written). On a CPU the work plus the task's overhead (``nbytes`` is in the
        measured rate already). On a GPU the device work alone: FLOPs at the matmul rate,
        bytes at ``mem_bytes_per_s``. The host's launches run ahead of the GPU and overlap
        its work, so they cost nothing here; where they take longer than the kernels (a
        small layer) the layer's ``host_floor_s`` bounds it instead (``pipelined.Costs``)."""
        work = flops / self.flops_per_s
        if self.device == "cpu":
            return work + self.task_overhead_s
        if self.mem_bytes_per_s > 0:
            work += nbytes / self.mem_bytes_per_s
        return work

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["cluster"] = None if self.cluster is None else self.cluster.to_dict()
        data["ops"] = None if self.ops is None else self.ops.to_dict()
        data["routing"] = None if self.routing is None else asdict(self.routing)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ValueError(f"profile: unknown field(s) {unknown}; allowed are {allowed}")
        if "flops_per_s" not in data:
            raise ValueError("profile: missing field 'flops_per_s'")
        data = dict(data)
        links = _records(data.pop("links", []), "links", LinkLevel)
        shares = _records(data.pop("collectives", []), "collectives", CollectiveShare)
        levels = _records(data.pop("level_shares", []), "level_shares", LevelShare)
        waits = _records(data.pop("sync_waits", []), "sync_waits", SyncWait)
        cluster = data.pop("cluster", None)
        if cluster is not None:
            try:
                cluster = ClusterSpec.from_dict(cluster)
            except ValueError as exc:
                raise ValueError(f"profile.cluster: {exc}") from None
        ops = data.pop("ops", None)
        if ops is not None:
            ops = OpCal.from_dict(ops)
        routing = data.pop("routing", None)
        if routing is not None:
            if not isinstance(routing, dict):
                raise ValueError("profile.routing must be an object (loads, source) or null")
            routing = _records([routing], "routing", RoutingLoads)[0]
        points = data.pop("gemm_efficiency", [])
        if not isinstance(points, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in points
        ):
            raise ValueError("profile.gemm_efficiency must be a list of [rows, efficiency] pairs")
        return cls(
            **data,
            links=links,
            collectives=shares,
            level_shares=levels,
            sync_waits=waits,
            cluster=cluster,
            ops=ops,
            routing=routing,
            gemm_efficiency=tuple((float(r), float(e)) for r, e in points),
        )

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"profile file {str(path)!r} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile file {str(path)!r} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"profile file {str(path)!r} must hold a JSON object")
        return cls.from_dict(data)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path


_R = TypeVar("_R")


def _records(items: object, key: str, record: type[_R]) -> tuple[_R, ...]:
    """``profile.<key>``: a list of objects, each the fields of ``record``."""
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise ValueError(f"profile.{key} must be a list of objects")
    try:
        return tuple(record(**x) for x in items)
    except TypeError as exc:
        allowed = [f.name for f in fields(record)]  # type: ignore[arg-type]
        raise ValueError(f"profile.{key}: {exc}; fields are {allowed}") from None


def describe_cluster(spec: ClusterSpec) -> str:
    """One line: ``'hybridep_2dc' (2 ranks: datacenter 2 x 0.1 Gbit/s 2 ms)``."""
    levels = ", ".join(
        f"{lv.name} {lv.size} x {lv.bandwidth_gbps:g} Gbit/s {lv.latency_ms:g} ms"
        for lv in spec.levels
    )
    return f"{spec.name!r} ({spec.world_size} ranks: {levels})"


def cluster_differences(measured: ClusterSpec, spec: ClusterSpec) -> list[str]:
    """What differs from ``measured`` to ``spec``: world size, level names, and per level of
    the same name its size, bandwidth and latency (``"world size 2 vs 4"``)."""
    out = []
    if measured.world_size != spec.world_size:
        out.append(f"world size {measured.world_size} vs {spec.world_size}")
    names = [lv.name for lv in measured.levels], [lv.name for lv in spec.levels]
    if names[0] != names[1]:
        out.append(f"levels {names[0]} vs {names[1]}")
    theirs = {lv.name: lv for lv in spec.levels}
    for lv in measured.levels:
        other = theirs.get(lv.name)
        if other is None:
            continue
        for attr, unit in (("size", ""), ("bandwidth_gbps", " Gbit/s"), ("latency_ms", " ms")):
            a, b = getattr(lv, attr), getattr(other, attr)
            if a != b:
                out.append(f"{lv.name}.{attr} {a:g}{unit} vs {b:g}{unit}")
    return out


def links_from_cluster_check(path: str | Path) -> tuple[float, float]:
    """``(floor_s, bandwidth_scale)`` from a ``benchmarks/cluster_check.py`` result: the
    unshaped loopback latency (min RTT/2) and 1 + the median bandwidth error of every level.

    Its errors say what is wrong with the file, not which option named it: the command line
    adds ``--links PATH:`` once (``cli_files.load_option``)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(
            "not a cluster_check result (a JSON object with 'unshaped' and "
            f"'clusters'; got a {type(data).__name__})"
        )
    try:
        floor_s = float(data["unshaped"]["latency_min_ms"]) * 1e-3
        errors = [
            float(level["bandwidth_error_median"])
            for cluster in data["clusters"]
            for level in cluster["summary"]
        ]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a cluster_check result (missing {exc})") from None
    return floor_s, 1.0 + (statistics.median(errors) if errors else 0.0)
