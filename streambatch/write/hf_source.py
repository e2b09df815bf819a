"""Hugging Face ``datasets`` as a ``shardify write`` source: ``hf:NAME[:SPLIT]`` (``hf:NAME:CONFIG:SPLIT``) from
the hub, or a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (``hf:DIR:SPLIT`` picks
a split; the default is ``train``, or the only one).

An audio dataset has an ``Audio`` column (its stored bytes are written as they are, never decoded and
re-encoded), or an ``audio`` column of ``{"array", "sampling_rate"}`` (written as WAV, float or integer samples
kept exactly); the transcript is the first of `TEXT_COLUMNS`. A dataset without audio is text (``text``
and/or ``input_ids``). Other columns with plain values (strings, numbers) go into each sample's ``.json``. Audio
is read from the dataset's memory-mapped Arrow files when its sample is probed and again when it is written, so
the audio is never all in memory. ``datasets`` is optional: ``pip install 'streambatch[hf]'``.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputProblem, ShardifyError
from ..format.audio import AUDIO_EXTENSIONS

PREFIX = "hf:"
TEXT_COLUMNS = ("text", "sentence", "transcript", "transcription", "normalized_text")
KEY_COLUMNS = ("id", "utt_id", "key")
_SAVED = ("state.json", "dataset_dict.json")  # what save_to_disk leaves in its folder
_BATCH = 1024
#: the first bytes of each audio format, for audio stored without a file name
_MAGIC = (
    (b"RIFF", "wav"),
    (b"fLaC", "flac"),
    (b"OggS", "ogg"),
    (b"ID3", "mp3"),
    (b"\xff\xfb", "mp3"),
    (b"\xff\xf3", "mp3"),
    (b"\xff\xf2", "mp3"),
)


def is_saved_dataset(path: str) -> bool:
    """A local folder that ``save_to_disk`` wrote (a Dataset or a DatasetDict)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in _SAVED)


def is_hf_source(src: str) -> bool:
    return str(src).startswith(PREFIX) or is_saved_dataset(str(src))


def _parse(src: str) -> tuple[str, str | None, str | None]:
    """``hf:NAME[:SPLIT]`` or ``hf:NAME:CONFIG:SPLIT`` (or a saved folder) → (name, config, split)."""
    spec = src[len(PREFIX) :] if src.startswith(PREFIX) else src
    if is_saved_dataset(spec):
        return spec, None, None
    parts = spec.split(":")
    if not parts[0] or len(parts) > 3 or not all(parts):
        raise ShardifyError(f"{src}: expected hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT")
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    return parts[0], None, parts[1] if len(parts) == 2 else None


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ShardifyError(
            "a Hugging Face dataset source needs the 'datasets' package: pip install 'streambatch[hf]'"
        ) from None
    from huggingface_hub.utils import logging as hub_logging

    datasets.logging.set_verbosity_error()  # no progress bars or retry chatter: errors are one line
    hub_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


@functools.lru_cache(maxsize=4)
def open_hf(src: str) -> Any:
    """The ``datasets.Dataset`` that ``src`` names (loaded once per process); one-line errors."""
    ds = _datasets()
    name, config, split = _parse(src)
    local = is_saved_dataset(name)
    try:
        got = ds.load_from_disk(name) if local else ds.load_dataset(name, config, split=split)
    except Exception as e:  # noqa: BLE001 - network, missing dataset, bad folder: one line, exit 2
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        hint = (
            ""
            if local
            else ("; without a network, save it with `save_to_disk` where there is one and pass that folder")
        )
        raise ShardifyError(f"{src}: cannot load the Hugging Face dataset ({msg}){hint}") from None
    if isinstance(got, ds.DatasetDict):
        got = got[_pick_split(src, list(got), split)]
    if getattr(got, "_indices", None) is not None:
        got = got.flatten_indices()
    return got


def _pick_split(src: str, splits: list[str], split: str | None) -> str:
    if split is None and len(splits) == 1:
        return splits[0]
    split = split or "train"
    if split not in splits:
        raise ShardifyError(
            f"{src}: no split {split!r}; the dataset has {', '.join(splits)} (pass hf:{_parse(src)[0]}:SPLIT)"
        )
    return split


# ---- which columns are what --------------------------------------------------------------------------------
def audio_column(ds: Any) -> str | None:
    """The dataset's audio column: the first ``Audio`` feature, else an ``audio`` struct of array and rate."""
    audio_type = _datasets().Audio
    for name, feature in ds.features.items():
        if isinstance(feature, audio_type):
            return name
    t = ds.data.schema.field("audio").type if "audio" in ds.column_names else None
    if t is not None and hasattr(t, "num_fields"):
        names = {t.field(i).name for i in range(t.num_fields)}
        if {"array", "sampling_rate"} <= names:
            return "audio"
    return None


def is_text(src: str) -> bool:
    """True when the dataset has no audio column (its samples are text)."""
    return audio_column(open_hf(src)) is None


# ---- audio of one row, read where it is needed -------------------------------------------------------------
@dataclass
class HFAudio:
    """The audio of one row: its bytes as stored, or its array encoded as WAV. Pickles small (the dataset's
    Arrow files are memory-mapped and pickle as their paths), so worker processes read it themselves."""

    table: Any  # the dataset's audio column, Arrow formatted
    column: str
    row: int
    ext: str

    def read(self) -> bytes:
        value = self.table[self.row].column(self.column)[0]
        names = {f.name for f in value.type}
        if "array" in names:
            return _wav(value["array"], int(value["sampling_rate"].as_py()))
        data = value["bytes"].as_py() if "bytes" in names else None
        if data:
            return data
        path = value["path"].as_py() if "path" in names else None
        if not path:
            raise ShardifyError(f"row {self.row}: audio with neither bytes nor a file")
        with open(path, "rb") as f:
            return f.read()


def _wav(array: Any, rate: int) -> bytes:
    """Samples as a WAV file: float32/64 as IEEE float, int16/int32 as PCM (bit-exact); a list of channels is
    (channels, frames). Built here rather than by libsndfile, whose float WAVs carry a time stamp (a PEAK
    chunk), so the same dataset gives the same shards."""
    values = array.values
    if hasattr(values.type, "value_type"):  # a list of channels
        arr = np.stack([np.asarray(ch.values.to_numpy(zero_copy_only=False)) for ch in array]).T
    else:
        arr = np.asarray(values.to_numpy(zero_copy_only=False))[:, None]
    if arr.dtype.kind not in "fi" or arr.dtype.itemsize not in (2, 4, 8) or arr.dtype.str[1:] in ("i8", "f2"):
        arr = arr.astype(np.float32)
    data = np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"))).tobytes()
    channels, width = arr.shape[1], arr.dtype.itemsize
    tag = 3 if arr.dtype.kind == "f" else 1
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * channels * width, channels * width, 8 * width)
    fact = b"fact" + struct.pack("<II", 4, arr.shape[0]) if tag == 3 else b""
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + fact + b"data" + struct.pack("<I", len(data))
    return b"RIFF" + struct.pack("<I", len(body) + len(data)) + body + data


def _ext(value: dict[str, Any], head: bytes) -> str:
    """The audio's extension: from its file name, else from its first bytes (wav when unknown)."""
    path = value.get("path") or ""
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext in AUDIO_EXTENSIONS:
        return ext
    return next((e for magic, e in _MAGIC if head.startswith(magic)), "wav")


# ---- rows as records ---------------------------------------------------------------------------------------
def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _audio_rows(ds: Any, column: str) -> tuple[Any, Iterator[tuple[str, str]]]:
    """The Arrow-formatted audio column, and each row's (file name stem, extension)."""
    if isinstance(ds.features[column], _datasets().Audio):
        ds = ds.cast_column(column, _datasets().Audio(decode=False))
    table = ds.select_columns([column]).with_format("arrow")

    def rows() -> Iterator[tuple[str, str]]:
        for a in range(0, len(table), _BATCH):
            col = table[a : a + _BATCH].column(column).combine_chunks()
            names = {col.type.field(i).name for i in range(col.type.num_fields)}
            paths = col.field("path").to_pylist() if "path" in names else [None] * len(col)
            blobs = col.field("bytes") if "bytes" in names else None
            for i, path in enumerate(paths):
                head = blobs[i].as_buffer()[:12].to_pybytes() if blobs is not None and blobs[i].is_valid else b""
                ext = "wav" if "array" in names else _ext({"path": path}, head)
                yield os.path.splitext(os.path.basename(path or ""))[0], ext

    return table, rows()


def hf_rows(src: str, problems: list[InputProblem]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row, fields of a Record)`` for each usable row (``key``: an id column, the audio's file name, else
    the dataset's name and the row number); a problem for each other row."""
    ds = open_hf(src)
    audio = audio_column(ds)
    stem = os.path.basename(_parse(src)[0].rstrip("/")) or "hf"
    table, names = _audio_rows(ds, audio) if audio is not None else (None, None)
    rest = ds.remove_columns([audio]) if audio is not None else ds
    text_col = next((c for c in TEXT_COLUMNS if c in rest.column_names), None)
    skip = {text_col} if audio is not None else {text_col, "input_ids", "length"}
    rows = iter(rest) if rest.column_names else ({} for _ in range(len(ds)))  # no other column: rows all the same
    for n, row in enumerate(rows):
        name, ext = next(names) if names is not None else ("", "")
        key = next((str(row[c]) for c in KEY_COLUMNS if row.get(c) not in (None, "")), None) or name
        out: dict[str, Any] = {"key": key or f"{stem}_{n:09d}", "text": row.get(text_col) if text_col else None}
        if out["text"] is not None and not isinstance(out["text"], str):
            problems.append(InputProblem(src, f"{text_col!r} is not a string: {out['text']!r:.60}", n, key))
            continue
        if audio is not None:
            out["audio"] = HFAudio(table, audio, n, ext)
        else:
            length = row.get("length")
            out["input_ids"], out["length"] = row.get("input_ids"), length if isinstance(length, int) else None
            if out["text"] is None and out["input_ids"] is None:
                problems.append(InputProblem(src, f"no text ({', '.join(TEXT_COLUMNS)}) or input_ids", n, key))
                continue
        out["fields"] = {k: v for k, v in row.items() if k not in skip and _plain(v)}
        yield n, out
