"""`shardify export DS --format nemo-tarred` (issue 27, item 4): NeMo's tarred manifests for our existing tars.

NeMo itself is far too heavy to install for the suite (torch, lightning, hydra, megatron, ...), so the export is read
by :func:`nemo_read`, a small reader written here that follows NeMo's documented format as its own readers apply it
(``TarredAudioToTextDataset`` in ``nemo/collections/asr/data/audio_to_text.py``, ``LazyNeMoTarredIterator`` in
``nemo/collections/common/data/lhotse/nemo_adapters.py``): ``tarred_audio_filepaths`` brace-expanded (``_OP_`` /
``_CL_`` for braces) into the tars in ``shard_id`` order; each line's tar is ``tars[shard_id]``; webdataset's key of a
member ends at its file name's first dot and the sample's audio is its member with an audio extension, looked up by
the manifest's ``audio_filepath`` without extension (the lhotse loader: by the whole member name, and the tar's
shard id taken from an ``audio*_N*.tar`` name); ``offset`` + ``duration`` cut a segment out of its member.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path
from typing import Any

import braceexpand
import numpy as np
import pytest
import soundfile as sf
from conftest import TESTS

from streambatch import ShardIndex
from streambatch.cli import main
from streambatch.format.members import shard_keys

AUDIO = TESTS / "data" / "real" / "audio"
#: 16 kHz recordings (the index counts samples at their own rate: durations are exact)
CLIPS = ["2412-153948-0000.flac", "2412-153948-0001.flac", "libri-1088-134315-0000.wav"]
LIBRI = AUDIO / "libri-1088-134315-0000.wav"
#: NeMo's VALID_FILE_FORMATS: wav, mp3, flac, opus and libsndfile's formats, lower case
NEMO_AUDIO = {"wav", "mp3", "flac", "opus", *(f.lower() for f in sf.available_formats())}


def shardify(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([*argv, "--no-progress"] if argv[0] in ("write", "export", "index") else list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def nemo_tars(spec: str | list[str]) -> list[str]:
    """NeMo's ``expand_sharded_filepaths``: a list as it is; a string with its brace stand-ins made braces, then
    brace-expanded."""
    if isinstance(spec, list):
        return spec
    for a, b in (("_OP_", "{"), ("_CL_", "}"), ("(", "{"), (")", "}"), ("[", "{"), ("]", "}"), ("<", "{"), (">", "}")):
        spec = spec.replace(a, b)
    return list(braceexpand.braceexpand(spec, escape=False))


def wds_key(name: str) -> tuple[str, str]:
    """webdataset's split of a member name: the key ends at the file name's first dot."""
    m = re.fullmatch(r"((?:.*/|)[^.]+)[.]([^/]*)", name)
    assert m is not None, name
    return m.group(1), m.group(2)


def nemo_read(manifest: Path, tars_spec: str | list[str]) -> list[dict[str, Any]]:
    """Each manifest line with the audio NeMo loads for it: the tar its ``shard_id`` names, the member both NeMo
    readers find (webdataset key + audio extension, and the whole name), and the decoded stretch."""
    tars = nemo_tars(tars_spec)
    members: dict[int, dict[str, bytes]] = {}
    out = []
    for line in manifest.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        assert isinstance(entry["shard_id"], int) and 0 <= entry["shard_id"] < len(tars)
        if entry["shard_id"] not in members:
            with tarfile.open(tars[entry["shard_id"]]) as tar:
                members[entry["shard_id"]] = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
        in_tar = members[entry["shard_id"]]
        file_id = os.path.splitext(os.path.basename(entry["audio_filepath"]))[0]
        found = [n for n in in_tar if wds_key(n)[0] == file_id and wds_key(n)[1] in NEMO_AUDIO]
        assert found == [entry["audio_filepath"]], (entry, sorted(in_tar))  # both readers take this member
        with sf.SoundFile(io.BytesIO(in_tar[entry["audio_filepath"]])) as f:  # as NeMo's AudioSegment.from_file
            f.seek(int(entry.get("offset", 0.0) * f.samplerate))
            audio = f.read(int(entry["duration"] * f.samplerate), dtype="float32")
        out.append({**entry, "audio": audio})
    return out


def clip(name: str) -> dict[str, Any]:
    """A NeMo manifest line for a clip of :data:`AUDIO`."""
    return {"audio_filepath": str(AUDIO / name), "duration": sf.info(str(AUDIO / name)).duration}


@pytest.fixture
def dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, dict[str, str]]:
    """A dataset written by `shardify write` from a NeMo manifest of real 16 kHz speech (2 clips a shard): its
    folder and each key's transcript."""
    rows = [{**clip(c), "text": f"the words of {c}", "speaker": i} for i, c in enumerate(CLIPS)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = shardify(capsys, "write", str(tmp_path / "m.jsonl"), str(tmp_path / "ds"), "--max-count", "2")
    assert code == 0, err
    return tmp_path / "ds", {c.rsplit(".", 1)[0]: f"the words of {c}" for c in CLIPS}


def test_round_trip_every_sample_member_duration_and_text_match_the_index(tmp_path, capsys, dataset):
    ds, texts = dataset
    code, out, err = shardify(capsys, "export", str(ds), "--format", "nemo-tarred", "--out", str(tmp_path / "n"))
    assert code == 0, err
    index = ShardIndex.load(str(ds))
    pattern = re.search(r"tarred_audio_filepaths: (\S+)", out).group(1)  # type: ignore[union-attr]
    listed = json.loads((tmp_path / "n" / "tarred_audio_filepaths.json").read_text())
    assert nemo_tars(pattern) == listed == index.shard_urls()
    got = nemo_read(tmp_path / "n" / "tarred_audio_manifest.json", pattern)
    want = [
        (shard, key, float(length) / index.sample_rate)
        for shard in range(index.num_shards)
        for key, length in zip(shard_keys(index, shard), index.shard_lengths([shard])[0])
    ]
    assert [(e["shard_id"], os.path.splitext(e["audio_filepath"])[0], e["duration"]) for e in got] == want
    for e in got:
        key = os.path.splitext(e["audio_filepath"])[0]
        assert e["text"] == texts[key] and "offset" not in e
        np.testing.assert_array_equal(e["audio"], sf.read(str(AUDIO / e["audio_filepath"]), dtype="float32")[0])
    for shard in range(index.num_shards):  # shard_manifests / the lhotse loader: shard N's lines, in order
        part = (tmp_path / "n" / "sharded_manifests" / f"manifest_{shard}.json").read_text().splitlines()
        assert [json.loads(x) for x in part] == [
            {k: v for k, v in e.items() if k != "audio"} for e in got if e["shard_id"] == shard
        ]
    assert "speaker" in got[0] and "length" not in got[0] and "sample_rate" not in got[0]


def test_durations_read_back_as_the_frames_the_index_counts(tmp_path, capsys):
    """NeMo reads ``int(duration × rate)`` frames: at 22.05 kHz ``frames / rate`` and ``frames × (1 / rate)`` read
    one frame short for many counts (88218 / 22050 × 22050 is 88217.99999999999); every exported duration reads
    back its whole clip."""
    rate = 22050
    short = [n for n in range(4000, 12000) if int(n / rate * rate) < n][:3]
    short += [n for n in range(4000, 12000) if int(n * (1 / rate) * rate) < n][:3]
    assert len(set(short)) == 6
    folder = tmp_path / "clips"
    folder.mkdir()
    want = {}
    for i, n in enumerate(short):
        x = (0.1 * np.random.default_rng(i).standard_normal(n)).astype("float32")
        sf.write(str(folder / f"c{i}.wav"), x, rate, subtype="PCM_16")
        (folder / f"c{i}.txt").write_text(f"clip {i}")
        want[f"c{i}"] = sf.read(str(folder / f"c{i}.wav"), dtype="float32")[0]
    assert shardify(capsys, "write", str(folder), str(tmp_path / "ds"), "--max-count", "4")[0] == 0
    code, out, err = shardify(
        capsys, "export", str(tmp_path / "ds"), "--format", "nemo-tarred", "--out", str(tmp_path / "n")
    )
    assert code == 0, err
    pattern = re.search(r"tarred_audio_filepaths: (\S+)", out).group(1)  # type: ignore[union-attr]
    got = nemo_read(tmp_path / "n" / "tarred_audio_manifest.json", pattern)
    assert sorted(os.path.splitext(e["audio_filepath"])[0] for e in got) == sorted(want)
    for e in got:
        np.testing.assert_array_equal(e["audio"], want[os.path.splitext(e["audio_filepath"])[0]])


def test_links_give_the_lhotse_loader_its_shard_ids(tmp_path, capsys, dataset):
    ds, _ = dataset
    code, out, err = shardify(
        capsys, "export", str(ds), "--format", "nemo-tarred", "--out", str(tmp_path / "n"), "--links"
    )
    assert code == 0, err
    tars = nemo_tars(re.search(r"use_lhotse.*\n.*\n  tarred_audio_filepaths: (\S+)", out).group(1))  # type: ignore[union-attr]
    manifests = nemo_tars(re.search(r"use_lhotse.*\n  manifest_filepath: (\S+)", out).group(1))  # type: ignore[union-attr]
    index = ShardIndex.load(str(ds))
    for shard, (tar, manifest) in enumerate(zip(tars, manifests, strict=True)):
        # LazyNeMoTarredIterator's rules: shard ids from the names, manifest N read beside tar N
        assert int(re.search(r"audio[^/]*_(\d+)[^/]*\.tar", tar).group(1)) == shard  # type: ignore[union-attr]
        assert int(re.search(r"manifest[^/]*_(\d+)[^/]*\.json", manifest).group(1)) == shard  # type: ignore[union-attr]
        assert os.path.realpath(tar) == os.path.realpath(index.shard_url(shard))
        names = {json.loads(x)["audio_filepath"] for x in Path(manifest).read_text().splitlines()}
        with tarfile.open(tar) as t:
            assert names == {m.name for m in t if wds_key(m.name)[1] in NEMO_AUDIO}


def test_segments_of_an_adopted_nemo_dataset_come_back_as_offsets(tmp_path, capsys):
    """A NeMo tarred dataset cutting one recording into three segments, indexed in place and exported again: each
    line names the one member, with its offset, and decodes to the segment's stretch."""
    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / "audio_0.tar", "w") as tar:
        tar.add(LIBRI, arcname=LIBRI.name)
    cuts = [(0.0, 4.0, "one"), (4.0, 5.5, "two"), (9.5, 6.5, "three")]
    names = [LIBRI.name, LIBRI.stem + "-sub1.wav", LIBRI.stem + "-sub2.wav"]
    lines = [
        {"audio_filepath": n, "offset": o, "duration": d, "text": t, "shard_id": 0} for n, (o, d, t) in zip(names, cuts)
    ]
    (src / "tarred_audio_manifest.json").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert shardify(capsys, "index", str(src), "--layout", "nemo")[0] == 0
    code, _, err = shardify(capsys, "export", str(src), "--format", "nemo-tarred", "--out", str(tmp_path / "n"))
    assert code == 0, err
    got = nemo_read(tmp_path / "n" / "tarred_audio_manifest.json", [str(src / "audio_0.tar")])
    assert [(e["audio_filepath"], e["offset"], e["duration"], e["text"]) for e in got] == [
        (LIBRI.name, o, d, t) for o, d, t in cuts
    ]
    whole, _ = sf.read(str(LIBRI), dtype="float32")
    for e in got:
        first = round(e["offset"] * 16000)
        np.testing.assert_array_equal(e["audio"], whole[first : first + round(e["duration"] * 16000)])


def test_a_sample_without_text_is_one_line_exit_2_unless_empty_text(tmp_path, capsys):
    rows = [clip(c) for c in CLIPS[:2]]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert shardify(capsys, "write", str(tmp_path / "m.jsonl"), str(tmp_path / "ds"))[0] == 0
    argv = ["export", str(tmp_path / "ds"), "--format", "nemo-tarred", "--out", str(tmp_path / "n")]
    code, out, err = shardify(capsys, *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "'2412-153948-0000' has no text" in err and "--empty-text" in err
    assert not (tmp_path / "n" / "tarred_audio_manifest.json").exists()  # nothing half-written
    assert not [p for p in (tmp_path / "n").rglob("*") if p.is_file()]
    code, _, err = shardify(capsys, *argv, "--empty-text")
    assert code == 0, err
    lines = [json.loads(x) for x in (tmp_path / "n" / "tarred_audio_manifest.json").read_text().splitlines()]
    assert [x["text"] for x in lines] == ["", ""]
    code, _, err = shardify(capsys, *argv, "--empty-text")  # an export is there: refused without --overwrite
    assert code == 2 and "--overwrite" in err and len(err.strip().splitlines()) == 1


def test_bad_inputs_are_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "t.jsonl").write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
    assert shardify(capsys, "write", str(tmp_path / "t.jsonl"), str(tmp_path / "text"))[0] == 0
    (tmp_path / "sph").mkdir()
    shutil.copy(AUDIO / "example3.sph", tmp_path / "sph")  # NIST SPHERE: NeMo's list names it "nist", not "sph"
    assert shardify(capsys, "write", str(tmp_path / "sph"), str(tmp_path / "sph-ds"))[0] == 0
    bad = {"text": "has 0 audio members NeMo reads (members: input_ids.npy, json)", "sph-ds": "(members: json, sph)"}
    bad["none"] = "no dataset index"
    for name, problem in bad.items():
        ds = tmp_path / name
        code, out, err = shardify(capsys, "export", str(ds), "--format", "nemo-tarred", "--out", str(tmp_path / "n"))
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and problem in err, err


def test_a_shard_outside_the_dataset_needs_shard_root(tmp_path, capsys, dataset):
    """The trust rules of every reader: an index naming a tar elsewhere is refused before it is opened."""
    ds, _ = dataset
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (tmp_path / "ds2").mkdir()
    shutil.copy(ds / "shard-000000.tar", moved / "shard-000000.tar")
    shutil.copy(ds / "shard-000001.tar", tmp_path / "ds2" / "shard-000001.tar")
    v1 = ShardIndex.load(str(ds)).to_json()  # version 1: the shard URLs in index.json itself
    v1["shards"][0]["url"] = str(moved / "shard-000000.tar")
    (tmp_path / "ds2" / "index.json").write_text(json.dumps(v1))
    argv = ["export", str(tmp_path / "ds2"), "--format", "nemo-tarred", "--out", str(tmp_path / "n")]
    code, _, err = shardify(capsys, *argv)
    assert code == 2 and "--shard-root" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = shardify(capsys, *argv, "--shard-root", str(moved))
    assert code == 0, err


def test_a_remote_dataset_exports_to_a_remote_folder(tmp_path, capsys, dataset):
    """An fsspec dataset (its index and tars) exported to an fsspec folder: the same lines as a local export, and
    the tars listed by their URLs."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    ds, _ = dataset
    url = "memory://streambatch-export/ds"
    if fs.exists("memory://streambatch-export"):
        fs.rm("memory://streambatch-export", recursive=True)
    for path in ds.rglob("*"):
        if path.is_file():
            fs.pipe(f"{url}/{path.relative_to(ds).as_posix()}", path.read_bytes())
    try:
        dest = "memory://streambatch-export/nemo"
        code, _, err = shardify(capsys, "export", url, "--format", "nemo-tarred", "--out", dest)
        assert code == 0, err
        assert shardify(capsys, "export", str(ds), "--format", "nemo-tarred", "--out", str(tmp_path / "n"))[0] == 0
        local = (tmp_path / "n" / "tarred_audio_manifest.json").read_bytes()
        assert fs.cat(f"{dest}/tarred_audio_manifest.json") == local
        assert json.loads(fs.cat(f"{dest}/tarred_audio_filepaths.json")) == [
            f"{url}/shard-00000{i}.tar" for i in range(2)
        ]
        assert fs.cat(f"{dest}/sharded_manifests/manifest_1.json") in local
    finally:
        fs.rm("memory://streambatch-export", recursive=True)


def test_overwrite_replaces_an_export_whole(tmp_path, capsys, dataset):
    """--overwrite: a second export into DIR leaves only its own files (no links, no manifest of a shard gone)."""
    ds, _ = dataset
    argv = ["export", str(ds), "--format", "nemo-tarred", "--out", str(tmp_path / "n")]
    assert shardify(capsys, *argv, "--links")[0] == 0
    (tmp_path / "n" / "sharded_manifests" / "manifest_7.json").write_text("{}\n")  # as a larger export left it
    code, _, err = shardify(capsys, *argv, "--overwrite")
    assert code == 0, err
    left = sorted(p.relative_to(tmp_path / "n").as_posix() for p in (tmp_path / "n").rglob("*"))
    assert left == [
        "sharded_manifests",
        "sharded_manifests/manifest_0.json",
        "sharded_manifests/manifest_1.json",
        "tarred_audio_filepaths.json",
        "tarred_audio_manifest.json",
    ]


def test_remote_tars_are_read_at_once_and_their_lines_kept_in_shard_order(tmp_path, capsys, dataset, monkeypatch):
    """The first tar of an fsspec dataset answers last (a slow object store): the second is read meanwhile, and
    the manifest still lists shard 0's lines first, byte for byte as a one-at-a-time export does."""
    import threading
    import time

    from streambatch.write import export_lines, export_nemo

    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    ds, _ = dataset
    url = "memory://streambatch-at-once/ds"
    for path in ds.rglob("*"):
        if path.is_file():
            fs.pipe(f"{url}/{path.relative_to(ds).as_posix()}", path.read_bytes())
    real, events, lock = export_lines.storage.open_url, [], threading.Lock()

    @contextlib.contextmanager
    def slow_first(where, *args, **kwargs):
        if where.endswith("shard-000000.tar"):
            time.sleep(0.5)
        with real(where, *args, **kwargs) as f:
            yield f
        with lock:
            events.append(os.path.basename(where))

    monkeypatch.setattr(export_lines.storage, "open_url", slow_first)
    try:
        assert shardify(capsys, "export", url, "--format", "nemo-tarred", "--out", str(tmp_path / "at-once"))[0] == 0
        assert events == ["shard-000001.tar", "shard-000000.tar"], events
        monkeypatch.setattr(export_nemo, "READERS", 1)
        assert shardify(capsys, "export", url, "--format", "nemo-tarred", "--out", str(tmp_path / "one"))[0] == 0
        assert events[2:] == ["shard-000000.tar", "shard-000001.tar"], events
    finally:
        fs.rm("memory://streambatch-at-once", recursive=True)
    for name in ("tarred_audio_manifest.json", "sharded_manifests/manifest_0.json"):
        assert (tmp_path / "at-once" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
    shard_ids = [json.loads(x)["shard_id"] for x in (tmp_path / "one" / "tarred_audio_manifest.json").open()]
    assert shard_ids == sorted(shard_ids) and len(set(shard_ids)) == 2
