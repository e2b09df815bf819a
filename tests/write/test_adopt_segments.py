"""`shardify index` on datasets that other tools wrote, where one tar member is not one sample (issue 23, items 4
and 7): a NeMo tarred dataset whose manifest cuts a real recording into ``offset`` + ``duration`` segments and names
the repeats NeMo's way (``NAME-sub1.wav``, ...), and a lhotse Shar folder whose cut ids contain dots. Every segment
and every cut is a sample of its own, streamed once per epoch with 0 and 2 workers, its length the frames of its
slice and its audio bit-equal to soundfile's decode of that slice; a resume mid-epoch gives exactly the rest."""

from __future__ import annotations

import collections
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import TESTS

from streambatch import ShardIndex, StreamBatchLoader
from streambatch.cli import main
from streambatch.read import worker

AUDIO = TESTS / "data" / "real" / "audio"
LHOTSE = TESTS / "data" / "real" / "manifests" / "lhotse"
LIBRI = AUDIO / "libri-1088-134315-0000.wav"  # 16.04 s at 16 kHz
AMI = AUDIO / "ES2011a.Headset-0-40s-46s.wav"  # 6 s at 16 kHz, a name with a dot
FLAC = AUDIO / "2412-153948-0000.flac"
SR = 16000


def decoded(path: Path, first: int = 0, frames: int = -1) -> np.ndarray:
    """What soundfile decodes from ``path`` for ``[first, first + frames)`` (mono float32, as the loader gives)."""
    with sf.SoundFile(str(path)) as f:
        f.seek(first)
        return f.read(frames, dtype="float32")


def add(tar: tarfile.TarFile, name: str, path: Path) -> None:
    data = path.read_bytes()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


#: (audio_filepath, shard, offset or None, duration or None, text): LIBRI cut as NeMo's converter writes repeats
#: (the first entry names the member, the others ``-subN``; one overlaps another), AMI whole (a dotted name), the
#: FLAC as one segment named by its own name, LIBRI's tail named twice without -sub (NeMo's older readers take it)
ENTRIES = [
    ("libri-1088-134315-0000.wav", 0, 0.0, 4.0, "first"),
    ("libri-1088-134315-0000-sub1.wav", 0, 4.0, 5.5, "second"),
    ("libri-1088-134315-0000-sub2.wav", 0, 9.5, 6.54, "third"),
    ("libri-1088-134315-0000-sub3.wav", 0, 4.0, 2.0, "second, its start only"),
    ("ES2011a.Headset-0-40s-46s.wav", 0, None, 6.0, "whole meeting clip"),
    ("2412-153948-0000.flac", 1, 0.5, 1.25, "a stretch of a flac"),
]


def write_nemo_segments(root: Path) -> dict[str, tuple[np.ndarray, str]]:
    """The tarred dataset (each recording once) and its manifest; {key: (audio slice, text)} the loader owes."""
    root.mkdir(parents=True)
    with tarfile.open(root / "audio_0.tar", "w") as tar:
        add(tar, LIBRI.name, LIBRI)
        add(tar, AMI.name, AMI)
    with tarfile.open(root / "audio_1.tar", "w") as tar:
        add(tar, FLAC.name, FLAC)
    lines, want = [], {}
    for name, shard, offset, duration, text in ENTRIES:
        entry = {"audio_filepath": name, "duration": duration, "text": text, "shard_id": shard}
        source = {p.stem: p for p in (LIBRI, AMI, FLAC)}[name.split("-sub")[0].rsplit(".", 1)[0]]
        if offset is not None:
            entry["offset"] = offset
        first = round((offset or 0) * SR)
        frames = min(round(duration * SR), sf.info(str(source)).frames - first) if offset is not None else -1
        want[name.rsplit(".", 1)[0]] = (decoded(source, first, frames), text)
        lines.append(json.dumps(entry) + "\n")
    (root / "tarred_audio_manifest.json").write_text("".join(lines))
    return want


def epoch(source: str, workers: int, **kw) -> list[dict]:
    loader = StreamBatchLoader(source, **{**OPTIONS, "num_workers": workers, **kw})
    steps = len(loader)  # known before the epoch starts
    batches = kept(loader)
    assert len(batches) == steps
    return batches


#: small batches and window (segments of one member land in different batches); 4 KiB range requests, so a
#: resume reads byte ranges around what was consumed, starting inside a member's rows
OPTIONS = dict(budget=SR * 12, seed=5, buffer_size=3, chunk_size="4K")


def kept(batches) -> list[dict]:
    return [{"keys": b["keys"], "lengths": b["lengths"], "audio": b["audio"], "text": b.get("text")} for b in batches]


@pytest.fixture(params=["by position", "streamed"])
def read(request) -> dict:
    """The loader's read options: local shards read by position (the default), or streamed through the tar
    parser as remote shards are (``read_by_position=False``)."""
    return {"read_by_position": request.param == "by position"}


def check_epoch(batches: list[dict], want: dict[str, tuple[np.ndarray, str | None]]) -> None:
    """Every key once; each one's length its slice's frames, its audio bit-equal to the slice, its text."""
    seen = collections.Counter(k for b in batches for k in b["keys"])
    assert seen == collections.Counter(list(want)), seen
    for b in batches:
        for i, key in enumerate(b["keys"]):
            audio, text = want[key]
            n = int(b["lengths"][i])
            assert n == len(audio), key
            assert np.array_equal(b["audio"][i, :n].numpy(), audio), key
            if text is not None:
                assert b["text"][i] == text, key


@pytest.fixture(scope="module")
def nemo(tmp_path_factory):
    src = tmp_path_factory.mktemp("nemo") / "tarred"
    want = write_nemo_segments(src)
    assert main(["index", str(src), "--no-progress"]) == 0
    return src, want


def test_segments_are_samples_of_one_member(nemo):
    """One row per manifest entry, the tar holding each recording once: the sample table's rows of one member
    share its byte range, each with its own key, length and stretch; verify (with --decode) passes."""
    src, want = nemo
    ix = ShardIndex.load(str(src))
    assert ix.num_samples == len(ENTRIES) and ix.meta["adopted"]["segments"] == 5
    stored = ix.shards.reader.shard_samples(0)
    keys = stored["keys"]
    assert keys == [name.rsplit(".", 1)[0] for name, shard, *_ in ENTRIES if shard == 0]
    assert len(set(stored["offsets"][:4].tolist())) == 1 and stored["offsets"][4] != stored["offsets"][0]
    assert dict(zip(keys, stored["lengths"].tolist())) == {k: len(want[k][0]) for k in keys}
    assert ix.shard_values(0, "segment_start")[:4] == [0, 4 * SR, round(9.5 * SR), 4 * SR]
    with tarfile.open(src / "audio_0.tar") as tar:
        assert [m.name for m in tar] == [LIBRI.name, AMI.name]
    assert main(["verify", str(src), "--decode", "--no-progress"]) == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_segments_stream_once_each_as_their_slice(nemo, read, workers):
    src, want = nemo
    check_epoch(epoch(str(src), workers, **read), want)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_gives_exactly_the_rest(nemo, read, workers):
    src, want = nemo
    full = epoch(str(src), workers, **read)
    assert len(full) >= 4
    kw = {**OPTIONS, "num_workers": workers, **read}
    first = StreamBatchLoader(str(src), **kw)
    it = iter(first)
    head = kept(next(it) for _ in range(2))
    state = json.loads(json.dumps(first.state_dict()))
    del it
    resumed = StreamBatchLoader(str(src), **kw)
    resumed.load_state_dict(state)
    tail = kept(resumed)
    assert [b["keys"] for b in head] + [b["keys"] for b in tail] == [b["keys"] for b in full]
    check_epoch(head + tail, want)


def test_a_segment_past_the_end_is_an_input_error_naming_the_line(tmp_path, capsys):
    src = tmp_path / "tarred"
    write_nemo_segments(src)
    manifest = src / "tarred_audio_manifest.json"
    lines = manifest.read_text().splitlines()
    bad = {**json.loads(lines[1]), "offset": 15.0, "duration": 3.0}
    manifest.write_text("\n".join([lines[0], json.dumps(bad), *lines[2:]]) + "\n")
    capsys.readouterr()
    assert main(["index", str(src), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{manifest}:2" in err[0] and "after the end" in err[0], err


def test_shar_cut_ids_with_dots_are_indexed_and_streamed(tmp_path, monkeypatch):
    """A Shar folder by lhotse 1.33 holding cuts whose ids contain dots (AMI's, LibriSpeech's ``.sup-1``, and the
    whole dotted AMI recording): `shardify index --out` indexes every cut, the loader streams each once as lhotse
    stored it, and lhotse still reads the folder."""
    import lhotse  # the test extra installs it

    monkeypatch.chdir(LHOTSE)
    whole = lhotse.Recording.from_file(str(AMI)).to_cut()
    cuts = lhotse.CutSet.from_file("cuts.jsonl.gz") + lhotse.CutSet.from_cuts([whole])
    want = {c.id: (c.load_audio()[0].astype(np.float32), None) for c in cuts}
    assert all("." in k for k in want)
    shar = tmp_path / "shar"
    shar.mkdir()
    cuts.to_shar(str(shar), fields={"recording": "flac"}, shard_size=2)
    before = sorted(p.name for p in shar.iterdir())
    out = tmp_path / "index"
    assert main(["index", str(shar), "--out", str(out), "--no-progress"]) == 0
    ix = ShardIndex.load(str(out))
    assert ix.num_samples == len(want) and int(np.count_nonzero(ix.lengths)) == len(want)
    assert main(["verify", str(out), "--decode", "--no-progress", "--shard-root", str(shar)]) == 0
    for workers in (0, 2):
        check_epoch(epoch(str(out), workers, shard_roots=[str(shar)]), want)
    assert sorted(p.name for p in shar.iterdir()) == before
    assert sorted(c.id for c in lhotse.CutSet.from_shar(in_dir=str(shar))) == sorted(want)
    shutil.rmtree(out)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_filter_leaves_out_segments_and_the_rest_stream_from_inside_a_member(nemo, read, workers, monkeypatch):
    """where= leaves out LIBRI's second and third segments: streamed, its member is read as two byte ranges (each
    from the member's header), the second one giving only the rows after the gap; the rest stream once each."""
    src, want = nemo
    spans: list = []
    real = worker.skip_left_out
    monkeypatch.setattr(worker, "skip_left_out", lambda *a: spans.extend(p for p, _ in real(*a)) or real(*a))
    left_out = ("second", "third")
    batches = epoch(str(src), workers, where=" and ".join(f"text != '{t}'" for t in left_out), **read)
    check_epoch(batches, {k: v for k, v in want.items() if v[1] not in left_out})
    if not read["read_by_position"] and workers == 0:
        assert sorted((p.start, p.stop) for p in spans if p.shard == 0 and hasattr(p, "first_byte")) == [(0, 1), (3, 5)]
