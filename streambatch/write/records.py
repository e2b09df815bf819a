"""One input sample as the sources read it (`Record`), and what every source kind shares to make one: keys,
paths resolved against a manifest's base and ``--data-root``, JSON lines, audio entries with their segments."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import posixpath
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import limits
from ..errors import InputProblem, ShardifyError
from ..io.storage import is_local, local_path, open_url
from .segments import Segment

AUDIO_PATH_FIELDS = ("audio_filepath", "path", "wav", "file_path")
LENGTH_FIELDS = ("duration", "length")
KEY_FIELDS = ("id", "utt_id", "key")
DATA_ROOT_PLACEHOLDERS = ("{data_root}", "${data_root}", "$data_root")


@dataclass(slots=True)
class Record:
    """One sample to write. ``path`` is the resolved audio file (None for text); ``audio`` instead reads audio
    kept inside the source (a Hugging Face dataset row: ``read()`` and ``ext``); ``length`` is a length the
    source declares itself (text: a precomputed token count); ``output_length`` is the sample's second length
    (``--output-length``); ``fields`` are the source's other fields. Slotted (no dict per instance): a write
    holds one for each line of its source until the index is written."""

    key: str
    path: str | None = None
    text: str | None = None
    input_ids: list[int] | None = None
    length: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    line: int | None = None
    audio: Any = None
    output_length: int | None = None
    #: the stretch of the recording at ``path`` this sample is (None: the whole file); see ``segments.py``
    segment: Segment | None = None

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}" if self.line is not None else self.source

    @property
    def ext(self) -> str:
        """Lower-cased extension of the audio file, without the dot."""
        if self.audio is not None:
            return str(self.audio.ext)
        return os.path.splitext(self.path or "")[1].lstrip(".").lower()

    def problem(self, error: str) -> InputProblem:
        return InputProblem(self.source, error, self.line, self.key)


# ---- keys ------------------------------------------------------------------------------------------
_UNSAFE = re.compile(r"[^\w\-]")


def sanitize_key(key: str) -> str:
    """A key webdataset groups correctly: ``/`` → ``__``, and ``.`` or any other unsafe character → ``_``."""
    return _UNSAFE.sub("_", str(key).replace("\\", "/").replace("/", "__"))


def path_key(path: str, base: str) -> str:
    """Key from an audio path: relative to ``base``, without extension, ``/`` → ``__``, sanitized."""
    rel = os.path.relpath(path, base) if is_local(path) and is_local(base) else path
    if rel.startswith(".."):
        rel = path
    if "://" in rel:
        rel = rel.split("://", 1)[1]
    rel = os.path.splitext(rel)[0].replace(os.sep, "/").lstrip("/")
    return sanitize_key(rel)


# ---- reading lines ---------------------------------------------------------------------------------
@contextlib.contextmanager
def open_lines(src: str) -> Iterator[Any]:
    """``src`` open for reading bytes line by line, decompressed when its name ends in ``.gz``."""
    with open_url(src, "rb") as f:
        if not src.lower().endswith(".gz"):
            yield f
            return
        with gzip.GzipFile(fileobj=f) as g:
            try:
                yield g
            except (OSError, EOFError, zlib.error) as e:
                raise ShardifyError(f"{src}: not a readable gzip file ({e})") from None


def numbered_lines(f: Any) -> Iterator[tuple[int, bytes | None]]:
    """``(line number, bytes)`` of each line of ``f``; None for a line longer than
    `max_line_bytes()`, read past without being held."""
    most = limits.max_line_bytes()
    n = 0
    while raw := f.readline(most + 1):
        n += 1
        if len(raw) > most:
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(most + 1)
            yield n, None
            continue
        yield n, raw


def iter_jsonl(src: str, problems: list[InputProblem]) -> Iterator[tuple[int, dict]]:
    """Objects of a JSONL file (gzipped when its name ends in ``.gz``) with their line numbers; bad lines become
    problems."""
    with open_lines(src) as f:
        for n, raw in numbered_lines(f):
            if raw is None:
                problems.append(InputProblem(src, limits.line_too_long(limits.max_line_bytes()), n))
                continue
            if not raw.strip():
                continue
            try:
                obj = limits.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                problems.append(InputProblem(src, "not UTF-8 text", n))
                continue
            except limits.LimitExceeded as e:
                problems.append(InputProblem(src, str(e), n))
                continue
            except json.JSONDecodeError as e:
                problems.append(InputProblem(src, f"not valid JSON ({e.msg})", n))
                continue
            if not isinstance(obj, dict):
                problems.append(InputProblem(src, f"expected a JSON object, got {type(obj).__name__}", n))
                continue
            yield n, obj


def resolve_path(path: str, base: str, data_root: str | None, where: str) -> str:
    """Fill ``{data_root}`` / ``$data_root``, then resolve a relative path against ``base``."""
    for ph in DATA_ROOT_PLACEHOLDERS:
        if ph in path:
            if data_root is None:
                raise ShardifyError(f"{where}: path {path!r} contains {ph}; pass --data-root DIR to fill it")
            path = path.replace(ph, str(data_root).rstrip("/"))
    if "://" in path and not path.startswith("file://"):
        return path
    path = os.path.expanduser(local_path(path))
    if not is_local(base):
        return path if os.path.isabs(path) else posixpath.join(base, path)
    if not os.path.isabs(path):
        path = os.path.join(base, path)
    return os.path.normpath(os.path.abspath(path))


def record_from_audio_entry(
    entry: dict,
    src: str,
    line: int | None,
    key: str | None,
    base: str,
    data_root: str | None,
    problems: list[InputProblem],
    speechbrain: bool = False,
) -> Record | None:
    """A record from a manifest entry (JSONL line or SpeechBrain item); None (and a problem) if bad.
    ``speechbrain``: SpeechBrain's rules (numbers may be strings; no NeMo ``offset``)."""
    where = f"{src}:{line}" if line is not None else src
    path_field = next((f for f in AUDIO_PATH_FIELDS if f in entry), None)
    if path_field is None or not _is_path(entry[path_field]):
        problems.append(InputProblem(src, f"missing audio path field ({', '.join(AUDIO_PATH_FIELDS)})", line, key))
        return None
    length_field = next((f for f in LENGTH_FIELDS if f in entry), None)
    if length_field is None:
        problems.append(InputProblem(src, "missing length field ('duration' or 'length')", line, key))
        return None
    value = entry[length_field]
    if speechbrain and isinstance(value, str):
        value = entry[length_field] = _number_or_str(value)
    to_the_end = value is None and length_field == "duration" and not speechbrain  # NeMo diarization manifests
    if not to_the_end and (isinstance(value, bool) or not isinstance(value, (int, float))):
        problems.append(InputProblem(src, f"{length_field!r} is not a number: {value!r}", line, key))
        return None
    segment = entry_segment(entry[path_field], entry, offsets=not speechbrain)
    if isinstance(segment, str):
        problems.append(InputProblem(src, segment, line, key))
        return None
    path_value = entry[path_field]["file"] if isinstance(entry[path_field], dict) else entry[path_field]
    path = resolve_path(path_value.strip(), base, data_root, where)
    text = entry.get("text")
    if text is not None and not isinstance(text, str):
        problems.append(InputProblem(src, f"'text' is not a string: {text!r}", line, key))
        return None
    fields = {k: v for k, v in entry.items() if k not in (path_field, "text")}
    return Record(key=key or "", path=path, text=text, fields=fields, source=src, line=line, segment=segment)


def _is_path(value: Any) -> bool:
    """A non-empty path, or a SpeechBrain segment ``{"file": PATH, "start": N, "stop": M}``."""
    if isinstance(value, dict):
        value = value.get("file")
    return isinstance(value, str) and bool(value.strip())


def _number_or_str(value: str) -> Any:
    """A number SpeechBrain keeps as a string (``"2.87"``) as the number; anything else as it is."""
    try:
        return float(value)
    except ValueError:
        return value


def entry_segment(value: Any, entry: dict, offsets: bool = True) -> Segment | str | None:
    """The segment an entry names: NeMo's ``offset`` (+ ``duration``; null: to the end) in seconds, or SpeechBrain's
    ``{"file", "start", "stop"}`` in frames (``stop`` absent or equal to ``start``: to the end); None for a whole
    file, or what is wrong with a bad one (``value``: the entry's audio path field)."""
    if isinstance(value, dict):
        start: Any = _number_or_str(v) if isinstance(v := value.get("start", 0), str) else v
        stop: Any = _number_or_str(v) if isinstance(v := value.get("stop"), str) else v
        if not _whole(start) or not (stop is None or _whole(stop)) or start < 0:
            return f"segment start/stop must be whole frame numbers: {value!r}"
        length = None if stop is None or stop == start else float(stop - start)
        if length is not None and length < 0:
            return f"segment stop {stop:g} is before its start {start:g}"
        return Segment(float(start), length, in_frames=True, clamp=True)
    if not offsets or "offset" not in entry:
        return None
    offset: Any = entry["offset"]
    duration: Any = entry.get("duration")
    if not _real(offset) or offset < 0 or not (duration is None or _real(duration) and duration > 0):
        return f"a segment needs offset >= 0 and duration > 0 or null (seconds), got {offset!r} and {duration!r}"
    if duration is None:  # NeMo's diarization manifests: from the offset to the end of the recording
        return None if offset == 0 else Segment(float(offset), None)
    return Segment(float(offset), float(duration))


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _whole(x: Any) -> bool:
    return _real(x) and float(x).is_integer()


def entry_key(entry: dict) -> str | None:
    for f in KEY_FIELDS:
        if entry.get(f) not in (None, ""):
            return sanitize_key(str(entry[f]))
    return None
