"""Lengths that lie (issue 14, item 3): a file cut short or a manifest duration that disagrees with the audio
header is an input error at write time (``--on-error`` applies), and ``shardify verify --decode`` catches an
audio member corrupted after writing, which the header, size and checksum checks cannot see."""

from __future__ import annotations

import hashlib
import json
import struct
import tarfile

import numpy as np
import pytest
import soundfile as sf
from conftest import SR, make_audio, write_jsonl

from streambatch.cli import main
from streambatch.format.index import ShardIndex
from streambatch.write.probe import duration_problem, probe_file
from streambatch.write.sources import Record
from streambatch.write.verify import verify_dataset


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def cut(path, keep: int) -> None:
    """Truncate ``path`` to its first ``keep`` bytes (negative: drop that many from the end)."""
    data = path.read_bytes()
    path.write_bytes(data[:keep])


@pytest.fixture
def lying_manifest(tmp_path):
    """A NeMo manifest: two good files, a 9.6 s WAV cut to 100 bytes, a FLAC cut short, a WAV whose manifest
    duration is twice its header's."""
    d = tmp_path / "src"
    good = {k: make_audio(d / f"{k}.wav", 0.2, seed=i) for i, k in enumerate(["g0", "g1"])}
    make_audio(d / "cut.wav", 9.6)
    cut(d / "cut.wav", 100)
    make_audio(d / "cutf.flac", 3.0, seed=3)
    cut(d / "cutf.flac", -200)
    make_audio(d / "long.wav", 1.0, seed=4)
    rows = [
        {"audio_filepath": "g0.wav", "duration": 0.2},
        {"audio_filepath": "cut.wav", "duration": 9.6},  # line 2
        {"audio_filepath": "cutf.flac", "duration": 3.0},  # line 3
        {"audio_filepath": "long.wav", "duration": 2.0},  # line 4
        {"audio_filepath": "g1.wav", "duration": 0.21},
    ]  # within the tolerance
    return write_jsonl(d / "m.jsonl", rows), d, good


def test_lying_inputs_fail_with_one_line_each_and_nothing_written(capsys, tmp_path, lying_manifest):
    m, d, _ = lying_manifest
    out = tmp_path / "ds"
    code, _, err = run(capsys, "write", m, out, "--no-progress")
    assert code == 2 and "Traceback" not in err and not out.exists()
    lines = {ln.split(": ", 1)[0].strip(): ln for ln in err.splitlines() if f"{m}:" in ln}
    assert sorted(lines) == [f"{m}:2", f"{m}:3", f"{m}:4"]
    assert lines[f"{m}:2"].endswith(f": {d / 'cut.wav'}")
    assert "audio data cut short: the header declares 153600 frames (9.6 s), the file holds 28" in lines[f"{m}:2"]
    assert lines[f"{m}:3"].endswith(f": {d / 'cutf.flac'}") and "audio data ends early" in lines[f"{m}:3"]
    assert lines[f"{m}:4"] == (
        f"  {m}:4: the manifest's duration is 2 s but the audio header says 1 s "
        f"(16000 frames at 16000 Hz): {d / 'long.wav'}"
    )


def test_lying_inputs_skipped_are_listed_in_errors_jsonl(capsys, tmp_path, lying_manifest):
    m, _, good = lying_manifest
    out = tmp_path / "ds"
    code, _, err = run(capsys, "write", m, out, "--on-error", "skip", "--no-progress")
    assert code == 0 and "skipped 3 bad inputs" in err
    errors = [json.loads(ln) for ln in (out / "errors.jsonl").read_text().splitlines()]
    assert [(e["line"], e["key"]) for e in errors] == [(2, "cut"), (3, "cutf"), (4, "long")]
    assert "cut short" in errors[0]["error"] and "ends early" in errors[1]["error"]
    index = ShardIndex.load(str(out))
    assert sorted(index.lengths.tolist()) == sorted(good.values())


@pytest.mark.parametrize("keep", [-1, -100, 0.5], ids=["1-byte", "100-bytes", "half"])
def test_a_flac_cut_anywhere_is_caught_in_a_folder_too(tmp_path, keep):
    d = tmp_path / "src"
    make_audio(d / "a.flac", 2.0)
    data = (d / "a.flac").read_bytes()
    cut(d / "a.flac", int(len(data) * keep) if isinstance(keep, float) else keep)
    assert sf.info(str(d / "a.flac")).frames == 2 * SR  # the header still says 2 s
    assert probe_file(str(d / "a.flac")).startswith("audio data ends early")


def test_a_wav_cut_to_its_header_is_caught(tmp_path):
    make_audio(tmp_path / "a.wav", 1.0)
    cut(tmp_path / "a.wav", 44)
    assert probe_file(str(tmp_path / "a.wav")) == (
        "audio data cut short: the header declares 16000 frames (1 s), the file holds 0 (0 s)"
    )


def test_intact_files_and_a_streamed_wav_pass(tmp_path):
    """No false alarms: whole WAV/FLAC/OGG files, and a WAV whose sizes were unknown when its header was
    written (0xFFFFFFFF, as a streaming encoder leaves them)."""
    for ext in ("wav", "flac", "ogg"):
        frames = make_audio(tmp_path / f"a.{ext}", 0.5)
        assert probe_file(str(tmp_path / f"a.{ext}"))[:2] == (SR, frames)
    data = bytearray((tmp_path / "a.wav").read_bytes())
    assert data[36:40] == b"data"
    data[4:8] = data[40:44] = struct.pack("<I", 0xFFFFFFFF)
    (tmp_path / "s.wav").write_bytes(bytes(data))
    assert probe_file(str(tmp_path / "s.wav"))[:2] == (SR, 8000)


@pytest.mark.parametrize(
    "field,value,ok",
    [
        ("duration", 10.0, True),
        ("duration", 10.09, True),
        ("duration", 9.85, False),  # 0.1 s at 10 s
        ("duration", 30.29, True),
        ("duration", 30.35, False),  # 1 % at 30 s
        ("length", 10.05, True),
        ("length", 12.0, False),  # seconds
        ("length", 160000, True),
        ("length", 170000, False),  # or samples
    ],
)
def test_manifest_duration_tolerance(field, value, ok):
    frames = 10 * SR if value < 20 or value > 1000 else 30 * SR
    rec = Record(key="k", path="/x/k.wav", fields={field: value}, source="m.jsonl", line=1)
    problem = duration_problem(rec, SR, frames)
    assert (problem is None) == ok, problem
    if not ok:
        unit = " s" if field == "duration" else ""
        assert f"the manifest's {field} is {value:g}{unit} but the audio header says {frames / SR:g} s" in problem


def test_a_folder_has_no_manifest_duration_to_check():
    assert duration_problem(Record(key="k", path="/x/k.wav", source="/x/k.wav"), SR, 5) is None


# ---- verify --decode: a member damaged after writing ----------------------------------------------------------
@pytest.fixture
def flac_dataset(tmp_path):
    """A dataset of 6 FLAC samples in 3 shards."""
    d = tmp_path / "src"
    for i in range(6):
        make_audio(d / f"u{i}.flac", 0.5 + 0.1 * i, seed=i)
    out = tmp_path / "ds"
    assert main(["write", str(d), str(out), "--max-count", "2", "--no-progress"]) == 0
    return out


def damage_member(out, shard: int, ext: str = "flac", rehash: bool = True) -> tuple[str, str]:
    """Overwrite 64 bytes in the middle of the shard's first ``ext`` member (sizes unchanged); with ``rehash``,
    patch the index's sha256 to the damaged shard's, as a careless repair or a re-hash would. Returns (shard
    path, member name)."""
    index = ShardIndex.load(str(out))
    path = index.shard_urls()[shard]
    with tarfile.open(path) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("." + ext))
    data = bytearray(open(path, "rb").read())
    mid = member.offset_data + member.size // 2
    data[mid : mid + 64] = np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8).tobytes()
    open(path, "wb").write(bytes(data))
    if rehash:
        index.shards[shard].sha256 = hashlib.sha256(bytes(data)).hexdigest()
        index.save(str(out))
    return path, member.name


def test_verify_decode_catches_a_member_damaged_and_rehashed(capsys, flac_dataset):
    path, name = damage_member(flac_dataset, 1)
    code, stdout, _ = run(capsys, "verify", flac_dataset, "--no-progress")
    assert code == 0, stdout  # headers, sizes, checksums and lengths all match: only decoding can tell
    code, stdout, err = run(capsys, "verify", flac_dataset, "--decode", "--no-progress")
    assert code == 1 and "Traceback" not in err
    bad = [ln.strip() for ln in stdout.splitlines()[1:]]
    assert len(bad) == 1 and bad[0].startswith(f"{path}: {name}: cannot decode audio (")


def test_verify_decode_lists_every_bad_member_beside_a_checksum_mismatch(capsys, flac_dataset):
    p0, n0 = damage_member(flac_dataset, 0, rehash=False)
    p2, n2 = damage_member(flac_dataset, 2)
    problems = verify_dataset(ShardIndex.load(str(flac_dataset)), progress=False, decode=True, workers=2)
    assert [p.split(": ")[:2] for p in problems] == [[p0, problems[0].split(": ")[1]], [p0, n0], [p2, n2]], problems
    assert problems[0].split(": ")[1].startswith("sha256 is ")


def test_verify_decode_passes_a_sound_dataset_and_checks_decoded_lengths(capsys, flac_dataset):
    code, stdout, _ = run(capsys, "verify", flac_dataset, "--decode", "--workers", "2", "--no-progress")
    assert code == 0 and "every audio member decodes" in stdout
    index = ShardIndex.load(str(flac_dataset))  # an index whose lengths lie about the audio
    index.shards[0].lengths[0] += 1
    problems = verify_dataset(index, progress=False, decode=True, workers=1)
    key = index.shard_urls()[0]
    assert any(p.startswith(f"{key}: ") and "decodes to" in p and "the index says" in p for p in problems), problems
