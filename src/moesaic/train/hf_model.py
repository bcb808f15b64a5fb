"""``moesaic train --hf-config``: the run's model, a transformers causal LM
(``moesaic.models.hf_causal_lm.HFCausalLM``) or an MoEGPT.

The transformers model is built from the config file alone. Byte data (token ids 0-255) need
the config's ``vocab_size`` to be at least 256 (``TrainConfig`` checks it; a larger vocabulary
leaves the rows above 255 unused); token shards replace it by the tokenizer's
(``run_hf_config``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch.distributed as dist

from moesaic.interop.hf_families import read_hf_config
from moesaic.models.gpt import MoEGPT
from moesaic.models.hf_causal_lm import HFCausalLM

if TYPE_CHECKING:
    from moesaic.cluster.spec import ClusterSpec
    from moesaic.train.config import TrainConfig


def build_model(
    cfg: TrainConfig,
    ep_group: dist.ProcessGroup | None = None,
    topology: ClusterSpec | None = None,
) -> MoEGPT:
    """The run's model: the transformers one of ``cfg.hf_config``, else an MoEGPT.

    Typed as an MoEGPT: an ``HFCausalLM`` has what the vanilla step and the loop use of one
    (``forward``, ``moe_layers``, ``config``, ``generate``); ``TrainConfig`` refuses the
    pipelined schedules, which need its stages.
    """
    if cfg.hf_config is None:
        return MoEGPT(cfg.model, ep_group=ep_group, topology=topology)
    model = HFCausalLM(run_hf_config(cfg), cfg.model, ep_group, topology)
    return cast(MoEGPT, model)


def run_hf_config(cfg: TrainConfig) -> dict[str, Any]:
    """The transformers config a ``--hf-config`` run builds: the file's, with the run's
    vocabulary (the tokenizer's when the data are token shards)."""
    assert cfg.hf_config is not None  # callers check
    return {**read_hf_config(cfg.hf_config), "vocab_size": cfg.model.vocab_size}
