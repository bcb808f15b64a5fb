"""moesaic: fast distributed Mixture-of-Experts training with expert parallelism."""

from moesaic.comm.collectives import CollectiveError
from moesaic.config import MoEConfig
from moesaic.layer import MoELayer, aux_loss, is_expert_param
from moesaic.routing import Router, RoutingPlan

__all__ = [
    "CollectiveError",
    "MoEConfig",
    "MoELayer",
    "Router",
    "RoutingPlan",
    "aux_loss",
    "is_expert_param",
]
__version__ = "0.1.0"
