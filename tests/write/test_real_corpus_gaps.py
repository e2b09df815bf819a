"""What real corpora hold and the first shardify runs met (issue 44, items 5 and 6): MP3 data in a WAV, GSM 6.10
WAVs cut into segments, tars adopted without a ``.json`` (their batches still say their ``sample_rate``), NeMo
diarization manifests (``"duration": null``: to the end), a ``.txt`` with its newline, a dataset folder named
``*.json``, a Shar folder's transcripts (in its cuts files, not its tars)."""

from __future__ import annotations

import io
import json
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import TESTS

from streambatch import ShardIndex, StreamBatchLoader
from streambatch.cli import main

COMMON_VOICE = TESTS / "data" / "real" / "audio" / "common_voice_en_651325.mp3"


def mp3_in_wav(mp3: bytes, sample_rate: int, channels: int = 1) -> bytes:
    """The MP3 stream wrapped in a RIFF WAVE file as ``WAVE_FORMAT_MPEGLAYER3`` (0x0055), as Windows tools write it:
    its ``fmt`` chunk with the MPEGLAYER3WAVEFORMAT extension, then the MP3 bytes as the ``data`` chunk."""
    fmt = struct.pack("<HHIIHHH", 0x0055, channels, sample_rate, 4000, 1, 0, 12) + struct.pack(
        "<HIHHH", 1, 2, 417, 1, 0
    )
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(mp3)) + mp3
    body += b"\0" * (len(mp3) % 2)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def decoded(data: bytes | Path, first: int = 0, frames: int = -1) -> np.ndarray:
    """Every frame soundfile decodes (mono float32; read forward where it cannot seek): from ``first``, ``frames``
    of them."""
    with sf.SoundFile(io.BytesIO(data) if isinstance(data, bytes) else str(data)) as f:
        if f.seekable():
            wav = f.read(dtype="float32")
        else:
            blocks = []
            while len(block := f.read(4096, dtype="float32")):
                blocks.append(block)
            wav = np.concatenate(blocks)
    return wav[first:] if frames < 0 else wav[first : first + frames]


def stream(ds: Path | str, **kw) -> dict[str, dict]:
    """{key: audio, rate, text} of one epoch, each key once."""
    got: dict[str, dict] = {}
    for batch in StreamBatchLoader(str(ds), budget=10**7, seed=0, **kw):
        for i, key in enumerate(batch["keys"]):
            n = int(batch["lengths"][i])
            assert key not in got
            got[key] = {
                "audio": batch["audio"][i, :n].numpy().copy(),
                "rate": batch.get("sample_rate", [None] * (i + 1))[i],
                "text": batch["text"][i] if "text" in batch else None,
            }
    return got


def write(*args: str) -> int:
    return main(["write", *args, "--no-progress"])


def test_mp3_data_in_a_wav_is_as_long_as_what_decodes(tmp_path):
    """The header of a WAVE_FORMAT_MPEGLAYER3 file estimates its frames (more than decode): the index holds the
    decoded count, written from a folder and adopted in a tar, and the loader's audio is that decode."""
    wav = mp3_in_wav(COMMON_VOICE.read_bytes(), 48000)
    with sf.SoundFile(io.BytesIO(wav)) as f:
        assert (f.format, f.subtype) == ("WAV", "MPEG_LAYER_III")
        header = f.frames
    want = decoded(wav)
    assert header > len(want)  # the real file's estimate is off
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "cv.wav").write_bytes(wav)
    assert write(str(folder), str(tmp_path / "ds")) == 0
    tars = tmp_path / "tars"
    tars.mkdir()
    with tarfile.open(tars / "a.tar", "w") as tar:
        info = tarfile.TarInfo("cv.wav")
        info.size = len(wav)
        tar.addfile(info, io.BytesIO(wav))
    assert main(["index", str(tars), "--no-progress"]) == 0
    for ds in (tmp_path / "ds", tars):
        assert main(["verify", str(ds), "--decode", "--no-progress"]) == 0
        (got,) = stream(ds).values()
        assert np.array_equal(got["audio"], want) and got["rate"] == 48000


def gsm_recording(path: Path, seconds: float = 3.0, sr: int = 8000) -> None:
    t = np.arange(int(seconds * sr)) / sr
    sf.write(str(path), (0.3 * np.sin(2 * np.pi * 440 * t)).astype("float32"), sr, subtype="GSM610")


def test_segments_of_a_gsm_wav_are_read_forward(tmp_path):
    """libsndfile cannot seek in GSM 6.10: each NeMo segment (and a diarization entry's ``"duration": null``: to
    the end) and each Kaldi ``segments`` line is its stretch of the forward decode, under --on-error skip and fail
    alike."""
    rec = tmp_path / "rec.wav"
    gsm_recording(rec)
    assert sf.info(str(rec)).subtype == "GSM610"
    lines = [
        {"audio_filepath": "rec.wav", "offset": 0.5, "duration": 1.0, "text": "one"},
        {"audio_filepath": "rec.wav", "offset": 1.5, "duration": 1.0, "text": "two"},
        {"audio_filepath": "rec.wav", "offset": 2.0, "duration": None, "text": "rest"},
    ]
    manifest = tmp_path / "m.json"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    full = decoded(rec)
    for on_error in ("skip", "fail"):
        out = tmp_path / f"ds-{on_error}"
        assert write(str(manifest), str(out), "--on-error", on_error) == 0
        assert not (out / "errors.jsonl").exists() or not (out / "errors.jsonl").read_text().strip()
        got = stream(out)
        assert {k: v["text"] for k, v in got.items()} == {
            "rec_000000500": "one",
            "rec_000001500": "two",
            "rec_000002000": "rest",
        }
        assert np.array_equal(got["rec_000000500"]["audio"], full[4000:12000])
        assert np.array_equal(got["rec_000001500"]["audio"], full[12000:20000])
        assert np.array_equal(got["rec_000002000"]["audio"], full[16000:])
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    (kaldi / "wav.scp").write_text(f"rec {rec}\n")
    (kaldi / "segments").write_text("u1 rec 0.5 1.5\nu2 rec 1.25 2.75\n")
    assert write(str(kaldi), str(tmp_path / "ds-kaldi"), "--on-error", "skip") == 0
    got = stream(tmp_path / "ds-kaldi")
    assert sorted(got) == ["u1", "u2"]
    assert np.array_equal(got["u1"]["audio"], full[4000:12000])
    assert np.array_equal(got["u2"]["audio"], full[10000:22000])


def test_nemo_diarization_manifest_duration_null_is_the_whole_recording(tmp_path):
    """``"offset": 0, "duration": null`` (NeMo's diarization manifests): the whole file, written and adopted."""
    sr = 16000
    audio = tmp_path / "audio"
    audio.mkdir()
    want = {}
    for i, n in enumerate((12000, 20000)):
        x = (0.1 * np.random.default_rng(i).standard_normal(n)).astype("float32")
        sf.write(str(audio / f"s{i}.wav"), x, sr, subtype="PCM_16")
        want[f"s{i}"] = decoded(audio / f"s{i}.wav")
    entries = [{"audio_filepath": f"s{i}.wav", "offset": 0, "duration": None, "text": f"t {i}"} for i in range(2)]
    manifest = audio / "diar.json"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in entries))
    assert write(str(manifest), str(tmp_path / "ds")) == 0
    got = stream(tmp_path / "ds")
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k]["audio"], want[k]) for k in want)

    tarred = tmp_path / "tarred"
    tarred.mkdir()
    with tarfile.open(tarred / "audio_0.tar", "w") as tar:
        for i in range(2):
            tar.add(str(audio / f"s{i}.wav"), arcname=f"s{i}.wav")
    rows = [{**e, "shard_id": 0} for e in entries]
    (tarred / "tarred_audio_manifest.json").write_text("".join(json.dumps(x) + "\n" for x in rows))
    assert main(["index", str(tarred), "--no-progress"]) == 0
    got = stream(tarred)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k]["audio"], want[k]) for k in want)
    assert {k: v["text"] for k, v in got.items()} == {"s0": "t 0", "s1": "t 1"}


def adopted_tars(root: Path, rates: tuple[int, ...]) -> dict[str, int]:
    """webdataset-style tars (wav + txt, no .json: as WeNet shards are) of clips at ``rates``; {key: rate}."""
    root.mkdir()
    keys = {}
    with tarfile.open(root / "shard-000.tar", "w") as tar:
        for i, sr in enumerate(rates):
            buf = io.BytesIO()
            x = (0.1 * np.random.default_rng(i).standard_normal(sr // 2 + 37 * i)).astype("float32")
            sf.write(buf, x, sr, format="WAV", subtype="PCM_16")
            for ext, data in (("wav", buf.getvalue()), ("txt", f"words of {i}\n".encode())):
                info = tarfile.TarInfo(f"u{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            keys[f"u{i}"] = sr
    return keys


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_of_adopted_tars_say_their_sample_rate(tmp_path, workers):
    """Tars without a .json: every audio batch holds ``sample_rate`` (the native rate; the loader's rate when it
    resamples mixed rates), and a .txt's trailing newline is not part of the text (as from a folder)."""
    one = tmp_path / "one"
    keys = adopted_tars(one, (8000, 8000, 8000))
    assert main(["index", str(one), "--no-progress"]) == 0
    got = stream(one, num_workers=workers)
    assert {k: v["rate"] for k, v in got.items()} == keys
    assert {k: v["text"] for k, v in got.items()} == {f"u{i}": f"words of {i}" for i in range(3)}

    mixed = tmp_path / "mixed"
    keys = adopted_tars(mixed, (8000, 16000, 22050))
    assert main(["index", str(mixed), "--sample-rate", "16000", "--no-progress"]) == 0
    got = stream(mixed, num_workers=workers)
    assert {k: v["rate"] for k, v in got.items()} == dict.fromkeys(keys, 16000)
    assert main(["index", str(mixed), "--unit", "seconds", "--overwrite", "--no-progress"]) == 0
    got = stream(mixed, num_workers=workers)
    assert {k: v["rate"] for k, v in got.items()} == keys


def test_adopted_and_folder_transcripts_agree(tmp_path):
    """The same clips and .txt transcripts (each ending in a newline), from a folder and adopted in a tar."""
    folder = tmp_path / "folder"
    keys = adopted_tars(tmp_path / "tars", (8000, 8000))
    assert main(["index", str(tmp_path / "tars"), "--no-progress"]) == 0
    folder.mkdir()
    with tarfile.open(tmp_path / "tars" / "shard-000.tar") as tar:
        tar.extractall(folder, filter="data")
    assert write(str(folder), str(tmp_path / "ds")) == 0
    from_folder, adopted = stream(tmp_path / "ds"), stream(tmp_path / "tars")
    assert {k: v["text"] for k, v in adopted.items()} == {k: v["text"] for k, v in from_folder.items()}
    assert sorted(adopted) == sorted(keys)


def test_a_dataset_folder_named_json_reads_back(tmp_path):
    src = tmp_path / "clips"
    src.mkdir()
    for i in range(3):
        sf.write(str(src / f"c{i}.wav"), np.zeros(4000 + i, dtype="float32"), 8000, subtype="PCM_16")
    out = tmp_path / "speech.json"
    assert write(str(src), str(out)) == 0 and out.is_dir()
    assert main(["verify", str(out), "--no-progress"]) == 0
    assert main(["inspect", str(out)]) == 0
    assert sorted(stream(out)) == ["c0", "c1", "c2"]


def test_shar_transcripts_come_from_its_cuts(tmp_path, monkeypatch):
    """A Shar folder (lhotse's to_shar of the real AMI/LibriSpeech cuts): the texts of the cuts files' supervisions
    are each sample's ``batch["text"]`` and what ``--output-length chars`` counts."""
    import lhotse  # the test extra installs it

    monkeypatch.chdir(TESTS / "data" / "real" / "manifests" / "lhotse")
    cuts = lhotse.CutSet.from_file("cuts.jsonl.gz")
    want = {c.id: " ".join(s.text for s in c.supervisions) for c in cuts}
    assert all(want.values())
    shar = tmp_path / "shar"
    shar.mkdir()
    cuts.to_shar(str(shar), fields={"recording": "flac"}, shard_size=2)
    out = tmp_path / "index"
    assert main(["index", str(shar), "--out", str(out), "--output-length", "chars", "--no-progress"]) == 0
    got = stream(out, shard_roots=[str(shar)])
    assert {k: v["text"] for k, v in got.items()} == want
    ix = ShardIndex.load(str(out))
    counted = {}
    for s in range(ix.num_shards):
        stored = ix.shards.reader.shard_samples(s)
        counted.update(zip(stored["keys"], stored["output_lengths"].tolist()))
    assert counted == {k: len(t) for k, t in want.items()}
