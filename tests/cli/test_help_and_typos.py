"""What a new user reads first: ``shardify write --help`` is short, shows examples and names every kind of SRC
(Kaldi and lhotse were missing), and a mistyped option prints the subcommand's own usage and the closest option
(it printed the top-level usage)."""

from __future__ import annotations

import pytest

from streambatch.cli import main
from streambatch.write.sources import KINDS


def run(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_write_help_is_short_with_examples_and_every_kind_of_source(capsys):
    code, out, _ = run(capsys, "write", "--help")
    assert code == 0
    assert len(out.splitlines()) <= 100
    assert "examples:" in out and "shardify write audio/ ds" in out
    listed = out.split("SRC is one of", 1)[1]
    for kind in KINDS:
        assert f"\n  {kind} " in listed, kind
    for word in ("Kaldi", "lhotse", "NeMo", "SpeechBrain", "hf:NAME"):
        assert word in listed


@pytest.mark.parametrize(
    "argv, closest",
    [
        (["write", "a", "b", "--max-cont", "10"], "--max-count"),
        (["write", "a", "b", "--sufle"], "--shuffle"),
        (["inspect", "ds", "--budjet", "60s"], "--budget"),
        (["verify", "ds", "--decdoe"], "--decode"),
    ],
)
def test_a_mistyped_option_names_the_closest_one_under_the_subcommands_usage(capsys, argv, closest):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"usage: shardify {argv[0]} ")
    assert f"did you mean {closest}?" in err.splitlines()[-1]


def test_an_option_like_no_other_points_to_the_subcommands_help(capsys):
    code, _, err = run(capsys, "inspect", "ds", "--zzzzzz")
    assert code == 2 and err.startswith("usage: shardify inspect ")
    assert "shardify inspect --help" in err
