"""Real data: ``moesaic prepare`` turns text into memory-mappable token shards.

* :mod:`~moesaic.data.sources`: the inputs (text files and directories, JSONL with a named text
  field, parquet, a ``datasets`` dataset saved on disk) as documents, each bad one named;
* :mod:`~moesaic.data.tokenizer`: a given ``tokenizer.json`` or a byte-level BPE trained on the
  corpus (HF ``tokenizers``), its sha256 and end-of-document id;
* :mod:`~moesaic.data.shards`: the on-disk format (flat token files, document index, metadata
  written last) and its checks;
* :mod:`~moesaic.data.prepare`: the parallel, idempotent, atomic pipeline;
* :mod:`~moesaic.data.cli`: the ``moesaic prepare`` subcommand.

Torch-free: preparing data never imports torch. Training reads the shards in
:mod:`moesaic.train.tokens`.
"""
