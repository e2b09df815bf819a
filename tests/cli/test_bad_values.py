"""Values a careless or hostile user gives the shardify command: each is one line naming the value and the
problem, exit 2, and nothing is left half-written (found by a probe of the CLI, 2026-11-27)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from streambatch.cli import main
from streambatch.errors import UnknownStorage
from streambatch.io import storage
from streambatch.plan.buckets import MAX_BUCKETS
from streambatch.plan.config import BatchingConfig


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_exit_2(code: int, err: str, *needles: object) -> None:
    assert code == 2, err
    assert err.strip().count("\n") == 0 or err.startswith("usage:"), err  # argparse adds its usage line
    assert "unexpected error" not in err and "Traceback" not in err, err
    for n in needles:
        assert str(n) in err, err


@pytest.fixture
def dataset(tmp_path, audio_folder):
    folder, _ = audio_folder
    out = tmp_path / "ds"
    assert main(["write", str(folder), str(out), "--max-count", "2", "--no-progress"]) == 0
    return out


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "foo://bar/ds"],
        ["verify", "foo://bar/ds"],
        ["write", "{audio}", "foo://bar/out"],
        ["stage", "foo://bar/ds", "{tmp}/staged"],
        ["export", "{ds}", "--format", "nemo-tarred", "--out", "foo://bar/ex"],
    ],
)
def test_an_unknown_storage_scheme_is_named(capsys, tmp_path, audio_folder, dataset, argv):
    folder, _ = audio_folder
    argv = [a.format(audio=folder, tmp=tmp_path, ds=dataset) for a in argv]
    code, _, err = run(capsys, *argv)
    one_line_exit_2(code, err, "foo://bar", "unknown storage scheme 'foo'")


def test_the_library_names_an_unknown_scheme_and_a_missing_back_end():
    with pytest.raises(UnknownStorage, match="foo://x/y: unknown storage scheme 'foo'"):
        storage.filesystem("foo://x/y")
    with pytest.raises(UnknownStorage, match="unknown storage scheme 'nope'"):
        storage.filesystem("nope::s3://b/k")  # every scheme of a chained URL
    assert storage.filesystem_class("simplecache::s3://b/k").__name__ == "SimpleCacheFileSystem"


def test_a_corrupt_shard_met_by_export_is_an_input_error(capsys, dataset, tmp_path):
    shard = sorted(p for p in os.listdir(dataset) if p.endswith(".tar"))[0]
    path = dataset / shard
    path.write_bytes(path.read_bytes()[:700])  # cut inside the first member
    argv = ["export", dataset, "--format", "nemo-tarred", "--out", tmp_path / "ex", "--empty-text", "--no-progress"]
    code, _, err = run(capsys, *argv)
    one_line_exit_2(code, err, shard)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["write", "{audio}", "{tmp}/o", "--shuffle", "--seed", "-1"], "--seed"),
        (["write", "{audio}", "{tmp}/o", "--sample-rate", "99999999999999999999"], "--sample-rate"),
        (["demo", "{tmp}/d", "--seed", "-1"], "--seed"),
        (["demo", "{tmp}/d", "--num-utterances", "99999999999999999999"], "--num-utterances"),
        (["inspect", "{ds}", "--num-buckets", "1000000000"], "--num-buckets"),
        (["inspect", "{ds}", "--plot", "{tmp}"], "is a folder"),
        (["inspect", "{ds}", "--plot", "{tmp}/lengths.xyz"], "not .xyz"),
    ],
)
def test_out_of_range_values_are_usage_errors(capsys, tmp_path, audio_folder, dataset, argv, needle):
    folder, _ = audio_folder
    before = sorted(os.listdir(tmp_path))
    argv = [a.format(audio=folder, tmp=tmp_path, ds=dataset) for a in argv]
    code, _, err = run(capsys, *argv)
    one_line_exit_2(code, err, needle)
    assert sorted(os.listdir(tmp_path)) == before  # nothing started, nothing left


def test_the_library_bounds_num_buckets(tmp_path):
    lengths = np.array([16000, 32000, 48000])
    with pytest.raises(ValueError, match="num_buckets must be at most 4,096"):
        BatchingConfig.make(10 * 16000, lengths, num_buckets=MAX_BUCKETS + 1)
    assert BatchingConfig.make(10 * 16000, lengths, num_buckets=MAX_BUCKETS).budget == 160000


def test_a_plot_is_written_at_the_name_given(capsys, dataset, tmp_path):
    bare = tmp_path / "lengths"  # no suffix: matplotlib alone would write lengths.png
    code, out, err = run(capsys, "inspect", dataset, "--plot", bare)
    assert code == 0, err
    assert f"plot       {bare}" in out
    assert bare.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "lengths.png").exists()
    svg = tmp_path / "lengths.svg"  # a suffix picks the format
    assert run(capsys, "inspect", dataset, "--plot", svg)[0] == 0 and b"<svg" in svg.read_bytes()[:500]


@pytest.mark.parametrize(
    "text,needle",
    [
        ("datasets: [[[\n", "not a readable mixture file"),
        ('{"datasets": "x"}', "needs a non-empty 'datasets' list"),
        (b"datasets:\n  - path: \xff\xfe\n", "not a readable mixture file"),
        # a misspelt key took its default (weight 1) without a word
        ("datasets:\n  mid: {path: mid, wieght: 2}\n", "dataset 'mid' has unknown keys: 'wieght' (an entry takes path"),
        ("datasets:\n  - {name: a, path: a, weigth: 0.1}\n", "dataset 1 has unknown keys: 'weigth'"),
        ("datasets:\n  mid: {name: other, path: mid}\n", "dataset 'mid' has unknown keys: 'name'"),
    ],
)
def test_a_bad_mixture_file_is_one_line(capsys, tmp_path, text, needle):
    path = tmp_path / ("mix.json" if str(text).startswith("{") else "mix.yaml")
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, _, err = run(capsys, "inspect", path)
    one_line_exit_2(code, err, path, needle)


def test_an_atomic_write_that_cannot_publish_leaves_nothing(tmp_path):
    """The last step of every atomic write fails (a folder stands under the name): neither name keeps a file."""
    target = tmp_path / "out.json"
    target.mkdir()
    with pytest.raises(OSError):
        storage.write_bytes_atomic(str(target), b"{}")
    assert os.listdir(tmp_path) == ["out.json"] and os.listdir(target) == []


@pytest.mark.parametrize(
    "argv,needle",
    [
        # --plan took any epoch (only --step checked it): the loader's last epoch bounds every use
        (["inspect", "{ds}", "--plan", "--budget", "160000", "--epoch", "9" * 26], "--epoch"),
        (["inspect", "{ds}", "--plan", "--budget", "160000", "--epoch", "2147483648"], "at most 2,147,483,647"),
        (["inspect", "{ds}", "--step", "0", "--budget", "160000", "--epoch", "2147483648"], "--epoch"),
        (["inspect", "{ds}", "--plan", "--budget", "160000", "--seed", "4294967296"], "at most 4,294,967,295"),
        # an empty value was taken as the option left out
        (["inspect", "{ds}", "--budget", ""], "argument --budget: must not be empty"),
        (["inspect", "{ds}", "--plan", "--budget", ""], "argument --budget: must not be empty"),
        (["inspect", "{ds}", "--plot", ""], "argument --plot: must not be empty"),
        (["index", "{ds}", "--out", "{tmp}/ix", "--manifest", "", "--no-progress"], "argument --manifest: must not be"),
    ],
)
def test_values_out_of_range_or_empty_are_usage_errors_for_every_use(capsys, tmp_path, dataset, argv, needle):
    before = sorted(os.listdir(tmp_path))
    argv = [a.format(tmp=tmp_path, ds=dataset) for a in argv]
    code, out, err = run(capsys, *argv)
    one_line_exit_2(code, err, needle)
    assert out == "" and sorted(os.listdir(tmp_path)) == before


def test_the_last_epoch_and_seed_are_still_planned(capsys, dataset):
    code, out, err = run(capsys, "inspect", dataset, "--plan", "--budget", "160000", "--epoch", 2**31 - 1)
    assert code == 0, err
    code, out, err = run(capsys, "inspect", dataset, "--step", "0", "--budget", "160000", "--seed", 2**32 - 1)
    assert code == 0, err


@pytest.mark.parametrize("seed", ["9" * 26, str(2**32)])
def test_a_demo_seed_out_of_range_writes_nothing(capsys, tmp_path, seed):
    code, out, err = run(capsys, "demo", tmp_path / "d", "--seed", seed, "--num-utterances", "2")
    one_line_exit_2(code, err, "argument --seed: must be at most 4,294,967,295")
    assert not (tmp_path / "d").exists()  # checked before the dataset was written


def test_inspect_bounds_the_epoch_as_the_loader_does():
    from streambatch.cli.inspect import MAX_EPOCH as INSPECT_MAX_EPOCH
    from streambatch.loader.state import MAX_EPOCH

    assert INSPECT_MAX_EPOCH == MAX_EPOCH  # a copy: the loader's module imports torch, the command line starts without
