"""One grammar of amounts (docs/guide/amounts.md), one rule for a budget: ``shardify inspect --budget`` and the
loader read ``3.2M``, ``1h``, ``90min`` alike, and refuse alike a budget that not even the shortest sample fits
(the loader raised `BudgetError` where ``inspect`` printed a summary and exited 0)."""

from __future__ import annotations

import pytest
from conftest import audio_dataset

from streambatch import BudgetError, OptionError, StreamBatchLoader
from streambatch.cli import main
from streambatch.units import parse_count, parse_duration, parse_length


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return audio_dataset(tmp_path_factory.mktemp("amounts"), 12, corpus_seed=4, max_count=4)


def run(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_budget_no_sample_fits_is_refused_by_inspect_as_by_the_loader(capsys, ds):
    with pytest.raises(BudgetError) as loader_error:
        StreamBatchLoader(ds, "0.05s")
    for extra in ([], ["--plan"], ["--json"]):
        code, out, err = run(capsys, "inspect", ds, "--budget", "0.05s", *extra)
        assert code == 2 and out == ""
        assert err.strip() == f"shardify: error: {loader_error.value}"


@pytest.mark.parametrize("text, seconds", [("3.2M", 200.0), ("3.2M samples", 200.0), ("1h", 3600.0), ("90min", 5400.0)])
def test_counts_and_durations_read_alike_in_inspect_and_the_loader(capsys, ds, text, seconds):
    rate = StreamBatchLoader(ds, "60s").index.sample_rate
    assert rate == 16000
    assert StreamBatchLoader(ds, text).config.budget == seconds * rate
    code, out, err = run(capsys, "inspect", ds, "--budget", text, "--json")
    assert code == 0, err
    assert f'"budget": {int(seconds * rate)}' in out


def test_the_grammar():
    assert parse_length("3.2M", "samples", 16000) == 3_200_000
    assert parse_length("2.5k tokens", "tokens", None) == 2500
    assert parse_length("1h", "samples", 8000) == 3600 * 8000
    assert parse_length("500ms", "seconds", None) == 0.5
    assert parse_duration("1.5min") == 90 and parse_duration("2h") == 7200 and parse_duration(3) == 3
    assert parse_count("10k") == 10_000 and parse_count("2.5M") == 2_500_000 and parse_count("7") == 7
    for bad in ("1.5", "10 s", "x", "-1"):
        with pytest.raises(OptionError, match="count"):
            parse_count(bad, "count")
    with pytest.raises(OptionError, match="'parsecs' is not this dataset's unit"):
        parse_length("3 parsecs", "samples", 16000)
    with pytest.raises(OptionError, match="seconds only make sense for audio"):
        parse_length("1h", "tokens", None)


def test_write_takes_a_count_in_the_grammar(capsys, tmp_path, ds):
    from streambatch.synthetic import write_audio_corpus

    write_audio_corpus(str(tmp_path / "audio"), 5, seed=1, sample_rate=16000)
    code, out, err = run(capsys, "write", tmp_path / "audio", tmp_path / "out", "--max-count", "1k", "--no-progress")
    assert code == 0, err
    assert "5 samples in 1 shards" in out
    code, _, err = run(capsys, "write", tmp_path / "audio", tmp_path / "o2", "--max-count", "1.5", "--no-progress")
    assert code == 2 and "--max-count" in err and "amounts.md" in err


def test_inspect_leaves_no_carriage_returns_in_a_log(ds, tmp_path):
    """stderr into a file (a job's log): no progress bar's ``\\r`` redraws in it, the summary whole on stdout."""
    import subprocess
    import sys

    with open(tmp_path / "err.log", "wb") as log:
        done = subprocess.run(
            [sys.executable, "-m", "streambatch.cli", "inspect", ds, "--budget", "60s"],
            stdout=subprocess.PIPE,
            stderr=log,
            timeout=120,
        )
    assert done.returncode == 0
    assert b"\r" not in (tmp_path / "err.log").read_bytes() and b"\r" not in done.stdout
    assert b"budget" in done.stdout
