"""Parsers and rules of the pipelined-schedule options (``--pipeline-degree``, ``--ar-chunk``).

Torch-free; ``moesaic.train.config`` validates ``TrainConfig`` with them.
"""

from __future__ import annotations

import re

from moesaic.schedule_table import schedule_spec

_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_BYTE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30}


# R of a pipelined schedule when not given: 2 measured best on the emulated 2-rank cluster
# (benchmarks/results/flowmoe_cluster.json: flowmoe 1.49x vanilla at R = 2, 1.45x at R = 4; more
# chunks mean smaller matmuls and more collectives, each paying the path latency).
AUTO_PIPELINE_DEGREE = 2

# The smallest --ar-chunk: below ~4 KiB a gloo all-reduce costs its latency whatever its size
# (the tuner's floor too, schedule/flowmoe.py TUNE_MIN_BYTES); --ar-chunk 1B ran 300x slower
# (18 vs 5,900 tokens/s) with 81,792 all-reduce spans.
MIN_AR_CHUNK_BYTES = 4096


def auto_pipeline_degree(schedule: str, batch_size: int) -> int:
    """The documented rule for ``pipeline_degree = "auto"``: ``AUTO_PIPELINE_DEGREE`` for a
    pipelined schedule when it divides ``batch_size``, else 1."""
    if not schedule_spec(schedule).pipelined or batch_size % AUTO_PIPELINE_DEGREE:
        return 1
    return AUTO_PIPELINE_DEGREE


def parse_pipeline_degree(value: object) -> int | str:
    """``--pipeline-degree``: "auto" or an int (validated with the config)."""
    if value == "auto":
        return "auto"
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"pipeline_degree ({value!r}) must be 'auto' or an int >= 1") from None
    return value  # type: ignore[return-value]  # ints (and bad types) are checked later


def parse_ar_chunk(value: object) -> str | int:
    """``"auto"``, or a positive number of bytes from an int or a string ("4194304", "4MiB",
    "4MB", "512 KiB"; units B, KB/MB/GB = powers of 1000, KiB/MiB/GiB = powers of 1024), at
    least ``MIN_AR_CHUNK_BYTES``."""
    rule = (
        "must be 'auto' or a positive number of bytes (an int, or a string such as '4MiB' or "
        "'4MB'): --ar-chunk is Sp, the size of the gradient all-reduce chunks"
    )
    if value == "auto":
        return "auto"
    n: float | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value if value > 0 else None
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _BYTE_UNITS:
            n = float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
            n = n if n >= 1 and n == int(n) else None
    if n is None:
        raise ValueError(f"ar_chunk ({value!r}) {rule}")
    if n < MIN_AR_CHUNK_BYTES:
        raise ValueError(
            f"ar_chunk ({value!r}) must be at least {MIN_AR_CHUNK_BYTES} bytes (4 KiB): each "
            "chunk is one all-reduce paying the link latency, so smaller chunks only add "
            "collectives (1 B ran 300x slower: 81,792 all-reduces a step)"
        )
    return int(n)
