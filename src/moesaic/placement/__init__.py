"""Where experts live: expert placement, HybridEP's domain topology and expert compression.

Nothing here imports above it: the router and the layer use :class:`ExpertPlacement`, HybridEP's
strategy the topology and the compression. HybridEP's cost model and step model, which price
choices of these, are :mod:`moesaic.planning`.
"""

from moesaic.placement.base import ExpertPlacement
from moesaic.placement.compress import CompressedExpert, compressed_nbytes, sr_decode, sr_encode
from moesaic.placement.topology import Topology

__all__ = [
    "CompressedExpert",
    "ExpertPlacement",
    "Topology",
    "compressed_nbytes",
    "sr_decode",
    "sr_encode",
]
