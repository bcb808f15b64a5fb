"""``moesaic train`` through the stand-in device streams (``MOESAIC_STANDIN_STREAMS=1``, see
``comm/streams.py``): the whole job on the branches an NCCL job takes (every wait of the
loop's control plane, evaluation and checkpoints included, a stream wait) trains bitwise as the
gloo reference run: the same loss at every step and the same final weights."""

from __future__ import annotations

import torch
from _train_helpers import final_weights, tiny_args, train_losses

from moesaic.cli import main
from moesaic.comm.streams import ENV_VAR


def test_train_through_the_standin_equals_the_reference(
    reference, data_file, tmp_path, monkeypatch
):
    monkeypatch.setenv(ENV_VAR, "1")  # the workers inherit it
    run_dir = tmp_path / "standin"
    assert main(tiny_args(data_file, run_dir)) == 0
    assert train_losses(run_dir) == train_losses(reference)
    want, got = final_weights(reference), final_weights(run_dir)
    assert want.keys() == got.keys()
    for name, w in want.items():
        assert torch.equal(got[name], w), name
