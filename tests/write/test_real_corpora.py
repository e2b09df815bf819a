"""Real audio files as other tools and corpora wrote them (tests/data/real: LibriSpeech, LJSpeech, AMI, Common Voice
MP3, Opus, SPHERE, AIFF, AU, W64): each one shardifies from a folder and from a NeMo manifest, streams with 0 and 2
workers, and comes out as exactly the frames soundfile decodes from the original file."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import TESTS

from streambatch import ShardIndex, StreamBatchLoader
from streambatch.cli import main as shardify
from streambatch.units import resampled_count
from streambatch.write.sources import path_key

AUDIO = TESTS / "data" / "real" / "audio"
FILES = sorted(p for p in AUDIO.iterdir() if p.suffix != ".md")
LOSSY = {".mp3", ".opus", ".ogg"}
TARGET = 16000  # --sample-rate of the manifest dataset


def original(path: Path) -> tuple[np.ndarray, int]:
    """soundfile's decode of the original file, as float32 mono (channels averaged, as the loader does)."""
    wav, sr = sf.read(str(path), dtype="float32", always_2d=True)
    return (wav[:, 0] if wav.shape[1] == 1 else wav.mean(axis=1)), sr


DECODED = {path_key(str(p), str(AUDIO)): (p, *original(p)) for p in FILES}


def write(*args: str) -> None:
    assert shardify(["write", *args, "--no-progress"]) == 0


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    """The corpus written three ways: the folder (lengths in seconds: the files keep their rates), a NeMo manifest
    resampled to 16 kHz, and the 8 kHz files (MP3, Opus, SPHERE, WAV) in samples at their own rate."""
    root = tmp_path_factory.mktemp("real")
    manifest, native = root / "manifest.jsonl", root / "native.jsonl"
    with open(manifest, "w") as m, open(native, "w") as n:
        for key, (path, wav, sr) in DECODED.items():
            row = json.dumps({"audio_filepath": str(path), "duration": len(wav) / sr, "id": key}) + "\n"
            m.write(row)
            if sr == 8000:
                n.write(row)
    write(str(AUDIO), str(root / "folder"), "--unit", "seconds", "--max-count", "6")
    write(str(manifest), str(root / "manifest"), "--sample-rate", str(TARGET), "--max-count", "5")
    write(str(native), str(root / "native"))
    return {name: root / name for name in ("folder", "manifest", "native")}


def index_lengths(ds: Path) -> dict[str, float]:
    """Each sample's length in the index, by the key its tar gives it (tar order = the index's order)."""
    ix = ShardIndex.load(str(ds))
    out: dict[str, float] = {}
    for i, shard in enumerate(ix.shards):
        with tarfile.open(ix.shard_url(i)) as tar:
            keys = [m.name.split(".", 1)[0] for m in tar.getmembers() if m.name.endswith(".json")]
        assert len(keys) == len(shard.lengths)
        out.update(zip(keys, (float(x) for x in shard.lengths)))
    return out


def stream(ds: Path, num_workers: int) -> dict[str, dict]:
    """Every sample the loader emits: its audio (unpadded), length, and .json rates, by key."""
    loader = StreamBatchLoader(str(ds), budget=10**7, num_workers=num_workers, seed=0)
    got: dict[str, dict] = {}
    for batch in loader:
        assert "audio" in batch, f"a batch without audio: {batch['keys']}"
        rates = batch["sample_rate"]
        originals = batch.get("original_sample_rate", [None] * len(rates))
        for i, key in enumerate(batch["keys"]):
            n = int(batch["lengths"][i])
            assert key not in got, f"{key} streamed twice"
            assert not batch["padding_mask"][i, :n].any() and batch["padding_mask"][i, n:].all()
            got[key] = {"audio": batch["audio"][i, :n].numpy(), "rate": rates[i], "original": originals[i]}
    return got


def test_the_corpus_holds_every_format():
    assert {p.suffix for p in FILES} >= {".wav", ".flac", ".mp3", ".opus", ".sph", ".aiff", ".au", ".w64"}
    assert len({sr for _, _, sr in DECODED.values()}) >= 3  # 8, 16, 22.05 and 48 kHz


def test_folder_picks_up_every_file(datasets):
    assert set(index_lengths(datasets["folder"])) == set(DECODED)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_native_rate_streams_exactly_the_decoded_frames(datasets, num_workers):
    """Lengths in seconds (folder) or in samples at the files' one rate: the index's length is the frames that
    decode, the loader emits exactly those, lossless files bit for bit, at the rate the batch reports."""
    for name in ("folder", "native"):
        lengths, got = index_lengths(datasets[name]), stream(datasets[name], num_workers)
        assert set(got) == set(lengths)
        for key, sample in got.items():
            path, wav, sr = DECODED[key]
            frames = round(lengths[key] * sr) if name == "folder" else lengths[key]
            assert frames == len(wav) == len(sample["audio"]), key
            assert sample["rate"] == sr and sample["original"] is None, key
            if path.suffix in LOSSY:
                np.testing.assert_allclose(sample["audio"], wav, atol=1e-6, err_msg=key)
            else:
                assert np.array_equal(sample["audio"], wav), key


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resampled_streams_the_planned_frames_at_the_reported_rate(datasets, num_workers):
    """``--sample-rate 16000`` over 8 to 48 kHz files: each length is the decoded frames at 16 kHz, the loader emits
    exactly that many, and the batch's sample_rate is 16000 (the file's rate kept as original_sample_rate)."""
    lengths, got = index_lengths(datasets["manifest"]), stream(datasets["manifest"], num_workers)
    assert set(got) == set(lengths) == set(DECODED)
    for key, sample in got.items():
        path, wav, sr = DECODED[key]
        assert lengths[key] == resampled_count(len(wav), sr, TARGET) == len(sample["audio"]), key
        assert sample["rate"] == TARGET, key
        assert sample["original"] == (None if sr == TARGET else sr), key
        if sr == TARGET and path.suffix not in LOSSY:
            assert np.array_equal(sample["audio"], wav), key


def test_mp3_length_is_what_decodes_not_what_the_header_claims(datasets):
    path, wav, sr = DECODED["common_voice_en_651325"]
    assert sf.info(str(path)).frames > len(wav)  # the header's estimate: 114,246; 114,048 decode
    assert index_lengths(datasets["folder"])["common_voice_en_651325"] * sr == pytest.approx(len(wav))
    assert shardify(["verify", str(datasets["manifest"]), "--decode", "--no-progress"]) == 0


def test_unreadable_audio_is_a_one_line_input_error(tmp_path, capsys):
    """A file libsndfile cannot read, and audio under an extension the loader does not decode: exit 2, one line
    naming each file, nothing written."""
    bad = tmp_path / "in"
    bad.mkdir()
    (bad / "noise.sph").write_bytes(np.random.default_rng(0).bytes(4000))
    (bad / "LJ002-0020.wav").write_bytes((AUDIO / "LJ002-0020.wav").read_bytes())
    assert shardify(["write", str(bad), str(tmp_path / "out1"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "noise.sph" in line] == [
        f"  {bad / 'noise.sph'}: not readable audio (Format not recognised)"
    ]
    renamed = tmp_path / "LJ002-0020.data"
    renamed.write_bytes((AUDIO / "LJ002-0020.wav").read_bytes())
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"audio_filepath": str(renamed), "duration": 1.54}) + "\n")
    assert shardify(["write", str(manifest), str(tmp_path / "out2"), "--no-progress"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if str(renamed) in line]
    assert len(lines) == 1 and f"{manifest}:1: audio file has extension .data" in lines[0]
    assert not (tmp_path / "out1").exists() or not any((tmp_path / "out1").iterdir())
    assert not (tmp_path / "out2").exists() or not any((tmp_path / "out2").iterdir())


def test_resampling_emits_the_length_the_writer_counts():
    """The loader's resampler gives exactly ``resampled_count`` frames, halves rounded up as the writer rounds
    them (5 frames at 32 kHz are 2.5 at 16 kHz: 3)."""
    from streambatch.read.collate import decode_sample

    for frames, sr in ((5, 32000), (7, 48000), (33949, 22050), (1, 8000)):
        buf = io.BytesIO()
        sf.write(buf, np.linspace(-0.5, 0.5, frames, dtype=np.float32), sr, format="WAV", subtype="FLOAT")
        wav = decode_sample({"__key__": "k", "wav": buf.getvalue()}, "audio", sample_rate=TARGET)
        assert len(wav) == resampled_count(frames, sr, TARGET) == round(frames * TARGET / sr + 1e-9), (frames, sr)


def test_a_corrupt_mp3_is_an_input_error(tmp_path, capsys):
    """An MP3 whose last third is zeros (same size, so its header's estimate is unchanged): decoding stops early,
    which is a file cut short, not a sample that would stream shorter than its header says."""
    data = bytearray((AUDIO / "common_voice_en_651325.mp3").read_bytes())
    cut = len(data) * 2 // 3
    data[cut:] = bytes(len(data) - cut)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "clip.mp3").write_bytes(bytes(data))
    assert shardify(["write", str(tmp_path / "in"), str(tmp_path / "out"), "--no-progress"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "clip.mp3" in line]
    assert len(lines) == 1 and "audio data ends early or is corrupt: decoding stops after" in lines[0]
