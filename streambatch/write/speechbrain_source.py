"""SpeechBrain manifests as SpeechBrain reads them (``speechbrain.dataio.dataio.load_data_json`` /
``load_data_csv``): a JSON object ``{id: {...}}`` or a CSV with an ``ID`` column; relative paths are relative to
the working directory (SpeechBrain opens them as they are); numbers stored as strings are numbers."""

from __future__ import annotations

import csv
import io
import json
import os
import posixpath
import re
from collections.abc import Iterator
from typing import Any

from .. import limits
from ..errors import InputProblem, ShardifyError
from ..io.storage import is_local, open_url
from .records import AUDIO_PATH_FIELDS, LENGTH_FIELDS, Record, record_from_audio_entry, sanitize_key
from .spill import SpillList

_WS = re.compile(r"\s*")


def read_speechbrain(src: str, data_root: str | None) -> tuple[SpillList[Record], list[InputProblem]]:
    """The records of a SpeechBrain ``.csv``/``.tsv`` or JSON manifest and the problems found."""
    if src.lower().endswith((".csv", ".tsv")):
        return _read_speechbrain_csv(src, data_root)
    return _read_speechbrain_json(src, data_root)


def speechbrain_base(src: str) -> str:
    """What a relative path in a SpeechBrain manifest is relative to: the working directory, as SpeechBrain
    opens the path as it is (a manifest in an object store: its folder)."""
    return os.getcwd() if is_local(src) else posixpath.dirname(src)


def _skip_ws(text: str, pos: int) -> int:
    """The position of the first non-whitespace character at or after ``pos``."""
    m = _WS.match(text, pos)
    return m.end() if m else pos


def _read_speechbrain_json(src: str, data_root: str | None) -> tuple[SpillList[Record], list[InputProblem]]:
    with open_url(src, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    problems: list[InputProblem] = []
    base = speechbrain_base(src)
    records: SpillList[Record] = SpillList()
    for ident, entry, line in iter_json_object_items(text, src):
        key = sanitize_key(ident)
        if not isinstance(entry, dict):
            problems.append(InputProblem(src, f"entry {ident!r} is not a JSON object", line, key))
            continue
        rec = record_from_audio_entry(entry, src, line, key, base, data_root, problems, speechbrain=True)
        if rec is not None:
            rec.fields = {"id": ident, **rec.fields}
            records.append(rec)
    return records, problems


def iter_json_object_items(text: str, source: str) -> Iterator[tuple[str, Any, int]]:
    """``(key, value, line)`` for each item of a top-level JSON object, with the line the key is on."""
    dec = json.JSONDecoder()

    line, counted = 1, 0

    def line_at(pos: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, pos)
        counted = pos
        return line

    def fail(pos: int, msg: str) -> ShardifyError:
        at = min(pos, len(text.rstrip()))  # a document cut short: its last line, not the empty one after it
        return ShardifyError(f"{source}:{line_at(at)}: not a valid SpeechBrain JSON manifest ({msg})")

    def decode(at: int) -> tuple[Any, int]:
        """The JSON value at ``at`` and where it ends, under the depth limit."""
        try:
            return limits.raw_decode(dec, text, at)
        except json.JSONDecodeError as e:
            raise fail(e.pos, e.msg) from None
        except limits.LimitExceeded as e:
            raise fail(at, str(e)) from None

    pos = _skip_ws(text, 0)
    if text[pos : pos + 1] != "{":
        raise fail(pos, "expected a JSON object {id: {...}, ...}")
    pos = _skip_ws(text, pos + 1)
    if text[pos : pos + 1] == "}":
        return
    while True:
        start = pos
        key, pos = decode(pos)
        if not isinstance(key, str):
            raise fail(start, "expected a string key")
        pos = _skip_ws(text, pos)
        if text[pos : pos + 1] != ":":
            raise fail(pos, "expected ':'")
        pos = _skip_ws(text, pos + 1)
        value, pos = decode(pos)
        yield key, value, line_at(start)
        pos = _skip_ws(text, pos)
        ch = text[pos : pos + 1]
        if ch == ",":
            pos = _skip_ws(text, pos + 1)
        elif ch == "}":
            if text[pos + 1 :].strip():
                raise fail(pos + 1, "extra data after the object")
            return
        else:
            raise fail(pos, "expected ',' or '}'")


def _read_speechbrain_csv(src: str, data_root: str | None) -> tuple[SpillList[Record], list[InputProblem]]:
    with open_url(src, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    reader = csv.reader(
        io.StringIO(text, newline=""), delimiter="\t" if src.lower().endswith(".tsv") else ",", skipinitialspace=True
    )
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise ShardifyError(f"{src}: the file is empty") from None
    id_col = next((c for c in ("ID", "id") if c in header), None)
    path_col = next((c for c in AUDIO_PATH_FIELDS if c in header), None)
    if id_col is None or path_col is None:
        raise ShardifyError(
            f"{src}:1: a SpeechBrain CSV needs an 'ID' column and an audio path column "
            f"({', '.join(AUDIO_PATH_FIELDS)}); the header is {','.join(header)}"
        )
    problems: list[InputProblem] = []
    base = speechbrain_base(src)
    records: SpillList[Record] = SpillList()
    prev = reader.line_num
    for row in reader:
        line, prev = prev + 1, reader.line_num
        if not any(c.strip() for c in row):
            continue
        if len(row) != len(header):
            problems.append(InputProblem(src, f"{len(row)} columns, but the header has {len(header)}", line))
            continue
        entry: dict[str, Any] = dict(zip(header, row))
        for col in LENGTH_FIELDS:
            if col in entry:
                try:
                    entry[col] = float(entry[col])
                except ValueError:
                    pass  # reported as "not a number" below
        rec = record_from_audio_entry(
            entry, src, line, sanitize_key(entry[id_col]), base, data_root, problems, speechbrain=True
        )
        if rec is not None:
            records.append(rec)
    return records, problems
