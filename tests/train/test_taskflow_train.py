"""``moesaic train --strategy taskflow``: the training job on the compiled tile plans (EP 2, both
executors) learns exactly what the ``dropless`` reference run learns, checkpoints included."""

from __future__ import annotations

import pytest
from _train_helpers import tiny_args, train_losses

from moesaic.cli import main


@pytest.mark.parametrize("executor", ["static", "dynamic"])
def test_taskflow_run_matches_the_dropless_reference(executor, data_file, reference, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(data_file, run_dir, "--strategy", "taskflow")
    if executor == "dynamic":  # the executor is a model-config field: set it in a config file
        cfg = tmp_path / "tf.toml"
        cfg.write_text('[model.moe]\ntaskflow_executor = "dynamic"\n')
        args += ["--config", str(cfg)]
    assert main(args) == 0
    want, got = train_losses(reference), train_losses(run_dir)
    assert sorted(got) == sorted(want)
    for step, loss in want.items():  # same math, other tiling and summation order
        assert got[step] == pytest.approx(loss, rel=1e-4, abs=1e-5), step
    metas = sorted(run_dir.glob("checkpoints/step_*/meta.json"))
    assert metas and f'"taskflow_executor": "{executor}"' in metas[-1].read_text()
