"""``moesaic export --hf OUT``: a checkpoint as a plain transformers model directory.

OUT gets ``config.json`` and ``generation_config.json``, the weights as ``model.safetensors``
(transformers' ``save_pretrained``, every expert gathered back into the family's layout by
``moesaic.interop.hf.to_hf_state_dict``) and the tokenizer (``tokenizer.json`` and
``tokenizer_config.json`` of a ``PreTrainedTokenizerFast``): the run's tokenizer, or for a byte
run a byte-level one whose id b is byte b. ``AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)`` then generate (greedy) the tokens ``moesaic generate
--temperature 0`` does (``tests/train/test_export.py``).

Exportable: checkpoints of ``moesaic train --hf-config`` (every family of
``moesaic.interop.hf_families``), and an MoEGPT with its default block as a Mixtral
(``moesaic.models.moegpt_mixtral``, checked exact at export). Refused, with the reason: an
MoEGPT with options Mixtral lacks (named), and a byte run whose vocabulary is larger than 256
(moesaic samples only the 256 byte ids, transformers would sample all).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from moesaic.data.tokenizer import byte_tokenizer_text
from moesaic.train.checkpoint import load_model_for_inference
from moesaic.train.codec import codec_of
from moesaic.train.generate import resolve_checkpoint


def export_hf(checkpoint: str, out: str) -> Path:
    """Write checkpoint (or run directory) ``checkpoint`` as a transformers directory ``out``.

    Written into a temporary directory beside ``out`` and renamed: an interrupted export
    leaves no ``out``.

    Raises:
        ValueError: the checkpoint cannot be exported (see the module doc), or ``out`` exists
            and is not empty.
    """
    dest = Path(out)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"--hf {out} exists and is not an empty directory; choose a new one")
    path = resolve_checkpoint(checkpoint)
    model, meta = load_model_for_inference(path)
    codec = codec_of(meta, str(path))
    vocab = model.config.vocab_size
    if codec.tokenizer is None and vocab != 256:
        raise ValueError(
            f"checkpoint {path} trained on bytes with vocab_size {vocab}: moesaic samples only "
            "the ids 0-255, transformers would sample all of them; export needs vocab_size 256 "
            "for a byte run"
        )
    plain = _plain_transformers_model(model, meta, path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        _write(plain, meta.get("tokenizer_json") or byte_tokenizer_text(), codec.eos_id, tmp)
        if dest.exists():
            dest.rmdir()  # empty (checked above)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _plain_transformers_model(model, meta: dict, path: Path):
    """The transformers model of the checkpoint: a ``--hf-config`` run's own family with every
    expert gathered back, or an MoEGPT converted to Mixtral (checked exact)."""
    from transformers import AutoModelForCausalLM

    if "hf_config" not in meta:
        from moesaic.models.moegpt_mixtral import moegpt_to_mixtral

        try:
            return moegpt_to_mixtral(model)
        except ValueError as exc:
            raise ValueError(f"checkpoint {path}: {exc}") from None
    from moesaic.interop.hf import to_hf_state_dict

    plain = AutoModelForCausalLM.from_config(model.hf.config)
    plain.load_state_dict(to_hf_state_dict(model.hf))
    return plain


def _write(plain, tokenizer_json: str, eos_id: int | None, out: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    # The config file's own special ids (a family's defaults, e.g. Qwen's 151643) mean nothing
    # for this vocabulary: the run's EOS ends a document, there is no BOS.
    cfg = plain.config
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = None, eos_id, eos_id
    plain.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id
    )
    plain.save_pretrained(out)
    tok = Tokenizer.from_str(tokenizer_json)
    eos_token = None if eos_id is None else tok.id_to_token(eos_id)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token=eos_token)
    fast.save_pretrained(out)
