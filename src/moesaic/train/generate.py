"""``moesaic generate``: sample bytes (or the run's tokens) from a trained checkpoint in one
process."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

from moesaic.train.checkpoint import load_model_for_inference
from moesaic.train.ckpt_choice import latest_checkpoint
from moesaic.train.codec import Codec, codec_of

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11; torch requires the package


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint directory, or a run directory (its latest checkpoint)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if (p / "meta.json").is_file():
        return p
    run_dir = p.parent if p.name == "checkpoints" else p
    found = latest_checkpoint(str(run_dir))
    if found is not None:
        return found
    raise ValueError(f"checkpoint {path} is neither a checkpoint nor a run directory with one")


class Sampling(TypedDict, total=False):
    """The sampling options of :func:`generate_ids` (its keyword arguments and defaults)."""

    max_new_tokens: int
    temperature: float
    top_k: int | None
    seed: int


def generate_text(checkpoint: str, prompt: str, **sampling: Unpack[Sampling]) -> str:
    """The prompt followed by sampled bytes (:func:`generate_ids`'s options), decoded as UTF-8
    (lossy), or tokens of the run's tokenizer (up to the first EOS)."""
    ids, codec = generate_ids(checkpoint, prompt, **sampling)
    return codec.decode(ids)


def generate_ids(
    checkpoint: str,
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
) -> tuple[list[int], Codec]:
    """The prompt's ids followed by ``max_new_tokens`` sampled ones (``temperature`` 0: greedy;
    ``top_k`` None: all; ``seed`` for the sampler), and the codec that decodes them."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k ({top_k}) must be >= 1")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature ({temperature}) must be a finite number >= 0 (0 = greedy)")
    path = resolve_checkpoint(checkpoint)
    model, meta = load_model_for_inference(path)
    codec = codec_of(meta, str(path))  # bytes, or the tokenizer the run trained with
    model.sample_vocab = codec.vocab_size  # the ids the codec decodes (bytes: 256)
    idx_1T = torch.tensor([codec.prompt_ids(prompt)], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    out_1T = model.generate(idx_1T, max_new_tokens, temperature, top_k, generator=gen)
    prompt_len = idx_1T.shape[1]
    ids = out_1T[0].tolist()
    # a token run's document ends at EOS (what transformers' generate stops at too)
    return ids[:prompt_len] + codec.until_eos(ids[prompt_len:]), codec
