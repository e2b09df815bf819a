"""writer.py: every source kind → shards a plain webdataset reader reads back with the original bytes and
header-exact lengths; bad input → nothing written (fail) or the rest + errors.jsonl (skip); deterministic,
atomic, size/count-limited shards."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
import soundfile as sf
import webdataset as wds
from conftest import SR, make_audio, write_jsonl

from streambatch.errors import InputErrors, ShardifyError
from streambatch.format.index import ShardIndex
from streambatch.write import probe, tarwrite, writer
from streambatch.write.tarwrite import plan_shards
from streambatch.write.verify import verify_dataset
from streambatch.write.writer import parse_size, write_shards

INDEX_FILES = ["index.json", "index.samples", "index.shards.parquet"]  # index version 2: header + tables


def read_back(out) -> list[dict]:
    """Samples as a plain webdataset reader sees them, in shard and tar order."""
    index = ShardIndex.load(str(out))
    return list(wds.WebDataset(index.shard_urls(), shardshuffle=False, empty_check=False))


def meta(sample: dict) -> dict:
    return json.loads(sample["json"])


def check_dataset(out, expected: dict[str, dict]) -> list[dict]:
    """verify passes, keys are as expected, json lengths = header frames = index lengths, bytes preserved."""
    index = ShardIndex.load(str(out))
    assert verify_dataset(index, progress=False) == []
    samples = read_back(out)
    assert sorted(s["__key__"] for s in samples) == sorted(expected)
    assert [meta(s)["length"] for s in samples] == index.lengths.tolist()
    for s in samples:
        e = expected[s["__key__"]]
        if "path" in e:
            ext = e["path"].suffix.lstrip(".").lower()
            assert s[ext] == e["path"].read_bytes()  # the original bytes, not re-encoded
            assert meta(s)["length"] == sf.info(str(e["path"])).frames == e["frames"]
            assert meta(s)["sample_rate"] == SR
        if e.get("text") is not None:
            assert meta(s)["text"] == e["text"]
    return samples


def test_audio_folder_round_trip(tmp_path, audio_folder):
    folder, expected = audio_folder
    out = tmp_path / "out"
    index = write_shards(str(folder), str(out), max_count=2, progress=False)
    assert index.unit == "samples" and index.sample_rate == SR
    assert [s.count for s in index.shards] == [2, 2, 1]
    assert sorted(os.listdir(out)) == [*INDEX_FILES, "shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    samples = check_dataset(out, expected)
    by_key = {s["__key__"]: s for s in samples}
    assert "txt" not in by_key["spk1__utt-a"] and meta(by_key["spk1__utt-b"]).get("text") is None
    assert meta(by_key["spk1__utt-a"])["duration"] == pytest.approx(0.1)
    assert index.meta["kind"] == "folder" and index.meta["source"] == str(folder)
    assert set(index.meta) >= {"created", "streambatch_version", "shuffle", "seed"}


def tar_sample_ranges(path) -> tuple[list[str], list[int], list[int]]:
    """(keys, byte offset of each sample's first member header, bytes its members span) as Python's tarfile
    finds them in a shard: what a reader seeking to one sample needs."""
    keys, starts, ends = [], [], []
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            key = m.name.split(".", 1)[0]
            if not keys or keys[-1] != key:
                keys.append(key)
                starts.append(m.offset)
                ends.append(0)
            ends[-1] = m.offset_data + -(-m.size // 512) * 512
    return keys, starts, [e - s for s, e in zip(starts, ends)]


def test_the_index_records_each_samples_key_and_byte_range(tmp_path, audio_folder):
    folder, _ = audio_folder
    write_shards(str(folder), str(tmp_path / "v2"), max_count=2, progress=False)
    index = ShardIndex.load(str(tmp_path / "v2"))
    assert index.version == 2
    for i, url in enumerate(index.shard_urls()):
        keys, starts, sizes = tar_sample_ranges(url)
        offsets, spans = index.sample_offsets(i)
        assert (offsets.tolist(), spans.tolist()) == (starts, sizes)
        assert index.shards.reader.shard_samples(i)["keys"] == keys
        with open(url, "rb") as f:  # the range holds exactly that sample's members
            f.seek(offsets[-1])
            members = tarfile.open(fileobj=io.BytesIO(f.read(spans[-1]) + bytes(1024))).getnames()
        assert {m.split(".", 1)[0] for m in members} == {keys[-1]}
    v1 = write_shards(str(folder), str(tmp_path / "v1"), max_count=2, progress=False, index_version=1)
    assert ShardIndex.load(str(tmp_path / "v1")).version == 1 and os.listdir(tmp_path / "v1").count("index.json")
    assert np.array_equal(v1.lengths, index.lengths) and [s.sha256 for s in v1.shards] == [
        s.sha256 for s in index.shards
    ]


def test_tar_members_are_deterministic_and_json_first(tmp_path, audio_folder):
    folder, _ = audio_folder
    out = tmp_path / "out"
    write_shards(str(folder), str(out), progress=False)
    with tarfile.open(out / "shard-000000.tar") as tar:
        members = tar.getmembers()
    assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.uname == "" and m.gname == "" for m in members)
    names = [m.name for m in members]
    assert names[0].endswith(".json") and names[1] == names[0][:-5] + ".wav"


def test_nemo_manifest_round_trip_keeps_fields(tmp_path, nemo_manifest):
    manifest, expected = nemo_manifest
    out = tmp_path / "out"
    index = write_shards(str(manifest), str(out), progress=False)
    assert index.meta["kind"] == "manifest"
    for s in check_dataset(out, expected):
        m = meta(s)
        assert m["lang"] == "en" and "audio_filepath" not in m
        assert m["duration"] == pytest.approx(m["length"] / SR)


def test_speechbrain_json_and_csv_round_trip(tmp_path):
    data = tmp_path / "LibriSpeech"
    expected = {}
    for i, ext in enumerate(["flac", "wav", "flac"]):
        rel = f"train/1089/1089-134686-000{i}.{ext}"
        expected[f"1089-134686-000{i}"] = {
            "path": data / rel,
            "frames": make_audio(data / rel, 0.1 + 0.1 * i, seed=i),
            "rel": rel,
        }
    sb_json = tmp_path / "train.json"
    sb_json.write_text(
        json.dumps(
            {
                k: {"wav": "{data_root}/" + e["rel"], "length": e["frames"] / SR, "spk_id": "1089", "wrd": "HI"}
                for k, e in expected.items()
            },
            indent=2,
        )
    )
    sb_csv = tmp_path / "train.csv"
    sb_csv.write_text(
        "ID,duration,wav,spk_id,wrd\n"
        + "".join(f"{k},{e['frames'] / SR},$data_root/{e['rel']},1089,HI\n" for k, e in expected.items())
    )
    for src in (sb_json, sb_csv):
        out = tmp_path / f"out-{src.suffix[1:]}"
        index = write_shards(str(src), str(out), data_root=str(data), progress=False)
        assert index.meta["kind"] == "speechbrain"
        for s in check_dataset(out, expected):
            m = meta(s)
            assert m["wrd"] == "HI" and m["spk_id"] == "1089" and "wav" not in m
            assert m["duration"] == pytest.approx(m["length"] / SR)


def test_text_jsonl_round_trip(tmp_path):
    rows = [
        {"text": "the cat sat", "id": "a"},
        {"input_ids": [101, 7, 8, 9, 102], "id": "b"},
        {"text": "x y", "input_ids": [1, 2, 3], "length": 42, "id": "c", "source": "web"},
    ]
    src = write_jsonl(tmp_path / "text.jsonl", rows)
    out = tmp_path / "out"
    index = write_shards(str(src), str(out), progress=False)
    assert index.unit == "tokens" and index.sample_rate is None
    assert index.lengths.tolist() == [3, 5, 42]
    assert verify_dataset(index, progress=False) == []
    samples = read_back(out)
    assert [s["__key__"] for s in samples] == ["a", "b", "c"]
    assert samples[0]["txt"].decode() == "the cat sat" and "input_ids.npy" not in samples[0]
    assert np.load(io.BytesIO(samples[1]["input_ids.npy"])).tolist() == [101, 7, 8, 9, 102]
    assert np.load(io.BytesIO(samples[1]["input_ids.npy"])).dtype == np.int32
    assert meta(samples[2]) == {"length": 42, "id": "c", "source": "web"}
    assert samples[2]["txt"].decode() == "x y"


def test_seconds_unit(tmp_path, audio_folder):
    folder, expected = audio_folder
    index = write_shards(str(folder), str(tmp_path / "out"), unit="seconds", progress=False)
    assert index.unit == "seconds" and index.sample_rate == SR
    lengths = {s["__key__"]: meta(s)["length"] for s in read_back(tmp_path / "out")}
    assert lengths == {k: e["frames"] / SR for k, e in expected.items()}


def test_mixed_sample_rates_error_then_ok_with_sample_rate(tmp_path):
    d = tmp_path / "mixed"
    f16 = make_audio(d / "a.wav", 0.2, sr=16000)
    f8 = make_audio(d / "b.flac", 0.2, sr=8000)
    out = tmp_path / "out"
    with pytest.raises(ShardifyError) as ei:
        write_shards(str(d), str(out), progress=False)
    msg = str(ei.value)
    assert "a.wav" in msg and "b.flac" in msg and "16000" in msg and "8000" in msg and "--sample-rate" in msg
    assert not out.exists()
    index = write_shards(str(d), str(out), sample_rate=8000, progress=False)
    assert index.sample_rate == 8000
    assert index.lengths.tolist() == [round(f16 * 8000 / 16000), f8]
    # the rate the loader emits the audio at, and the file's own where it differs
    assert [meta(s)["sample_rate"] for s in read_back(out)] == [8000, 8000]
    assert [meta(s).get("original_sample_rate") for s in read_back(out)] == [16000, None]


@pytest.fixture
def broken_manifest(tmp_path):
    """A manifest with good lines and one of each kind of bad input."""
    d = tmp_path / "broken"
    good = {f"ok{i}": make_audio(d / f"ok{i}.wav", 0.1, seed=i) for i in range(3)}
    (d / "garbage.wav").write_bytes(b"this is not audio at all" * 10)
    (d / "empty.flac").write_bytes(b"")
    rows = [
        {"audio_filepath": "ok0.wav", "duration": 0.1},  # 1
        {"audio_filepath": "missing.wav", "duration": 0.1},  # 2 missing file
        {"audio_filepath": "garbage.wav", "duration": 0.1},  # 3 unreadable
        {"audio_filepath": "ok1.wav"},  # 4 no length field
        {"audio_filepath": "empty.flac", "duration": 0.0},  # 6 empty file
        {"audio_filepath": "ok2.wav", "duration": 0.1},  # 7
        {"audio_filepath": "ok0.wav", "duration": 0.1},  # 8 duplicate key
    ]
    m = write_jsonl(d / "m.jsonl", rows, raw_lines={4: '{"audio_filepath": "ok1.wav", '})  # 5 not JSON
    return m, good


def test_bad_input_fail_mode_writes_nothing(tmp_path, broken_manifest):
    m, _ = broken_manifest
    out = tmp_path / "out"
    with pytest.raises(InputErrors) as ei:
        write_shards(str(m), str(out), progress=False)
    lines = sorted(p.line for p in ei.value.problems)
    assert lines == [2, 3, 4, 5, 6, 8]
    text = str(ei.value)
    for line, what in [
        (2, "not found"),
        (3, "not readable audio"),
        (4, "missing length field"),
        (5, "not valid JSON"),
        (6, "empty audio file"),
        (8, "duplicate key 'ok0'"),
    ]:
        assert f"{m}:{line}: " in text and what in text
    assert "also at " + f"{m}:1" in text
    assert not out.exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_input_skip_mode_writes_the_rest_and_errors_jsonl(tmp_path, broken_manifest, workers):
    m, good = broken_manifest
    out = tmp_path / "out"
    index = write_shards(str(m), str(out), on_error="skip", workers=workers, progress=False)
    assert index.meta["skipped"] == 6
    assert [s["__key__"] for s in read_back(out)] == ["ok0", "ok2"]
    assert index.lengths.tolist() == [good["ok0"], good["ok2"]]
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [e["line"] for e in errors] == [2, 3, 4, 5, 6, 8]
    assert all(e["source"] == str(m) and e["error"] for e in errors)
    assert errors[-1]["key"] == "ok0"
    assert verify_dataset(index, progress=False) == []


def test_folder_with_zero_frame_and_garbage_audio(tmp_path):
    d = tmp_path / "src"
    make_audio(d / "good.flac", 0.1)
    sf.write(str(d / "silent.wav"), np.zeros(0, dtype="float32"), SR)  # a valid header, 0 frames
    (d / "junk.ogg").write_bytes(b"OggS" + b"x" * 100)
    with pytest.raises(InputErrors) as ei:
        write_shards(str(d), str(tmp_path / "out"), progress=False)
    assert [str(p) for p in ei.value.problems] == [
        f"{d / 'junk.ogg'}: not readable audio (File contains data in an unimplemented format)",
        f"{d / 'silent.wav'}: audio file has no frames",
    ]
    index = write_shards(str(d), str(tmp_path / "out"), on_error="skip", progress=False)
    assert index.num_samples == 1 and index.meta["skipped"] == 2


def test_all_bad_is_an_error_even_when_skipping(tmp_path):
    m = write_jsonl(tmp_path / "m.jsonl", [{"audio_filepath": "nope.wav", "duration": 1}])
    with pytest.raises(InputErrors, match="no valid samples"):
        write_shards(str(m), str(tmp_path / "out"), on_error="skip", progress=False)
    assert not (tmp_path / "out" / "index.json").exists()


def test_max_count_and_max_size(tmp_path):
    d = tmp_path / "a"
    for i in range(10):
        make_audio(d / f"u{i:02d}.wav", 0.1 + 0.02 * i, seed=i)  # 3.2–6.1 kB each
    idx = write_shards(str(d), str(tmp_path / "c"), max_count=4, progress=False)
    assert [s.count for s in idx.shards] == [4, 4, 2]
    limit = 20 * 1024
    idx = write_shards(str(d), str(tmp_path / "s"), max_size=limit, progress=False)
    assert idx.num_samples == 10 and idx.num_shards > 2
    for s in idx.shards:
        assert os.path.getsize(tmp_path / "s" / s.url) == s.bytes <= limit
    # a sample bigger than the limit gets a shard of its own
    idx = write_shards(str(d), str(tmp_path / "tiny"), max_size=1, progress=False)
    assert [s.count for s in idx.shards] == [1] * 10
    assert ShardIndex.load(str(tmp_path / "tiny")).num_samples == 10


def test_plan_shards_and_parse_size():
    assert plan_shards([1000] * 5, max_count=2, max_size=1 << 30) == [(0, 2), (2, 4), (4, 5)]
    assert plan_shards([], 2, 100) == []
    assert parse_size("500M") == 500 << 20 and parse_size("2G") == 2 << 30 and parse_size(1234) == 1234
    assert parse_size("1.5GiB") == int(1.5 * (1 << 30)) and parse_size("10k") == 10240
    assert parse_size("0.1G") == round(0.1 * (1 << 30))  # a fraction of a unit: the nearest byte
    for bad in ("lots", "-1", "0", "1.5", "0.5", "9" * 400, 2**63):  # half a byte was 0 or 1; a size beyond 8 EiB
        with pytest.raises(ShardifyError):
            parse_size(bad)


def test_shuffle_is_seeded_and_identical_for_any_workers(tmp_path):
    d = tmp_path / "a"
    for i in range(12):
        make_audio(d / f"u{i:02d}.{['wav', 'flac', 'ogg'][i % 3]}", 0.1, seed=i)
    kw = dict(max_count=5, shuffle=True, seed=7, progress=False)
    i1 = write_shards(str(d), str(tmp_path / "w1"), workers=1, **kw)
    i2 = write_shards(str(d), str(tmp_path / "w2"), workers=2, **kw)
    assert i1.num_shards == 3
    for s1, s2 in zip(i1.shards, i2.shards):
        assert (tmp_path / "w1" / s1.url).read_bytes() == (tmp_path / "w2" / s2.url).read_bytes()
        assert s1.sha256 == s2.sha256
    keys = [s["__key__"] for s in read_back(tmp_path / "w1")]
    assert keys != sorted(keys) and sorted(keys) == [f"u{i:02d}" for i in range(12)]
    expected = [f"u{i:02d}" for i in np.random.default_rng(7).permutation(12)]
    assert keys == expected
    other = write_shards(str(d), str(tmp_path / "w3"), max_count=5, shuffle=True, seed=8, progress=False)
    assert [s["__key__"] for s in read_back(tmp_path / "w3")] != keys and other.meta["seed"] == 8


def test_refuses_non_empty_out_and_overwrite_removes_only_ours(tmp_path, audio_folder):
    folder, _ = audio_folder
    out = tmp_path / "out"
    write_shards(str(folder), str(out), max_count=1, progress=False)
    assert len(list(out.glob("shard-*.tar"))) == 5
    (out / "README.txt").write_text("mine")
    with pytest.raises(ShardifyError, match="not empty.*--overwrite"):
        write_shards(str(folder), str(out), progress=False)
    index = write_shards(str(folder), str(out), overwrite=True, progress=False)
    assert index.num_shards == 1
    assert sorted(os.listdir(out)) == ["README.txt", *INDEX_FILES, "shard-000000.tar"]
    assert verify_dataset(ShardIndex.load(str(out)), progress=False) == []


def test_failing_overwrite_keeps_the_old_dataset(tmp_path, audio_folder, broken_manifest):
    folder, _ = audio_folder
    m, _ = broken_manifest
    out = tmp_path / "out"
    write_shards(str(folder), str(out), progress=False)
    before = sorted(os.listdir(out))
    with pytest.raises(InputErrors):
        write_shards(str(m), str(out), overwrite=True, progress=False)
    assert sorted(os.listdir(out)) == before


def test_interrupted_write_leaves_no_index(tmp_path, audio_folder, monkeypatch):
    folder, _ = audio_folder
    out = tmp_path / "out"
    real = writer.write_shard
    calls = []

    def crash_after_first(task):
        calls.append(task.name)
        if len(calls) > 1:
            raise OSError("disk full")
        return real(task)

    monkeypatch.setattr(writer, "write_shard", crash_after_first)
    with pytest.raises(OSError, match="disk full"):
        write_shards(str(folder), str(out), max_count=2, progress=False)
    assert sorted(os.listdir(out)) == ["shard-000000.tar"]  # no index.json, no temporary files


def test_crash_inside_a_shard_leaves_no_partial_shard(tmp_path, audio_folder, monkeypatch):
    folder, _ = audio_folder
    out = tmp_path / "out"

    def broken_tar(f, samples, storage_options):
        f.write(b"\0" * 1000)
        raise OSError("read error")

    monkeypatch.setattr(tarwrite, "_write_tar", broken_tar)
    with pytest.raises(OSError):
        write_shards(str(folder), str(out), progress=False)
    assert not out.exists() or os.listdir(out) == []  # no partial shard (the folder goes too when left empty)


def test_write_to_fsspec_url(tmp_path, audio_folder):
    fsspec = pytest.importorskip("fsspec")
    folder, expected = audio_folder
    url = "memory://streambatch-test/ds"
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)
    index = write_shards(str(folder), url, max_count=3, progress=False)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(url, detail=False)) == [
        *INDEX_FILES,
        "shard-000000.tar",
        "shard-000001.tar",
    ]
    loaded = ShardIndex.load(url)
    assert loaded.lengths.tolist() == index.lengths.tolist()
    assert verify_dataset(loaded, progress=False) == []
    with pytest.raises(ShardifyError, match="not empty"):
        write_shards(str(folder), url, progress=False)
    fs.rm(url, recursive=True)


def test_planned_sizes_match_the_tar_for_long_and_unicode_names(tmp_path):
    """Shard limits are decided from planned sizes: they must equal the bytes written (pax headers too)."""
    d = tmp_path / "src"
    make_audio(d / ("x" * 150 + ".wav"), 0.1)
    make_audio(d / "grüße" / "straße.flac", 0.1)
    make_audio(d / "日本語.ogg", 0.1)
    m = write_jsonl(tmp_path / "t.jsonl", [{"text": "ünïcödé " * 50, "input_ids": list(range(300))}])
    for src in (d, m):
        out = tmp_path / f"out-{src.name}"
        index = write_shards(str(src), str(out), progress=False)
        samples = probe.measure(*_records(src), progress=False)[0]
        planned = tarwrite.shard_tar_bytes(sum(s.tar_bytes for s in samples))
        assert index.shards[0].bytes == os.path.getsize(out / index.shards[0].url) == planned
        assert verify_dataset(index, progress=False) == []
    keys = sorted(s["__key__"] for s in read_back(tmp_path / "out-src"))
    assert keys == sorted(["x" * 150, "grüße__straße", "日本語"])


def _records(src):
    from streambatch.write.sources import detect_kind, read_source

    kind = detect_kind(str(src))
    records, _ = read_source(str(src), kind)
    return records, kind, "tokens" if kind == "text" else "samples"
