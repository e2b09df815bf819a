"""Shared test helpers: real (tiny) audio files and sources to shard."""

from __future__ import annotations

import json
import os
from pathlib import Path

import signal

import numpy as np
import pytest
import soundfile as sf

SR = 16000


def make_audio(path: str | os.PathLike, seconds: float = 0.25, sr: int = SR, seed: int = 0) -> int:
    """Write a short tone+noise file (format from the extension: wav, flac, ogg); returns its frame count
    as the header reports it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = max(1, int(round(seconds * sr)))
    rng = np.random.default_rng(seed)
    t = np.arange(n) / sr
    wav = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.01 * rng.standard_normal(n)).astype("float32")
    fmt = path.suffix.lstrip(".").upper()
    subtype = "VORBIS" if fmt == "OGG" else "PCM_16"
    sf.write(str(path), wav, sr, format=fmt, subtype=subtype)
    return sf.info(str(path)).frames


def write_jsonl(path: str | os.PathLike, rows: list, raw_lines: dict[int, str] | None = None) -> Path:
    """Write rows as JSON lines; ``raw_lines`` {position: text} inserts verbatim (e.g. broken) lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in rows]
    for pos, text in sorted((raw_lines or {}).items()):
        lines.insert(pos, text)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def audio_folder(tmp_path: Path) -> tuple[Path, dict[str, dict]]:
    """A folder tree of mixed wav/flac/ogg at 16 kHz, some with ``.txt`` transcripts.
    Returns (folder, {key: {"path", "frames", "text"}})."""
    root = tmp_path / "audio"
    spec = [
        ("spk1/utt-a.wav", 0.10, "hello world"),
        ("spk1/utt-b.flac", 0.30, None),
        ("spk2/utt.c.ogg", 0.20, "third one here"),
        ("spk2/deep/utt-d.flac", 0.50, "four"),
        ("top.wav", 0.15, None),
    ]
    expected = {}
    for i, (rel, secs, text) in enumerate(spec):
        p = root / rel
        frames = make_audio(p, secs, seed=i)
        if text is not None:
            p.with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
        key = os.path.splitext(rel)[0].replace("/", "__").replace(".", "_")
        expected[key] = {"path": p, "frames": frames, "text": text}
    (root / "notes.md").write_text("not audio")
    return root, expected


@pytest.fixture
def nemo_manifest(tmp_path: Path) -> tuple[Path, dict[str, dict]]:
    """A NeMo JSONL manifest with relative paths, durations, text and an extra field.
    Returns (manifest, {key: {"path", "frames", "text"}})."""
    d = tmp_path / "nemo"
    rows, expected = [], {}
    for i in range(6):
        rel = f"wavs/s{i % 2}/u{i}.{'flac' if i % 2 else 'wav'}"
        frames = make_audio(d / rel, 0.1 + 0.05 * i, seed=i)
        rows.append({"audio_filepath": rel, "duration": frames / SR, "text": f"utterance {i}", "lang": "en"})
        expected[f"wavs__s{i % 2}__u{i}"] = {"path": d / rel, "frames": frames, "text": f"utterance {i}"}
    return write_jsonl(d / "train_manifest.json", rows), expected


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...), from /proc, whatever session they are in."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything below it: torchrun starts its ranks in their own sessions, so killing
    its process group alone leaves the ranks and their DataLoader workers running."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
