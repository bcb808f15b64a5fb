"""``moesaic generate``: sample bytes from a trained checkpoint in one process."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from moesaic.train.checkpoint import latest_checkpoint, load_model_for_inference


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


def generate_text(
    checkpoint: str,
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
) -> str:
    """The prompt followed by ``max_new_tokens`` sampled bytes, decoded as UTF-8 (lossy)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k ({top_k}) must be >= 1")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature ({temperature}) must be a finite number >= 0 (0 = greedy)")
    # A command line with bytes that are not UTF-8 reaches Python as lone surrogates: send
    # those bytes back as they were (the model is byte-level).
    data = prompt.encode("utf-8", errors="surrogateescape") or b"\n"
    model, _ = load_model_for_inference(resolve_checkpoint(checkpoint))
    idx_1T = torch.tensor([list(data)], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    out_1T = model.generate(idx_1T, max_new_tokens, temperature, top_k, generator=gen)
    return bytes(out_1T[0].tolist()).decode("utf-8", errors="replace")
