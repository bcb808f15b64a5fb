"""Messages that name the file or the rule (issue 25 item 8).

Before: a binary ``--config`` said ``'utf-8' codec can't decode ...`` without the file;
``--config DIR`` said "does not exist"; ``calibrate --links`` with a JSON list raised
``list indices must be integers``; ``generate --prompt`` with non-UTF-8 bytes failed on
surrogates; ``generate --temperature nan`` reached torch's internals.
"""

from __future__ import annotations

import json

import pytest

from moesaic.checks import read_toml
from moesaic.sim.profile import links_from_cluster_check
from moesaic.simtools.cli_files import load_option


def test_binary_config_names_the_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match=r"config file '.*c\.toml' is not text \(TOML is UTF-8"):
        read_toml(f, "config file")


def test_config_that_is_a_directory_says_so(tmp_path):
    with pytest.raises(ValueError, match=r"config file '.*' is a directory; name a TOML file"):
        read_toml(tmp_path, "config file")


def _links(path) -> None:
    load_option("links", str(path), links_from_cluster_check)


def test_links_that_are_not_a_cluster_check_result(tmp_path):
    # The option and the file are named once (issue 57 item 8: "--links /dev/null: --links
    # /dev/null: cannot be read as JSON").
    f = tmp_path / "links.json"
    f.write_text(json.dumps([1, 2, 3]))
    with pytest.raises(ValueError, match=r"^--links \S+: not a cluster_check result .* got a list"):
        _links(f)
    f.write_text("{not json")
    with pytest.raises(ValueError, match=r"^--links \S+: cannot be read as JSON") as info:
        _links(f)
    assert str(info.value).count("--links") == 1 and str(info.value).count(str(f)) == 1
    f.write_text(json.dumps({"unshaped": {}}))
    with pytest.raises(ValueError, match=r"^--links \S+: not a cluster_check result \(missing"):
        _links(f)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_generate_temperature_must_be_finite(bad):
    from moesaic.train.generate import generate_text

    with pytest.raises(ValueError, match=r"temperature \(.*\) must be a finite number >= 0"):
        generate_text("/nonexistent", "x", temperature=bad)


@pytest.mark.parametrize("bad", [float("nan"), 0.5, -1.0, float("inf")])
def test_compression_ratio_has_one_rule(bad):
    """nan said ">= 0" while 0.5 said ">= 1": one rule for every bad value now."""
    from moesaic.config import MoEConfig

    with pytest.raises(ValueError, match=r"^compression_ratio \(.*\) must be a finite number >= 1"):
        MoEConfig(
            hidden_size=8,
            ffn_hidden_size=8,
            num_experts=2,
            dispatcher="hybrid",
            options={"compression_ratio": bad},
        )
