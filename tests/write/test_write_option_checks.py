"""``write_shards`` and ``index_tars`` check every option's value before anything is read or replaced: a value of
the wrong type is an :class:`OptionError` naming the option, never taken for its truth (``overwrite="false"``
replaced a dataset), turned into a path (``out=None`` wrote into ``./None``) or a default (``unit=0``), nor a raw
``TypeError`` deep inside (found by a probe of the API, 2026-11-28)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from streambatch.errors import OptionError, ShardifyError
from streambatch.write.adopt import index_tars
from streambatch.write.writer import write_shards

KW = dict(max_count=2, progress=False)


def contents(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and its sha256 (what a refused call must leave as it was)."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def written(tmp_path, audio_folder):
    """(source folder, a complete dataset written from it)."""
    folder, _ = audio_folder
    out = tmp_path / "ds"
    write_shards(str(folder), str(out), **KW)
    return folder, out


@pytest.fixture
def tars(written):
    """A folder of tars with an index beside them (``index_tars``'s), as ``(folder, its files before)``."""
    _, ds = written
    folder = ds.parent / "tars"
    folder.mkdir()
    for tar in ds.glob("*.tar"):
        shutil.copy(tar, folder / tar.name)
    index_tars(str(folder), progress=False)
    return folder, contents(folder)


# ---- write_shards --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "option,value",
    [
        ("overwrite", "false"),
        ("overwrite", "no"),
        ("overwrite", 1),
        ("overwrite", None),
        ("resume", "false"),
        ("resume", 1),
        ("progress", "abc"),
        ("progress", None),
        ("storage_options", "abc"),
        ("storage_options", [1]),
        ("storage_options", -1),
    ],
)
def test_write_refuses_an_option_of_the_wrong_type_and_keeps_the_dataset(written, option, value):
    folder, out = written
    before = contents(out)
    kw = {**KW, option: value}
    with pytest.raises(OptionError, match=rf"^{option} must be .*, got {re.escape(repr(value))}"):
        write_shards(str(folder), str(out), **kw)
    assert contents(out) == before  # the dataset there is untouched


@pytest.mark.parametrize("option", ["src", "out"])
@pytest.mark.parametrize("value", [None, "", 5, ["a"]])
def test_write_refuses_a_src_or_out_that_is_not_a_path(tmp_path, audio_folder, monkeypatch, option, value):
    folder, _ = audio_folder
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    args = {"src": str(folder), "out": str(tmp_path / "o"), option: value}
    with pytest.raises(OptionError, match=rf"^{option} must be .*, got {re.escape(repr(value))}"):
        write_shards(args["src"], args["out"], **KW)
    assert list(work.iterdir()) == [] and not (tmp_path / "o").exists()  # no ./None, no OUT made


def test_write_takes_paths(tmp_path, audio_folder):
    folder, _ = audio_folder
    index = write_shards(folder, tmp_path / "o", storage_options={}, **KW)  # os.PathLike, and an empty mapping
    assert index.num_samples == 5 and (tmp_path / "o" / "index.json").exists()


@pytest.mark.parametrize("value", [True, False, 1.0, "2", 3, 0])
def test_write_refuses_an_index_version_that_is_not_1_or_2(tmp_path, audio_folder, value):
    folder, _ = audio_folder
    with pytest.raises(OptionError, match=rf"^index_version must be 1 or 2, got {re.escape(repr(value))}"):
        write_shards(str(folder), str(tmp_path / "o"), index_version=value, **KW)
    assert not (tmp_path / "o").exists()


def test_write_still_writes_a_version_1_index(tmp_path, audio_folder):
    folder, _ = audio_folder
    write_shards(str(folder), str(tmp_path / "o"), index_version=1, **KW)
    assert json.loads((tmp_path / "o" / "index.json").read_text())["version"] == 1


@pytest.mark.parametrize("value", [0, "", False, [], "hours"])
def test_write_refuses_a_unit_that_names_none(tmp_path, audio_folder, value):
    folder, _ = audio_folder
    with pytest.raises(OptionError, match=rf"unknown unit {re.escape(repr(value))}"):
        write_shards(str(folder), str(tmp_path / "o"), unit=value, **KW)
    assert not (tmp_path / "o").exists()


# ---- index_tars ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "option,value",
    [
        ("overwrite", "false"),
        ("overwrite", 1),
        ("overwrite", None),
        ("progress", "abc"),
        ("progress", None),
        ("storage_options", "abc"),
        ("storage_options", [1]),
        ("storage_options", -1),
        ("manifest", -1),
        ("manifest", [1]),
        ("manifest", 0),
        ("manifest", ""),
        ("manifest", 2.5),
        ("sample_rate", "abc"),
        ("sample_rate", float("nan")),
        ("sample_rate", float("inf")),
        ("sample_rate", True),
        ("sample_rate", 0),
        ("sample_rate", 2**31),
    ],
)
def test_index_refuses_an_option_of_the_wrong_type_and_keeps_the_index(tars, option, value):
    folder, before = tars
    kw = {"progress": False, "overwrite": True, option: value}  # overwrite=True: only the bad value stops it
    with pytest.raises(OptionError, match=rf"^{option} must be "):
        index_tars(str(folder), **kw)
    assert contents(folder) == before


def test_index_refuses_a_manifest_that_is_a_folder(tars):
    folder, before = tars
    (folder / "manifests").mkdir()
    with pytest.raises(OptionError, match=r"^manifest must be a NeMo manifest file, got the folder"):
        index_tars(str(folder), manifest=str(folder / "manifests"), overwrite=True, progress=False)
    (folder / "manifests").rmdir()
    assert contents(folder) == before


@pytest.mark.parametrize("option", ["src", "out"])
@pytest.mark.parametrize("value", ["", 5, ["a"]] + [None])
def test_index_refuses_a_src_or_out_that_is_not_a_path(tars, monkeypatch, option, value):
    folder, before = tars
    if option == "out" and value is None:
        value = 0  # out=None is the default: beside the tars
    work = folder.parent / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    args = {"src": str(folder), "out": str(folder.parent / "ix"), option: value}
    with pytest.raises(OptionError, match=rf"^{option} must be .*, got {re.escape(repr(value))}"):
        index_tars(args["src"], args["out"], progress=False)
    assert list(work.iterdir()) == [] and not (folder.parent / "ix").exists()
    assert contents(folder) == before


def test_index_takes_paths_and_refuses_overwrite_unless_true(tars):
    folder, before = tars
    with pytest.raises(ShardifyError, match="already has index.json; pass --overwrite"):
        index_tars(folder, progress=False, overwrite=False)
    assert contents(folder) == before
    index = index_tars(folder, progress=False, overwrite=True, storage_options={})  # os.PathLike
    assert index.num_samples == 5
