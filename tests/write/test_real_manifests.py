"""Manifests as other tools wrote them (issue 23, items 4-7), on the real files under tests/data/real/manifests: a
NeMo manifest of offset segments, SpeechBrain's own ASR_train.json and ASR_train.csv, a lhotse cuts manifest and
recordings + supervisions, a Kaldi data folder with segments. Each shardifies and streams (0 and 2 workers), each
sample once, its length the segment's frames and its audio bit-equal to soundfile's decode of that slice."""

from __future__ import annotations

import collections
import gzip
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import TESTS

from streambatch import StreamBatchLoader
from streambatch.cli import main
from streambatch.write.writer import write_shards

REAL = TESTS / "data" / "real" / "manifests"
LHOTSE = REAL / "lhotse"
SPEECHBRAIN = REAL / "speechbrain"
LIBRI = LHOTSE / "test/fixtures/libri/libri-1088-134315-0000.wav"
AMI = LHOTSE / "test/fixtures/ami/ES2011a.Headset-0-40s-46s.wav"


def decoded(path: Path, first: int = 0, frames: int | None = None) -> np.ndarray:
    """What soundfile decodes from ``path`` for ``[first, first + frames)`` (mono float32, as the loader gives)."""
    with sf.SoundFile(str(path)) as f:
        f.seek(first)
        return f.read(-1 if frames is None else frames, dtype="float32")


def stream_all(out: Path, workers: int) -> dict[str, tuple[np.ndarray, str | None]]:
    """{key: (audio, text)} of one epoch; every key exactly once and every batch's lengths its audio's."""
    loader = StreamBatchLoader(str(out), budget=16000 * 40, seed=1, buffer_size=16, num_workers=workers)
    seen: collections.Counter = collections.Counter()
    got = {}
    for batch in loader:
        seen.update(batch["keys"])
        assert batch["sample_rate"] == [16000] * len(batch["keys"])
        for i, key in enumerate(batch["keys"]):
            n = int(batch["lengths"][i])
            got[key] = (batch["audio"][i, :n].numpy().copy(), (batch.get("text") or [None] * (i + 1))[i])
    assert all(c == 1 for c in seen.values()), seen
    return got


def check_streams(out: Path, want: dict[str, tuple[np.ndarray, str | None]]) -> None:
    """Streamed with 0 and 2 workers, the dataset holds exactly ``want``: keys, audio bit for bit, texts."""
    for workers in (0, 2):
        got = stream_all(out, workers)
        assert sorted(got) == sorted(want)
        for key, (audio, text) in want.items():
            assert got[key][0].shape == audio.shape, key
            assert np.array_equal(got[key][0], audio), key
            if text is not None:
                assert got[key][1] == text, key


def test_nemo_offset_segments_of_one_long_file(tmp_path):
    manifest = REAL / "nemo" / "long_segments.json"
    entries = [json.loads(line) for line in manifest.read_text().splitlines()]
    out = tmp_path / "ds"
    index = write_shards(str(manifest), str(out), progress=False)
    assert index.num_samples == len(entries)
    want = {}
    for e in entries:
        key = f"libri-1088-134315-0000_{round(e['offset'] * 1000):09d}"
        key = key + "-sub1" if key in want else key
        frames = min(round(e["duration"] * 16000), sf.info(str(LIBRI)).frames - round(e["offset"] * 16000))
        want[key] = (decoded(LIBRI, round(e["offset"] * 16000), frames), e["text"])
    check_streams(out, want)


def test_speechbrain_json_with_data_root(tmp_path, monkeypatch):
    """SpeechBrain's own ASR_train.json: numbers stored as strings, {data_root} filled from a relative --data-root
    (resolved from the working directory)."""
    monkeypatch.chdir(SPEECHBRAIN)
    out = tmp_path / "ds"
    assert main(["write", "tests/samples/annotation/ASR_train.json", str(out), "--data-root", "tests/samples/ASR"]) == 0
    spec = json.loads((SPEECHBRAIN / "tests/samples/annotation/ASR_train.json").read_text())
    want = {k: (decoded(SPEECHBRAIN / "tests/samples/ASR" / f"{k}.wav"), None) for k in spec}
    check_streams(out, want)


def test_speechbrain_csv_from_the_folder_its_paths_are_relative_to(tmp_path, monkeypatch):
    monkeypatch.chdir(SPEECHBRAIN)
    out = tmp_path / "ds"
    assert main(["write", "tests/samples/annotation/ASR_train.csv", str(out)]) == 0
    want = {k: (decoded(SPEECHBRAIN / "tests/samples/ASR" / f"{k}.wav"), None) for k in ("spk1_snt1", "spk1_snt2")}
    check_streams(out, want)


def test_speechbrain_start_stop_segments(tmp_path, monkeypatch):
    """``{"file", "start", "stop"}``: frames start to stop (stop past the end: what is there, as SpeechBrain reads)."""
    monkeypatch.chdir(SPEECHBRAIN)
    wav = "tests/samples/ASR/spk1_snt1.wav"
    total = sf.info(wav).frames
    spec = {
        "a": {"wav": {"file": wav, "start": 8000, "stop": 24000}, "duration": "1.0"},
        "b": {"wav": {"file": wav, "start": "24000"}, "duration": 0},
        "c": {"wav": {"file": wav, "start": total - 100, "stop": total + 500}, "duration": "0.04"},
    }
    manifest = tmp_path / "seg.json"
    manifest.write_text(json.dumps(spec, indent=1))
    out = tmp_path / "ds"
    write_shards(str(manifest), str(out), progress=False)
    want = {
        "a": (decoded(Path(wav), 8000, 16000), None),
        "b": (decoded(Path(wav), 24000), None),
        "c": (decoded(Path(wav), total - 100, 100), None),
    }
    check_streams(out, want)


def _lhotse_lines(name: str) -> list[dict]:
    with gzip.open(LHOTSE / name, "rt") as f:
        return [json.loads(line) for line in f]


def test_lhotse_cuts_manifest(tmp_path, monkeypatch):
    monkeypatch.chdir(LHOTSE)
    out = tmp_path / "ds"
    assert main(["write", "cuts.jsonl.gz", str(out)]) == 0
    want = {}
    for cut in _lhotse_lines("cuts.jsonl.gz"):
        path = LHOTSE / cut["recording"]["sources"][0]["source"]
        key = cut["id"].replace(".", "_")
        text = " ".join(s["text"] for s in cut["supervisions"])
        want[key] = (decoded(path, round(cut["start"] * 16000), round(cut["duration"] * 16000)), text)
    check_streams(out, want)


def test_lhotse_recordings_and_supervisions(tmp_path):
    out = tmp_path / "ds"
    assert (
        main(["write", str(LHOTSE / "supervisions.jsonl.gz"), str(out), "--kind", "lhotse", "--data-root", str(LHOTSE)])
        == 0
    )
    want = {
        s["id"].replace(".", "_"): (decoded(AMI, round(s["start"] * 16000), round(s["duration"] * 16000)), s["text"])
        for s in _lhotse_lines("supervisions.jsonl.gz")
    }
    check_streams(out, want)


def test_kaldi_folder_with_segments(tmp_path, monkeypatch):
    monkeypatch.chdir(LHOTSE)
    out = tmp_path / "ds"
    assert main(["write", "kaldi", str(out)]) == 0
    texts = dict(line.split(" ", 1) for line in (LHOTSE / "kaldi/text").read_text().splitlines())
    want = {}
    for line in (LHOTSE / "kaldi/segments").read_text().splitlines():
        utt, _, start, end = line.split()
        a, b = round(float(start) * 16000), round(float(end) * 16000)
        want[utt.replace(".", "_")] = (decoded(AMI, a, b - a), texts[utt])
    check_streams(out, want)
    speakers = dict(line.split() for line in (LHOTSE / "kaldi/utt2spk").read_text().splitlines())
    loader = StreamBatchLoader(str(out), budget=16000 * 40, seed=1)
    got = {k: s for b in loader for k, s in zip(b["keys"], b["speaker"])}
    assert got == {u.replace(".", "_"): s for u, s in speakers.items()}


@pytest.mark.parametrize(
    "files, where",
    [
        ({"wav.scp": "r1 sox -r 16000 -n -t wav - synth 1 sine 300 |\n"}, "wav.scp:1:"),
        ({"wav.scp": "r1 a.wav\n", "segments": "u1 r1 0.5\n"}, "segments:1:"),
        ({"wav.scp": "r1 a.wav\n", "segments": "u1 r2 0 1\n"}, "segments:1:"),
    ],
)
def test_unsupported_kaldi_input_is_an_input_error_naming_file_and_line(tmp_path, capsys, files, where):
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(AMI, tmp_path / "a.wav")
    for name, text in files.items():
        (folder / name).write_text(text)
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = main(["write", str(folder), str(tmp_path / "out")])
    finally:
        os.chdir(here)
    err = capsys.readouterr().err
    assert code == 2 and f"{folder}/{where}" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_unsupported_lhotse_source_is_an_input_error_naming_file_and_line(tmp_path, capsys):
    cuts = _lhotse_lines("cuts.jsonl.gz")
    cuts[1]["recording"]["sources"][0] = {"type": "command", "channels": [0], "source": "sox x.wav -t wav - |"}
    path = tmp_path / "cuts.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(c) + "\n" for c in cuts)
    code = main(["write", str(path), str(tmp_path / "out"), "--data-root", str(LHOTSE)])
    err = capsys.readouterr().err
    assert code == 2 and f"{path}:2:" in err and "'command'" in err and "Traceback" not in err


def test_shar_folder_is_not_indexed_in_place_and_lhotse_still_reads_it(tmp_path, capsys, monkeypatch):
    """lhotse reads every file of a Shar folder as a field: `shardify index` in place is refused (one line naming
    --out, nothing written), and lhotse's own reader still reads the folder."""
    import lhotse  # the test extra installs it

    monkeypatch.chdir(LHOTSE)
    shar = tmp_path / "shar"
    shar.mkdir()
    lhotse.CutSet.from_file("cuts.jsonl.gz").to_shar(str(shar), fields={"recording": "flac"}, shard_size=2)
    before = sorted(p.name for p in shar.iterdir())
    code = main(["index", str(shar), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0 and "--out" in err and "Shar" in err, err
    assert sorted(p.name for p in shar.iterdir()) == before
    cuts = list(lhotse.CutSet.from_shar(in_dir=str(shar)))
    assert sorted(c.id for c in cuts) == sorted(c["id"] for c in _lhotse_lines("cuts.jsonl.gz"))
