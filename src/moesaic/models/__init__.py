"""Models built on moesaic's layers: the MoE GPT that ``moesaic train`` trains."""

from moesaic.models.gpt import MoEGPT, MoEGPTConfig

__all__ = ["MoEGPT", "MoEGPTConfig"]
