"""Models built on moesaic's layers: the MoE GPT that ``moesaic train`` trains, a transformers
causal LM made expert-parallel (``hf_causal_lm.py``), the block-model protocol both implement
(``block_model.py``) and the MoEGPT's export as a Mixtral (``moegpt_mixtral.py``).

``MoEGPTConfig`` (torch-free, ``models/config.py``) and ``MoEGPT`` (``models/gpt.py``) are
imported lazily (PEP 562), so that reading a config does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"MoEGPT": "moesaic.models.gpt", "MoEGPTConfig": "moesaic.models.config"}

__all__ = ["MoEGPT", "MoEGPTConfig"]

if TYPE_CHECKING:
    from moesaic.models.config import MoEGPTConfig
    from moesaic.models.gpt import MoEGPT


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moesaic.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
