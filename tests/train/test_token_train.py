"""Training on ``moesaic prepare``'s token shards (issue 51): the tokenizer's vocabulary, bits per
byte, exact resume, the tokenizer in the checkpoint, refusals naming both hashes, shards changed
under a running job."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")

from _train_helpers import final_weights, read_metrics, start_from, tiny_args, train_losses

from moesaic.cli import main
from moesaic.data.prepare import PrepareConfig, prepare
from moesaic.data.shards import read_prepared
from moesaic.train.config import TrainConfig
from moesaic.train.generate import generate_text
from moesaic.train.tokens import TokenStream, load_token_splits

VOCAB = 320


def _prepare(data_file: Path, out: Path, **kw) -> Path:
    # the 48 KB corpus as 12 documents of 4 KB: validation holds out whole ones
    src = out.parent / f"{out.name}_src"
    src.mkdir()
    text = data_file.read_text()
    for i in range(12):
        (src / f"part{i:02d}.py").write_text(text[i * 4000 : (i + 1) * 4000])
    cfg = dict(inputs=[str(src)], out=str(out), vocab_size=VOCAB, shard_bytes=16_000, workers=1)
    prepare(PrepareConfig(**{**cfg, "progress": False, **kw}))
    return out


@pytest.fixture(scope="module")
def tokens(data_file, tmp_path_factory) -> Path:
    return _prepare(data_file, tmp_path_factory.mktemp("tok") / "data")


@pytest.fixture(scope="module")
def token_run(tokens, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("token_run")
    assert main(tiny_args(tokens, run_dir)) == 0
    return run_dir


def test_token_run_learns_and_records_its_tokenizer(token_run, tokens):
    records = read_metrics(token_run)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.05 and val[-1]["val_loss"] < val[0]["val_loss"]
    corpus = read_prepared(tokens)
    _, val_split = load_token_splits(corpus, 0.05, 32)
    for r in val:  # bits per byte: nats per token / ln 2 / UTF-8 bytes per token
        want = r["val_loss"] / torch.log(torch.tensor(2.0)).item() / val_split.bytes_per_token
        assert r["val_bits_per_byte"] == pytest.approx(want, rel=1e-6)
    assert 1.5 < val_split.bytes_per_token < 4  # a BPE of 320 tokens on Python source
    meta = json.loads((token_run / "checkpoints" / "step_00000008" / "meta.json").read_text())
    assert meta["model"]["vocab_size"] == VOCAB  # the tokenizer's, not the bytes' 256
    assert meta["data"]["tokenizer"]["sha256"] == corpus.tokenizer.sha256
    assert meta["tokenizer_json"] == (tokens / "tokenizer.json").read_text()


def test_resume_with_token_shards_is_bitwise(token_run, tokens, tmp_path):
    run_dir = start_from(token_run, 4, tmp_path / "resumed")
    assert main(tiny_args(tokens, run_dir, "--resume")) == 0
    ref = train_losses(token_run)
    assert train_losses(run_dir) == {s: ref[s] for s in range(5, 9)}
    ref_w, w = final_weights(token_run), final_weights(run_dir)
    assert all(torch.equal(ref_w[k], w[k]) for k in ref_w)


def test_resume_on_another_tokenizer_names_both_hashes(token_run, data_file, tmp_path, capsys):
    # the same vocabulary size, other merges: only the hash tells them apart
    other = _prepare(data_file, tmp_path / "other", train_bytes=6_000)
    run_dir = start_from(token_run, 4, tmp_path / "resumed")
    assert main(tiny_args(other, run_dir, "--resume")) != 0
    err = capsys.readouterr().err
    mine = read_prepared(other).tokenizer.sha256
    saved = json.loads((run_dir / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert mine in err and saved["data"]["tokenizer"]["sha256"] in err and mine != saved


def test_resume_on_a_tokenizer_of_another_size_names_both_hashes(
    token_run, data_file, tmp_path, capsys
):
    # another vocabulary size implies another model shape: the tokenizer is still the cause named
    other = _prepare(data_file, tmp_path / "other", vocab_size=VOCAB + 32)
    run_dir = start_from(token_run, 4, tmp_path / "resumed")
    assert main(tiny_args(other, run_dir, "--resume")) != 0
    err = capsys.readouterr().err
    mine = read_prepared(other).tokenizer.sha256
    saved = json.loads((run_dir / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert mine in err and saved["data"]["tokenizer"]["sha256"] in err
    assert "vocab_size" not in err


def test_generate_encodes_and_decodes_with_the_runs_tokenizer(token_run):
    text = generate_text(str(token_run), "def ", max_new_tokens=12, temperature=0)
    assert text.startswith("def ") and len(text) > len("def ") + 6  # tokens of > 1 byte


def test_tokenizer_larger_than_the_model_is_refused(tokens):
    with pytest.raises(ValueError, match=rf"has {VOCAB} tokens, more than the model's vocab_size"):
        TrainConfig.from_dict({"data": str(tokens), "model": {"vocab_size": 300}})
    cfg = TrainConfig.from_dict({"data": str(tokens), "hf_config": _qwen3()})
    assert cfg.model.vocab_size == VOCAB  # a transformers config takes the tokenizer's


def _qwen3() -> str:
    return str(Path(__file__).resolve().parents[2] / "examples" / "hf" / "qwen3_moe.json")


def test_shard_changed_under_a_running_job_is_refused(tokens, tmp_path):
    corpus = read_prepared(tokens)
    stream = TokenStream(corpus)
    stream.read(0, 10)
    shard = corpus.bin_path(corpus.shards[0])
    st = shard.stat()
    try:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place
        with pytest.raises(ValueError, match=r"shard .*shard_00000.bin changed while training"):
            stream.read(0, 10)
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def _rss_file_kb() -> int:
    lines = Path("/proc/self/status").read_text().splitlines()
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    return int(status["RssFile"].split()[0])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_reading_windows_keeps_no_shard_pages_resident(tmp_path):
    import numpy as np

    from moesaic.data.shards import PreparedCorpus, ShardInfo
    from moesaic.data.tokenizer import TokenizerInfo
    from moesaic.train.tokens import permuted_index

    n = 8 << 20  # 16 MiB of uint16: 512 windows of 1 page each would map 2-32 MiB unreleased
    np.arange(n, dtype=np.uint16).tofile(tmp_path / "shard_00000.bin")
    corpus = PreparedCorpus(
        tmp_path,
        TokenizerInfo(sha256="0" * 64, vocab_size=65536, eos_id=0, eos_token="e"),
        "uint16",
        (ShardInfo("shard_00000", n, 1, n, "0" * 64),),
    )
    stream = TokenStream(corpus)
    before = _rss_file_kb()
    for i in range(512):
        start = permuted_index(i, n // 129, 3) * 129
        assert stream.read(start, 129).tolist() == [(start + j) % 65536 for j in range(129)]
    assert _rss_file_kb() - before < 1024  # kB: the pages went back after each read
