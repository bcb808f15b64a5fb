"""``moesaic prepare``: shards that decode to the documents, idempotent reruns, atomic failures,
one line per bad input (issue 51)."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from tokenizers import Tokenizer, models, pre_tokenizers

from moesaic.cli import main
from moesaic.data import prepare as prep
from moesaic.data.prepare import PrepareConfig, PrepareError, prepare
from moesaic.data.shards import META_NAME, dtype_for, read_prepared
from moesaic.data.sources import BadInput
from moesaic.train.data_source import open_training_data

DOCS = [
    "def f(x):\n    return x + 1\n",
    "class A:\n    pass\n",
    "héllo wörld ✓ 🙂\n",  # multi-byte UTF-8 survives the byte-level BPE
    "import os\nprint(os.getcwd())\n",
]


def _corpus(root: Path, docs=DOCS) -> Path:
    src = root / "src"
    src.mkdir()
    for i, text in enumerate(docs):
        (src / f"doc{i}.py").write_text(text * 20)
    return src


def _cfg(src, out, **kw) -> PrepareConfig:
    base = dict(inputs=[str(src)], out=str(out), vocab_size=300, shard_bytes=700, workers=1)
    base["progress"] = False
    return PrepareConfig(**{**base, **kw})


def _decoded_documents(out: Path) -> list[str]:
    corpus = read_prepared(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = corpus.tokenizer.eos_id
    docs = []
    for shard in corpus.shards:
        ids = np.fromfile(corpus.bin_path(shard), dtype=corpus.dtype)
        idx = np.load(corpus.idx_path(shard))
        start = 0
        for end, nbytes in idx:
            assert ids[end - 1] == eos  # every document ends with EOS
            text = tok.decode(ids[start : end - 1].tolist())
            assert len(text.encode()) == nbytes
            docs.append(text)
            start = end
    return docs


def test_shards_decode_to_the_documents_in_order(tmp_path):
    src = _corpus(tmp_path)
    meta = prepare(_cfg(src, tmp_path / "out"))
    assert _decoded_documents(tmp_path / "out") == [d * 20 for d in DOCS]
    assert meta["dtype"] == "uint16" and meta["documents"] == 4 and len(meta["shards"]) >= 2
    assert meta["tokenizer"]["vocab_size"] == 300 and meta["tokenizer"]["eos_token"]
    assert meta["bytes"] == sum(len((d * 20).encode()) for d in DOCS)


def test_workers_give_the_same_shards(tmp_path):
    # two spawned worker processes against one in-process run: the same bytes
    src = _corpus(tmp_path)
    tok = tmp_path / "one" / "tokenizer.json"
    prepare(_cfg(src, tmp_path / "one"))
    prepare(_cfg(src, tmp_path / "two", tokenizer=str(tok), vocab_size=None, workers=2))
    for f in sorted((tmp_path / "one").glob("shard_*.bin")):
        assert f.read_bytes() == (tmp_path / "two" / f.name).read_bytes()


def test_rerun_skips_finished_shards_and_rebuilds_changed_ones(tmp_path):
    src = _corpus(tmp_path)
    out = tmp_path / "out"
    first = prepare(_cfg(src, out))
    tok = str(out / "tokenizer.json")
    again = prepare(_cfg(src, out, tokenizer=tok, vocab_size=None))
    assert again["reused_shards"] == len(first["shards"])
    # the last shard's input, still too large to share a shard (the plan groups by size)
    (src / "doc3.py").write_text("print('changed')\n" * 30)
    third = prepare(_cfg(src, out, tokenizer=tok, vocab_size=None))
    assert third["reused_shards"] == len(first["shards"]) - 1
    assert _decoded_documents(out)[-1] == "print('changed')\n" * 30


def test_vocab_over_65536_is_stored_as_uint32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)} | {"<|endoftext|>": 70_000}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 w5")
    big = str(tmp_path / "big.json")
    meta = prepare(_cfg(tmp_path / "a.txt", tmp_path / "out", tokenizer=big, vocab_size=None))
    assert meta["dtype"] == "uint32" == dtype_for(70_001)
    ids = np.fromfile(tmp_path / "out" / "shard_00000.bin", dtype=np.uint32)
    assert ids.tolist() == [1, 69_999, 5, 70_000]
    assert dtype_for(65_536) == "uint16"  # ids 0..65535 fit


def test_disk_full_leaves_nothing_that_reads_as_valid(tmp_path, monkeypatch):
    src = _corpus(tmp_path)
    out = tmp_path / "out"
    prepare(_cfg(src, out))  # a complete earlier run: its metadata must go too
    (src / "doc2.py").write_text("changed, so its shard is written again\n")
    real = prep._write_batch

    def full(fh, *args):
        fh.write(b"\0" * 10)  # part of the shard reached the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prep, "_write_batch", full)
    tok = str(out / "tokenizer.json")
    with pytest.raises(PrepareError, match=r"writing shard shard_0000\d in .* No space left"):
        prepare(_cfg(src, out, tokenizer=tok, vocab_size=None))
    assert not (out / META_NAME).exists()
    assert not list(out.glob("*.tmp"))
    with pytest.raises(ValueError, match="cannot be read"):
        read_prepared(out)
    with pytest.raises(ValueError, match=r"holds token shards but no moesaic-data\.json"):
        open_training_data(str(out), 1000, 0.1, 8)  # never read as text either
    monkeypatch.setattr(prep, "_write_batch", real)
    assert prepare(_cfg(src, out, tokenizer=tok, vocab_size=None))["documents"] == 4


@pytest.mark.parametrize(
    ("name", "content", "rule"),
    [
        ("empty.txt", b"", r"empty.txt: empty file"),  # an empty file
        ("latin1.txt", "caf\xe9".encode("latin-1"), r"latin1.txt: not UTF-8 \(byte 0xe9"),
        ("docs.jsonl", b'{"text": "a"}\n{"body": "b"}\n', r"docs.jsonl:2: no field 'text'"),
        ("docs.jsonl", b'{"text": "a"}\n{"text": 3}\n', r"docs.jsonl:2: field 'text' is int"),
    ],
)
def test_bad_input_is_one_line_naming_file_and_rule(tmp_path, name, content, rule):
    src = _corpus(tmp_path)
    (src / name).write_bytes(content)
    with pytest.raises(BadInput, match=rule) as info:
        prepare(_cfg(src, tmp_path / "out"))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out" / META_NAME).exists()


def test_skip_bad_counts_by_reason(tmp_path):
    src = _corpus(tmp_path)
    (src / "empty.txt").write_bytes(b"")
    (src / "x.jsonl").write_bytes(b'{"text": "kept"}\n{"other": 1}\n{"other": 2}\n')
    meta = prepare(_cfg(src, tmp_path / "out", skip_bad=True))
    assert meta["skipped"]["empty file"]["count"] == 1
    assert meta["skipped"]["no field 'text'"]["count"] == 2
    assert "x.jsonl:2" in meta["skipped"]["no field 'text'"]["first"]
    assert "kept" in _decoded_documents(tmp_path / "out")


def test_truncated_shard_and_changed_tokenizer_are_refused(tmp_path):
    src = _corpus(tmp_path)
    out = tmp_path / "out"
    prepare(_cfg(src, out))
    shard = out / "shard_00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"shard_00000.bin is truncated: \d+ bytes, the meta"):
        read_prepared(out)
    prepare(_cfg(src, out))  # the rerun rebuilds it
    tok = out / "tokenizer.json"
    tok.write_text(tok.read_text().replace("<|endoftext|>", "<|end|>"))
    with pytest.raises(ValueError, match=r"tokenizer.json has sha256 .* the metadata"):
        read_prepared(out)


def test_cli_errors_are_one_line(tmp_path, capsys):
    src = _corpus(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    args = ["prepare", str(src), "--out", str(tmp_path / "o"), "--no-progress", "--workers", "1"]
    assert main([*args, "--tokenizer", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moesaic prepare: error: tokenizer ") and "bad.json" in err
    assert "\n" not in err
    assert main([*args, "--vocab-size", "300", "--format", "parquet"]) == 2
    err = capsys.readouterr().err.strip()
    # without pyarrow: the package is named; with it: the first file is not parquet
    assert "\n" not in err and ("pyarrow" in err or "doc0.py: not a parquet file" in err)
    assert main([*args, "--vocab-size", "300"]) == 0
    assert "4 documents" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / META_NAME).read_text())["documents"] == 4


def test_parquet_and_saved_dataset_read_the_named_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    rows = {"body": DOCS, "n": list(range(len(DOCS)))}
    pq.write_table(pa.table(rows), tmp_path / "docs.parquet")
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    for name in ("docs.parquet", "saved"):
        out = tmp_path / f"out_{name}"
        prepare(_cfg(tmp_path / name, out, field="body"))
        assert _decoded_documents(out) == DOCS
        with pytest.raises(BadInput, match=rf"{name}: no column 'text' \(the text column"):
            prepare(_cfg(tmp_path / name, tmp_path / "x"))


def test_saved_dataset_dict_needs_a_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("pyarrow")
    train = datasets.Dataset.from_dict({"text": DOCS})
    datasets.DatasetDict({"train": train, "test": train}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"holds the splits train, test: choose one with --split"):
        prepare(_cfg(tmp_path / "dd", tmp_path / "out"))
    prepare(_cfg(tmp_path / "dd", tmp_path / "out", split="test"))
    assert _decoded_documents(tmp_path / "out") == DOCS
