"""What `shardify write`, `merge` and `export` say, and leave, when their input is malformed or their output does not
fit: one line naming the file and the problem (exit 2), and nothing half-written. Real files throughout: real audio,
real tars, manifests and part indexes written by the code; a full disk is an ``ENOSPC`` from ``os.fsync`` (where a
full disk reports itself once the page cache is written) on the one file being written."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import soundfile as sf
from conftest import TESTS

from streambatch import OptionError, write_shards
from streambatch.cli import main
from streambatch.write.adopt.index import index_tars

AUDIO = TESTS / "data" / "real" / "audio"
#: real 16 kHz recordings, each given a transcript (NeMo's manifests need one)
CLIPS = ["2412-153948-0000.flac", "2412-153948-0001.flac", "libri-1088-134315-0000.wav"]


def shardify(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    """Run the CLI; its exit code, the lines it wrote to stderr and what it printed."""
    capsys.readouterr()
    code = main([*argv, "--no-progress"] if argv[0] in ("write", "export") else list(argv))
    out, err = capsys.readouterr()
    return code, err.strip().splitlines(), out


def everything(folder: Path) -> list[str]:
    """Every path under ``folder`` (relative), sorted; empty when it does not exist."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def contents(folder: Path) -> dict[str, bytes | str]:
    """Each file's bytes (a link's target) under ``folder``, by relative path."""
    return {
        str(p.relative_to(folder)): os.readlink(p) if p.is_symlink() else p.read_bytes()
        for p in folder.rglob("*")
        if p.is_symlink() or p.is_file()
    }


def clips(tmp_path: Path) -> Path:
    """A folder of the real clips, each with its transcript beside it."""
    folder = tmp_path / "clips"
    folder.mkdir()
    for name in CLIPS:
        shutil.copy(AUDIO / name, folder / name)
        (folder / name).with_suffix(".txt").write_text(f"the words of {name.split('.')[0]}\n")
    return folder


def dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """The clips written as a dataset of three one-sample shards."""
    ds = tmp_path / "ds"
    assert shardify(capsys, "write", str(clips(tmp_path)), str(ds), "--max-count", "1")[0] == 0
    return ds


def no_space_for(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """``os.fsync`` of a file whose path holds one of ``names`` fails as on a full disk."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if any(n in os.readlink(f"/proc/self/fd/{fd}") for n in names):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


# ---- merge: a part index whose part fields are malformed -----------------------------------------
@pytest.mark.parametrize(
    "field, value, said",
    [
        ("index", "1", "meta.part.index is '1'"),
        ("index", -1, "meta.part.index is -1"),
        ("index", True, "meta.part.index is True"),
        ("index", 0, "meta.part.index is 0, expected 1, the part its file is named for"),
        ("count", "2", "meta.part.count is '2'"),
        ("records", [8], "meta.part.records is [8]"),
    ],
)
def test_merge_names_the_malformed_field_of_a_part_index(tmp_path, capsys, field, value, said):
    src, out = clips(tmp_path), tmp_path / "parts"
    for i in range(2):
        assert shardify(capsys, "write", str(src), str(out), "--part", f"{i}/2")[0] == 0
    part = out / "index.part-0001.json"
    header = json.loads(part.read_text())
    header["meta"]["part"][field] = value
    part.write_text(json.dumps(header))
    before = everything(out)
    code, err, _ = shardify(capsys, "merge", str(out))
    assert code == 2 and len(err) == 1, err
    assert f"{part}: malformed part index: {said}" in err[0], err
    assert "missing" not in err[0] and "given twice" not in err[0], err
    assert everything(out) == before  # no index.json, no table


# ---- write: which line of a manifest is malformed ------------------------------------------------
@pytest.mark.parametrize("name", ["m.jsonl", "m.json"])
def test_a_one_line_manifest_cut_short_is_a_malformed_json_line_1(tmp_path, capsys, name):
    manifest = tmp_path / name
    entry = json.dumps({"audio_filepath": str(AUDIO / CLIPS[0]), "duration": 1.5, "text": "hi"})
    manifest.write_text(entry[:-1] + "\n")  # no closing brace
    code, err, _ = shardify(capsys, "write", str(manifest), str(tmp_path / "out"))
    assert code == 2 and len(err) == 1, err
    assert f"{manifest}:1: not a valid JSON line (Expecting ',' delimiter)" in err[0], err
    assert "SpeechBrain" not in err[0] and ":2:" not in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_malformed_first_line_is_one_bad_line_of_a_nemo_manifest(tmp_path, capsys):
    manifest = tmp_path / "m.json"
    entries = [{"audio_filepath": str(AUDIO / c), "duration": sf.info(str(AUDIO / c)).duration} for c in CLIPS]
    lines = [json.dumps(e) for e in entries]
    manifest.write_text(lines[0][:-1] + "\n" + "\n".join(lines[1:]) + "\n")
    code, err, _ = shardify(capsys, "write", str(manifest), str(tmp_path / "out"))
    assert code == 2 and err[1:2] == [f"  {manifest}:1: not valid JSON (Expecting ',' delimiter)"], err
    assert err[0].startswith("shardify: error: 1 problem in the input"), err
    assert not (tmp_path / "out").exists()
    code, err, _ = shardify(capsys, "write", str(manifest), str(tmp_path / "out"), "--on-error", "skip")
    assert code == 0, err
    skipped = [json.loads(line) for line in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert [(e["line"], e["error"]) for e in skipped] == [(1, "not valid JSON (Expecting ',' delimiter)")]


def test_a_speechbrain_manifest_cut_short_names_its_last_line(tmp_path, capsys):
    manifest = tmp_path / "sb.json"
    manifest.write_text(json.dumps({"u1": {"wav": str(AUDIO / CLIPS[0]), "length": 1.5}})[:-1] + "\n\n")
    code, err, _ = shardify(capsys, "write", str(manifest), str(tmp_path / "out"))
    assert code == 2 and len(err) == 1, err
    assert f"{manifest}:1: not a valid SpeechBrain JSON manifest (expected ',' or '}}')" in err[0], err


# ---- write and merge: the disk fills while the index is written ----------------------------------
#: the index's files a full disk stops: its tables, or its header (index.json) once the tables are written
INDEX_FILES = [("/index.samples/", "/index.shards.parquet"), ("/index.json.tmp-",)]


@pytest.mark.parametrize("failing", INDEX_FILES)
def test_write_out_of_space_for_the_index_keeps_whole_shards_for_resume(tmp_path, capsys, monkeypatch, failing):
    src, out = clips(tmp_path), tmp_path / "out"
    no_space_for(monkeypatch, *failing)
    code, err, _ = shardify(capsys, "write", str(src), str(out), "--max-count", "1")
    assert code == 2 and len(err) == 1, err
    assert f"{out / 'index.json'}: no space left on device" in err[0], err
    assert "the 3 whole shards written so far stay" in err[0] and "--resume" in err[0], err
    # no table, no empty index.samples/, no temporary file
    assert everything(out) == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    monkeypatch.undo()
    code, err, said = shardify(capsys, "write", str(src), str(out), "--max-count", "1", "--resume")
    assert code == 0 and "kept 3 complete shards, wrote 0" in said, err


@pytest.mark.parametrize("failing", INDEX_FILES)
def test_merge_out_of_space_for_the_index_leaves_the_parts_as_they_were(tmp_path, capsys, monkeypatch, failing):
    src, out = clips(tmp_path), tmp_path / "parts"
    for i in range(2):
        assert shardify(capsys, "write", str(src), str(out), "--part", f"{i}/2")[0] == 0
    before = everything(out)
    no_space_for(monkeypatch, *failing)
    code, err, _ = shardify(capsys, "merge", str(out))
    assert code == 2 and len(err) == 1 and f"{out / 'index.json'}: no space left on device" in err[0], err
    assert everything(out) == before  # no table, not even an empty index.samples/, no temporary file
    monkeypatch.undo()
    assert shardify(capsys, "merge", str(out))[0] == 0


# ---- export: a full disk, or a shard that cannot be read, midway ----------------------------------
@pytest.mark.parametrize(
    "failing", ["sharded_manifests/manifest_1.json", "tarred_audio_filepaths.json", "tarred_audio_manifest.json"]
)
def test_export_to_a_full_disk_names_the_file_and_leaves_nothing(tmp_path, capsys, monkeypatch, failing):
    ds, dest = dataset(tmp_path, capsys), tmp_path / "export"
    no_space_for(monkeypatch, failing)
    code, err, _ = shardify(capsys, "export", str(ds), "--format", "nemo-tarred", "--out", str(dest))
    assert code == 2 and len(err) == 1, err
    assert failing in err[0] and "no space left on device while writing NeMo's manifests" in err[0], err
    assert not dest.exists()


def test_export_over_an_earlier_one_to_a_full_disk_keeps_the_earlier_whole(tmp_path, capsys, monkeypatch):
    ds, dest = dataset(tmp_path, capsys), tmp_path / "export"
    assert shardify(capsys, "export", str(ds), "--format", "nemo-tarred", "--out", str(dest), "--links")[0] == 0
    earlier = contents(dest)
    no_space_for(monkeypatch, "manifest_2.json")
    argv = ("export", str(ds), "--format", "nemo-tarred", "--out", str(dest), "--links", "--overwrite")
    code, err, _ = shardify(capsys, *argv)
    assert code == 2 and len(err) == 1 and "sharded_manifests/manifest_2.json: no space left" in err[0], err
    assert contents(dest) == earlier and everything(dest) == sorted([*earlier, "audio", "sharded_manifests"])


def test_export_out_of_space_for_the_links_leaves_no_link_folder(tmp_path, capsys, monkeypatch):
    ds, dest = dataset(tmp_path, capsys), tmp_path / "export"
    real = os.symlink

    def symlink(target: str, link: str, *args: object, **kw: object) -> None:
        if link.endswith("audio_1.tar"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(target, link, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "symlink", symlink)
    code, err, _ = shardify(capsys, "export", str(ds), "--format", "nemo-tarred", "--out", str(dest), "--links")
    assert code == 2 and len(err) == 1, err
    assert f"{dest / 'audio'}: no space left on device while writing the links" in err[0], err
    assert not dest.exists()


def test_export_of_a_shard_unreadable_midway_leaves_nothing(tmp_path, capsys):
    """A regression guard (item 5: this already held): the third tar's header is garbage."""
    ds, dest = dataset(tmp_path, capsys), tmp_path / "export"
    with open(ds / "shard-000002.tar", "r+b") as f:
        f.write(b"\xff" * 512)
    code, err, _ = shardify(capsys, "export", str(ds), "--format", "nemo-tarred", "--out", str(dest))
    assert code == 2 and len(err) == 1 and f"{ds / 'shard-000002.tar'}: " in err[0], err
    assert not dest.exists()


@pytest.mark.parametrize("failing", [("index.json",), ("index.samples",)])
def test_upgrade_out_of_space_leaves_the_version_1_index_alone(tmp_path, capsys, monkeypatch, failing):
    """An upgrade that cannot finish leaves the folder as it was: the version 1 index, and no table, empty
    sample-table folder or temporary file beside it."""
    src, out = clips(tmp_path), tmp_path / "out"
    code, err, _ = shardify(capsys, "write", str(src), str(out), "--max-count", "1", "--index-version", "1")
    assert code == 0, err
    before = contents(out)
    no_space_for(monkeypatch, *failing)
    code, err, _ = shardify(capsys, "upgrade", str(out), "--no-progress")
    assert code == 2 and len(err) == 1 and "no space left on device" in err[0], err
    assert contents(out) == before


@pytest.mark.parametrize(
    "option,value,said",
    [
        ("seed", -1, "seed must be at least 0"),
        ("seed", "x", "seed must be a whole number"),
        ("workers", "2", "workers must be a whole number"),
        ("workers", 1.7, "workers must be a whole number"),
        ("workers", 10**6, "workers must be at most 1,024"),
        ("max_count", 2.5, "max_count must be a whole number"),
        ("shuffle", "no", "shuffle must be True or False"),
        ("sample_rate", "16k", "sample_rate must be a whole number"),
    ],
)
def test_write_shards_names_a_bad_option_before_reading(tmp_path, option, value, said):
    out = tmp_path / "out"
    with pytest.raises(OptionError, match=said):
        write_shards(str(clips(tmp_path)), str(out), progress=False, **{option: value})
    assert not out.exists()


@pytest.mark.parametrize(
    "option,value,said",
    [
        ("workers", 10**6, "workers must be at most 1,024"),
        ("workers", 1.7, "workers must be a whole number"),
        ("workers", 0, "workers must be at least 1"),
        ("layout", "wav", "layout must be one of"),
        ("on_error", "ignore", "on_error must be one of"),
    ],
)
def test_index_tars_names_a_bad_option_before_reading(tmp_path, option, value, said):
    """``index_tars`` takes ``workers`` within the bound ``write_shards`` has (a million would start a million
    processes), and refuses a bad value before any tar is read or anything written."""
    src = tmp_path / "tars"
    src.mkdir()
    with pytest.raises(OptionError, match=said):
        index_tars(str(src), progress=False, **{option: value})
    assert list(src.iterdir()) == []


@pytest.mark.parametrize(
    "option,value,said",
    [
        ("columns", 5, "columns must be field names"),
        ("columns", [1, 2], r"columns must be field names \(text\)"),
        ("stats", 5, "stats must be a dict"),
    ],
)
def test_write_shards_names_bad_columns_or_stats_before_reading(tmp_path, option, value, said):
    out = tmp_path / "out"
    with pytest.raises(OptionError, match=said):
        write_shards(str(clips(tmp_path)), str(out), progress=False, **{option: value})
    assert not out.exists()
