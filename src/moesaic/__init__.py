"""moesaic: fast distributed Mixture-of-Experts training with expert parallelism.

The public names are imported lazily (PEP 562), so that torch-free parts such as
``moesaic.cluster.spec`` and ``moesaic cluster down`` start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CollectiveError": "moesaic.comm.collectives",
    "MoEConfig": "moesaic.config",
    "MoELayer": "moesaic.layer",
    "Router": "moesaic.routing",
    "RoutingPlan": "moesaic.routing",
    "aux_loss": "moesaic.layer",
    "is_expert_param": "moesaic.layer",
}

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

if TYPE_CHECKING:
    from moesaic.comm.collectives import CollectiveError
    from moesaic.config import MoEConfig
    from moesaic.layer import MoELayer, aux_loss, is_expert_param
    from moesaic.routing import Router, RoutingPlan


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moesaic' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
