"""Where experts live: expert placement, and HybridEP's domains, cost model and compression."""

from moesaic.placement.base import ExpertPlacement
from moesaic.placement.compress import CompressedExpert, compressed_nbytes, sr_decode, sr_encode
from moesaic.placement.costmodel import (
    DomainPlan,
    StreamInputs,
    optimal_p,
    plan_domains,
    search_p,
    stream_inputs,
)
from moesaic.placement.topology import Topology

__all__ = [
    "CompressedExpert",
    "DomainPlan",
    "ExpertPlacement",
    "StreamInputs",
    "Topology",
    "compressed_nbytes",
    "optimal_p",
    "plan_domains",
    "search_p",
    "sr_decode",
    "sr_encode",
    "stream_inputs",
]
