"""Each option is declared once (issue 52 A2): its config field and the field's doc. The flags of
``moesaic train`` are generated from them (``moesaic.field_flags``), so a new field is a new
flag, with its doc as help, and no table to edit. Only parsing: nothing trains."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from moesaic.cli import build_parser
from moesaic.config import MoEConfig
from moesaic.field_flags import FLAG, field_docs, field_flags
from moesaic.models.config import MoEGPTConfig
from moesaic.train import flags
from moesaic.train.config import TrainConfig


@dataclasses.dataclass(kw_only=True, slots=True)
class WithKnobs(TrainConfig):
    """TrainConfig with two fields more.

    Attributes:
        warp_factor: how fast the run goes, in warps
            (a second line of its doc).
        fold_space: fold space before the first step.
    """

    warp_factor: int = 3
    fold_space: bool = False


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    flags.add_train_arguments(parser)
    return parser


def test_a_new_field_is_a_flag_with_its_doc(monkeypatch):
    monkeypatch.setattr(flags, "TrainConfig", WithKnobs)
    parser = _train_parser()
    actions = {a.dest: a for a in parser._actions}
    warp, fold = actions["warp_factor"], actions["fold_space"]
    assert warp.option_strings == ["--warp-factor"] and warp.type is int
    assert warp.help == "how fast the run goes, in warps (a second line of its doc). (default: 3)"
    assert fold.option_strings == ["--fold-space"] and fold.nargs == 0
    cfg = flags.config_from_args(parser.parse_args(["--warp-factor", "5", "--fold-space"]))
    assert isinstance(cfg, WithKnobs) and (cfg.warp_factor, cfg.fold_space) == (5, True)
    # unset, the field's default holds (flags stay absent)
    assert flags.config_from_args(parser.parse_args([])).warp_factor == 3


def test_help_lists_every_field_with_its_doc(capsys):
    with pytest.raises(SystemExit):
        build_parser("train").parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse's wrapping undone
    model = MoEGPTConfig()
    checked = 0
    for cls, skip in ((TrainConfig, ()), (MoEGPTConfig, ()), (type(model.moe), ())):
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name in skip or f.metadata.get(FLAG, "") is None or f.name in ("model", "moe"):
                continue
            if f.name == "options":
                continue  # a table: its options are flags of their own (below)
            flag = f.metadata.get(FLAG, f"--{f.name.replace('_', '-')}")
            if hints[f.name] is bool and f.default is True:
                flag = f"--no-{f.name.replace('_', '-')}"
            first_words = " ".join(docs[f.name].replace("``", "").split()[:6])
            assert flag in text and first_words in text, (cls.__name__, f.name)
            checked += 1
    assert checked > 60
    for option in ("--domains", "--expert-compression-ratio", "--taskflow-executor"):
        assert option in text


def test_switches_and_types_follow_the_field():
    by_dest = {f.dest: f for f in field_flags(TrainConfig)}
    assert by_dest["progress"].flags == ("--no-progress",)  # default True: the flag turns it off
    assert by_dest["resume"].action == "store_true"
    assert by_dest["steps"].parse is int and by_dest["lr"].parse is float
    assert by_dest["pipeline_degree"].parse is str  # "auto" or R: TrainConfig parses the text
    assert TrainConfig(pipeline_degree="4", schedule="flowmoe", batch_size=8).pipeline_degree == 4
    assert "auto_domains" not in by_dest  # FLAG None: set by --domains auto
    moe = {f.dest: f for f in field_flags(MoEConfig, defaults=MoEGPTConfig().moe)}
    assert moe["num_experts"].flags == ("--experts",)
    assert moe["dispatcher"].flags == ("--strategy", "--dispatcher")  # messages say --strategy
    assert "hidden_size" not in moe and "collective_timeout_s" not in moe


def test_a_field_without_a_doc_is_refused():
    @dataclasses.dataclass
    class Undocumented:
        """No attributes section."""

        knob: int = 1

    with pytest.raises(ValueError, match=r"Undocumented.knob has no entry in the class docstring"):
        field_flags(Undocumented)
