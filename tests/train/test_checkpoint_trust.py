"""What loading a checkpoint trusts, and how saves and resumes stay out of the watchdog's way.

Issue 57: a ``.metadata`` pickle ran code when loaded (item 1); ``latest`` could point outside
``checkpoints/`` (item 2); a damaged newest checkpoint stopped a resume although an older one
was intact (item 3). Issue 49: rank 0 hashed every file while the others waited in a barrier
(item 4); saves were synchronous; the finite check read one value per entry; the CUDA RNG
state was not saved (item 9).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from _train_helpers import start_from, tiny_args

from moesaic.cli import main
from moesaic.comm.world import run_world
from moesaic.config import MoEConfig
from moesaic.models.gpt import MoEGPT, MoEGPTConfig
from moesaic.testing import HostSyncCounter
from moesaic.train import checkpoint as ckpt
from moesaic.train import ckpt_choice, ckpt_manifest
from moesaic.train.checkpoint import (
    MANIFEST,
    Checkpointer,
    init_optimizer_state,
    load_checkpoint,
    load_model_for_inference,
    save_checkpoint,
)
from moesaic.train.ckpt_choice import (
    choose_resume_checkpoint,
    latest_checkpoint,
    read_checkpoint_meta,
)
from moesaic.train.errors import CheckpointDamaged, CheckpointError
from moesaic.train.parallel import build_layout

CFG = MoEGPTConfig(
    vocab_size=64,
    seq_len=8,
    d_model=16,
    n_layers=1,
    n_heads=2,
    moe=MoEConfig(hidden_size=16, ffn_hidden_size=16, num_experts=4, top_k=2),
)
META = {"model": CFG.to_dict(), "world_size": 1, "ep_size": 1}


def _model(seed: int = 0) -> tuple[MoEGPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = MoEGPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters())
    init_optimizer_state(optimizer)
    return model, optimizer


def _save(run_dir: Path, step: int, model=None, optimizer=None) -> Path:
    if model is None:
        model, optimizer = _model(step)
    return save_checkpoint(
        str(run_dir),
        model=model,
        optimizer=optimizer,
        step=step,
        consumed=step,
        meta=META,
        layout=build_layout(1, 60.0),
        keep=5,
    )


def _rehash(path: Path) -> None:
    """Rewrite manifest.json to match the files: what whoever writes a checkpoint can do."""
    files = json.loads((path / MANIFEST).read_text())["files"]
    for name in files:
        data = (path / name).read_bytes()
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / MANIFEST).write_text(json.dumps({"algorithm": "sha256", "files": files}))


class _RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ---- issue 57 item 1: a checkpoint never runs code --------------------------------------------


def test_hostile_metadata_pickle_is_refused_and_never_runs(tmp_path, capfd):
    path = _save(tmp_path / "run", 1)
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(_RunsACommand(marker)))
    _rehash(path)  # the manifest is no defence: it was written by the same hand
    expected = (
        f"checkpoint {path} is refused: its .metadata names posix.system, which is not a "
        "checkpoint metadata type (loading a checkpoint never runs code from it)"
    )
    with pytest.raises(CheckpointError) as info:
        read_checkpoint_meta(path)
    assert str(info.value) == expected
    model, _ = _model()
    with pytest.raises(CheckpointError, match=r"is refused: its \.metadata names posix\.system"):
        load_checkpoint(path, model=model, optimizer=None, rank=0)
    assert main(["generate", "--checkpoint", str(path)]) == 2
    assert capfd.readouterr().err.strip() == f"moesaic generate: error: {expected}"
    assert not marker.exists()


def test_metadata_declaring_pickled_bytes_is_refused(tmp_path):
    # DCP's planner unpickles a bytes entry with weights_only=False: a second way in.
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = _save(tmp_path / "run", 1)
    md = ckpt_reader_metadata(path)
    md.state_dict_metadata["train.step"] = BytesStorageMetadata()
    (path / ".metadata").write_bytes(pickle.dumps(md))
    _rehash(path)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint_meta(path)
    assert str(info.value) == (
        f"checkpoint {path} is refused: entry 'train.step' is stored as BytesStorageMetadata; "
        "a moesaic checkpoint holds tensors only"
    )


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path):
    path = _save(tmp_path / "run", 1)
    md = ckpt_reader_metadata(path)
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../../etc/passwd"
    (path / ".metadata").write_bytes(pickle.dumps(md))
    _rehash(path)
    with pytest.raises(CheckpointError, match=r"data file '\.\./\.\./\.\./etc/passwd'; data files"):
        read_checkpoint_meta(path)


def ckpt_reader_metadata(path: Path):
    """The metadata of a checkpoint this test wrote itself (trusted: plain pickle)."""
    return pickle.loads((path / ".metadata").read_bytes())


def test_an_intact_checkpoint_still_loads_exactly(tmp_path):
    model, optimizer = _model(3)
    path = _save(tmp_path / "run", 7, model, optimizer)
    other, other_opt = _model(4)
    assert load_checkpoint(path, model=other, optimizer=other_opt, rank=0) == (7, 7)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


# ---- issue 57 item 2: latest names a checkpoint of this run -----------------------------------


@pytest.mark.parametrize("name", ["../../../../etc", "/etc", "step_1/../../x", "meta.json"])
def test_latest_must_name_a_step_directory_inside_checkpoints(tmp_path, name):
    _save(tmp_path / "run", 1)
    root = tmp_path / "run" / "checkpoints"
    (root / "latest").write_text(name + "\n")
    with pytest.raises(CheckpointError) as info:
        latest_checkpoint(str(tmp_path / "run"))
    assert str(info.value) == (
        f"checkpoint pointer {root / 'latest'} names {name!r}; it must name a step_<N> "
        f"directory inside {root}"
    )


def test_latest_may_not_name_a_link(tmp_path):
    _save(tmp_path / "run", 1)
    root = tmp_path / "run" / "checkpoints"
    (root / "step_00000009").symlink_to(tmp_path)
    (root / "latest").write_text("step_00000009\n")
    with pytest.raises(CheckpointError, match="it must name a step_<N> directory inside"):
        latest_checkpoint(str(tmp_path / "run"))


# ---- issue 57 item 3: resume goes back to the newest intact checkpoint -------------------------


def test_resume_passes_over_a_damaged_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    _save(run, 1)
    newest = _save(run, 2)
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # a worker killed mid-write
    layout = build_layout(1, 60.0)
    chosen = choose_resume_checkpoint(str(run), CFG, layout, torch.device("cpu"))
    assert chosen is not None
    path, meta, damage = chosen
    assert path.name == "step_00000001" and meta["step"] == 1
    assert damage == [f"checkpoint {newest} is corrupt: data file __0_0.distcp is missing or short"]
    assert ckpt_choice.resume_note(path, damage) == (
        f"{damage[0]}; resuming from step_00000001, the newest intact checkpoint"
    )
    # The single-process walk (the launcher) agrees.
    single = ckpt_choice.newest_intact_checkpoint(str(run), CFG)
    assert single is not None and single[0] == path
    # Nothing intact: the newest's damage, and that none older is intact either.
    shard = path / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    with pytest.raises(CheckpointDamaged) as info:
        choose_resume_checkpoint(str(run), CFG, layout, torch.device("cpu"))
    assert str(info.value) == (
        f"{damage[0]}; no older checkpoint in {run / 'checkpoints'} is intact either"
    )


def test_train_resume_falls_back_and_says_so(reference, data_file, tmp_path, capfd):
    run = start_from(reference, 8, tmp_path / "a")
    shutil.copytree(
        reference / "checkpoints" / "step_00000004", run / "checkpoints" / "step_00000004"
    )
    newest = run / "checkpoints" / "step_00000008"
    shard = newest / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert main(tiny_args(data_file, run, "--resume", "--steps", "10")) == 0
    err = capfd.readouterr().err
    line = (
        f"moesaic train: checkpoint {newest} is corrupt: data file __1_0.distcp is missing or "
        "short; resuming from step_00000004, the newest intact checkpoint"
    )
    assert err.count(line) == 1, err
    assert read_checkpoint_meta(run / "checkpoints" / "step_00000010")["step"] == 10


# ---- issue 49 item 4: each rank hashes its own files, outside any collective -------------------


def _hashes_by_rank(rank: int, world: int, run_dir: str) -> dict:
    from moesaic.train.parallel import build_layout as layout_of

    hashed: list[str] = []

    def spy_on(module) -> None:
        real = module._sha256

        def spy(path: Path) -> str:
            hashed.append(path.name)
            return real(path)

        module._sha256 = spy  # in this worker process only

    for module in (ckpt, ckpt_manifest):  # wherever the file hashing lives
        if hasattr(module, "_sha256"):
            spy_on(module)
    layout = layout_of(world, 60.0)
    torch.manual_seed(0)
    cfg = CFG
    model = MoEGPT(cfg, ep_group=layout.ep_group)
    optimizer = torch.optim.AdamW(model.parameters())
    init_optimizer_state(optimizer)
    meta = {**META, "world_size": world, "ep_size": world}
    save_checkpoint(run_dir, model=model, optimizer=optimizer, step=1, consumed=1, meta=meta,
                    layout=layout, keep=2)  # fmt: skip
    saved = list(hashed)
    hashed.clear()
    chosen = choose_resume_checkpoint(run_dir, cfg, layout, torch.device("cpu"))
    assert chosen is not None and not chosen[2]
    return {"save": saved, "resume": list(hashed)}


def test_each_rank_hashes_its_own_files(tmp_path):
    run_dir = str(tmp_path / "run")
    by_rank = run_world(_hashes_by_rank, 2, run_dir, timeout_s=240.0)
    save0, save1 = sorted(by_rank[0]["save"]), sorted(by_rank[1]["save"])
    # Rank 1 hashed what it wrote; rank 0 its own file and the two small ones, not rank 1's.
    assert save1 == ["__1_0.distcp"]
    assert save0 == [".metadata", "__0_0.distcp", "meta.json"]
    files = sorted(
        json.loads((Path(run_dir) / "checkpoints/step_00000001" / MANIFEST).read_text())["files"]
    )
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"]
    # Checking on resume: each file hashed once, by one rank, file i by rank i mod 2.
    assert sorted(by_rank[0]["resume"]) == [files[0], files[2]]
    assert sorted(by_rank[1]["resume"]) == [files[1], files[3]]


# ---- issue 49: asynchronous save -----------------------------------------------------------------


def test_async_save_writes_a_snapshot_and_publishes_later(tmp_path):
    model, optimizer = _model(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    saver = Checkpointer(
        str(tmp_path / "run"), layout=build_layout(1, 60.0), meta=META, keep=2, asynchronous=True
    )
    assert saver.save(model, optimizer, step=1, consumed=1) == []  # in flight, not published
    with torch.no_grad():  # training goes on: the weights change while it writes
        for p in model.parameters():
            p.add_(1.0)
    published = saver.finish()
    saver.close()
    final = tmp_path / "run" / "checkpoints" / "step_00000001"
    assert published == [(1, final)]
    assert latest_checkpoint(str(tmp_path / "run")) == final
    read_checkpoint_meta(final)  # every sha256
    loaded, _ = load_model_for_inference(final)
    for name, v in loaded.state_dict().items():
        assert torch.equal(v, before[name]), name  # the weights at the save, not after


def test_async_save_publishes_the_previous_one_at_the_next(tmp_path):
    model, optimizer = _model(6)
    saver = Checkpointer(
        str(tmp_path / "run"), layout=build_layout(1, 60.0), meta=META, keep=1, asynchronous=True
    )
    saver.save(model, optimizer, step=1, consumed=1)
    root = tmp_path / "run" / "checkpoints"
    assert saver.save(model, optimizer, step=2, consumed=2) == [(1, root / "step_00000001")]
    assert saver.finish() == [(2, root / "step_00000002")]
    saver.close()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]


def test_train_with_async_checkpoints(data_file, tmp_path):
    run = tmp_path / "run"
    assert main(tiny_args(data_file, run, "--async-checkpoint")) == 0
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000008"]
    for name in ("step_00000004", "step_00000008"):
        read_checkpoint_meta(root / name)
    kinds = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kinds if r["kind"] == "checkpoint"] == [4, 8]
    assert main(tiny_args(data_file, run, "--resume", "--steps", "10", "--async-checkpoint")) == 0
    assert read_checkpoint_meta(root / "step_00000010")["step"] == 10


# ---- issue 49: one host read for the finite check ------------------------------------------------


def test_finite_check_reads_the_host_once():
    state = {f"w{i}": torch.randn(5) for i in range(30)}
    state["w7"][2] = float("nan")
    state["w21"][0] = float("inf")
    state["ids"] = torch.arange(4)  # not floating point: not checked
    with HostSyncCounter() as syncs:
        bad = ckpt._nonfinite_keys(state)
    assert bad == ["w7", "w21"]
    assert len(syncs.events) == 1, syncs.events


# ---- issue 49 item 9: the device RNG in checkpoints ----------------------------------------------


class _FakeDeviceRng:
    """Stands in for torch.cuda's RNG on a CPU machine."""

    def __init__(self) -> None:
        self.state = torch.arange(16, dtype=torch.uint8)

    def get_rng_state(self) -> torch.Tensor:
        return self.state.clone()

    def set_rng_state(self, new_state: torch.Tensor) -> None:
        self.state = new_state.clone()


def test_device_rng_state_is_saved_and_restored(tmp_path, monkeypatch):
    fake = _FakeDeviceRng()
    monkeypatch.setattr(ckpt, "device_rng", lambda device: fake)
    model, optimizer = _model(8)
    path = _save(tmp_path / "run", 1, model, optimizer)
    assert "rng.cpu.0" in ckpt_reader_metadata(path).state_dict_metadata
    saved_cpu = torch.get_rng_state()
    fake.state = torch.zeros(16, dtype=torch.uint8)
    torch.manual_seed(123)
    load_checkpoint(path, model=model, optimizer=optimizer, rank=0)
    assert torch.equal(fake.state, torch.arange(16, dtype=torch.uint8))
    assert torch.equal(torch.get_rng_state(), saved_cpu)


def test_a_checkpoint_without_device_rng_leaves_it_alone(tmp_path, monkeypatch):
    model, optimizer = _model(9)
    path = _save(tmp_path / "run", 1, model, optimizer)  # a CPU run: no device RNG saved
    fake = _FakeDeviceRng()
    fake.state = torch.full((16,), 7, dtype=torch.uint8)
    monkeypatch.setattr(ckpt, "device_rng", lambda device: fake)
    load_checkpoint(path, model=model, optimizer=optimizer, rank=0)
    assert torch.equal(fake.state, torch.full((16,), 7, dtype=torch.uint8))


def test_a_failed_asynchronous_save_is_one_line_and_leaves_the_last_good_one(tmp_path, monkeypatch):
    model, optimizer = _model(7)
    run = tmp_path / "run"
    first = _save(run, 1, model, optimizer)
    saver = Checkpointer(
        str(run), layout=build_layout(1, 60.0), meta=META, keep=2, asynchronous=True
    )

    def full_disk(ckpt: Path, rank: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "write_part", full_disk)  # the writer thread's hashing step
    saver.save(model, optimizer, step=2, consumed=2)
    with pytest.raises(CheckpointError) as info:
        saver.finish()
    saver.close()
    root = run / "checkpoints"
    assert str(info.value) == (
        f"saving checkpoint step_00000002 in {root} failed: No space left on device"
    )
    assert latest_checkpoint(str(run)) == first
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
