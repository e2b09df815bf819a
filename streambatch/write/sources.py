"""shardify inputs → records: an audio folder, a JSONL manifest (NeMo style), a SpeechBrain JSON or CSV
manifest (``speechbrain_source.py``), a lhotse manifest (``lhotse_source.py``), a Kaldi data folder
(``kaldi_source.py``), a text JSONL, or a Hugging Face dataset (``hf_source.py``).

``read_source(src)`` returns the records it could read and an ``InputProblem`` for every bad one (a line
that is not JSON, a missing field, a duplicate key, ...). Nothing here opens an audio file: lengths are
probed later (``probe.py``). Problems that make the whole source unusable (no such file, a SpeechBrain
JSON that does not parse, a ``{data_root}`` placeholder without ``data_root``) raise ``ShardifyError``.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..dataset.audio import AUDIO_EXTENSIONS
from ..dataset.storage import is_local, local_path, open_url
from ..errors import InputProblem, ShardifyError
from .hf_source import hf_rows, is_hf_source
from .hf_source import is_text as hf_is_text
from .segments import Segment

KINDS = ("folder", "manifest", "speechbrain", "text", "hf", "lhotse", "kaldi")
AUDIO_PATH_FIELDS = ("audio_filepath", "path", "wav", "file_path")
LENGTH_FIELDS = ("duration", "length")
KEY_FIELDS = ("id", "utt_id", "key")
DATA_ROOT_PLACEHOLDERS = ("{data_root}", "${data_root}", "$data_root")


@dataclass
class Record:
    """One sample to write. ``path`` is the resolved audio file (None for text); ``audio`` instead reads audio
    kept inside the source (a Hugging Face dataset row: ``read()`` and ``ext``); ``length`` is a length the
    source declares itself (text: a precomputed token count); ``output_length`` is the sample's second length
    (``--output-length``); ``fields`` are the source's other fields."""

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


# ---- kind detection ----------------------------------------------------------------------------
def detect_kind(src: str) -> str:
    """``folder`` for a directory; ``speechbrain`` for a .csv or a JSON object of objects; for JSON lines,
    ``manifest`` when the first record has an audio path field, else ``text``."""
    src = str(src)
    if is_hf_source(src):
        return "hf"
    if is_local(src) and os.path.isdir(local_path(src)):
        return "kaldi" if os.path.isfile(os.path.join(local_path(src), "wav.scp")) else "folder"
    if is_local(src) and not os.path.exists(local_path(src)):
        raise ShardifyError(f"{src}: no such file or folder")
    if src.lower().endswith((".csv", ".tsv")):
        return "speechbrain"
    first = _first_json_line(src)
    if first is None:  # the first line alone is not JSON: a pretty-printed JSON document
        return "speechbrain"
    if isinstance(first, dict) and first and all(isinstance(v, dict) for v in first.values()):
        if not any(f in first for f in AUDIO_PATH_FIELDS + ("text", "input_ids")):
            return "speechbrain"  # one-line SpeechBrain JSON
    if isinstance(first, dict) and any(f in first for f in AUDIO_PATH_FIELDS):
        return "manifest"
    from .lhotse_source import lhotse_role  # it builds on this module's records

    if lhotse_role(first) is not None:
        return "lhotse"
    if isinstance(first, dict):
        return "text"
    raise ShardifyError(f"{src}: cannot tell what kind of source this is; pass --kind ({', '.join(KINDS)})")


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
            except (OSError, EOFError) as e:
                raise ShardifyError(f"{src}: not a readable gzip file ({e})") from None


def _first_json_line(src: str) -> Any:
    with open_lines(src) as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise ShardifyError(
                    f"{src}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                    "manifests must be UTF-8 (re-save it as UTF-8, e.g. with iconv)"
                ) from None
            if line:
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    return None
    raise ShardifyError(f"{src}: the file is empty")


# ---- reading -----------------------------------------------------------------------------------
def read_source(
    src: str, kind: str | None = None, data_root: str | None = None
) -> tuple[list[Record], list[InputProblem]]:
    """Read ``src`` into records (in source order) and the problems found (bad lines, duplicate keys)."""
    src = str(src)
    if data_root is not None and is_local(str(data_root)):
        data_root = os.path.abspath(local_path(str(data_root)))  # a relative --data-root: from the working directory
    kind = kind or detect_kind(src)
    if kind not in KINDS:
        raise ShardifyError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    if kind not in ("folder", "hf", "kaldi") and is_local(src) and os.path.isdir(local_path(src)):
        raise ShardifyError(f"{src}: is a folder, but --kind {kind} expects a file")
    if kind == "hf":
        records, problems = _read_hf(src)
    elif kind == "folder":
        if not (is_local(src) and os.path.isdir(local_path(src))):
            raise ShardifyError(f"{src}: not a local folder")
        records, problems = _read_folder(local_path(src))
    elif kind == "manifest":
        records, problems = _read_manifest_jsonl(src, data_root)
    elif kind == "text":
        records, problems = _read_text_jsonl(src)
    elif kind in ("lhotse", "kaldi"):
        records, problems = _read_corpus(src, kind, data_root)
    else:
        from .speechbrain_source import read_speechbrain

        records, problems = read_speechbrain(src, data_root)
    records, dup = _drop_duplicate_keys(records)
    return records, problems + dup


def _read_corpus(src: str, kind: str, data_root: str | None) -> tuple[list[Record], list[InputProblem]]:
    """A lhotse manifest or a Kaldi data folder (their modules build on this one's records)."""
    if kind == "kaldi":
        from .kaldi_source import read_kaldi

        if not (is_local(src) and os.path.isdir(local_path(src))):
            raise ShardifyError(f"{src}: --kind kaldi expects a Kaldi data folder (holding wav.scp)")
        return read_kaldi(local_path(src), data_root)
    from .lhotse_source import read_lhotse

    return read_lhotse(src, _first_json_line(src), data_root)


def source_medium(src: str, kind: str) -> str:
    """``text`` or ``audio``: what the samples of ``src`` (of ``kind``) hold, which decides the length unit."""
    if kind == "hf":
        return "text" if hf_is_text(src) else "audio"
    return "text" if kind == "text" else "audio"


def _drop_duplicate_keys(records: list[Record]) -> tuple[list[Record], list[InputProblem]]:
    seen: dict[str, Record] = {}
    kept, problems = [], []
    for r in records:
        if not r.key:
            problems.append(r.problem("empty key"))
        elif r.key in seen:
            problems.append(r.problem(f"duplicate key {r.key!r} (also at {seen[r.key].where})"))
        else:
            seen[r.key] = r
            kept.append(r)
    return kept, problems


def _read_folder(root: str) -> tuple[list[Record], list[InputProblem]]:
    root = os.path.abspath(root)
    records, problems = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        names = set(filenames)
        for name in sorted(filenames):
            stem, ext = os.path.splitext(name)
            if name.startswith(".") or ext.lstrip(".").lower() not in AUDIO_EXTENSIONS:
                continue
            path = os.path.join(dirpath, name)
            rec = Record(key=path_key(path, root), path=path, source=path)
            if stem + ".txt" in names:
                try:
                    with open(os.path.join(dirpath, stem + ".txt"), encoding="utf-8") as f:
                        rec.text = f.read().strip()
                except (OSError, UnicodeDecodeError) as e:
                    problems.append(rec.problem(f"cannot read transcript {stem}.txt ({e})"))
                    continue
            records.append(rec)
    if not records and not problems:
        raise ShardifyError(f"{root}: no audio files ({', '.join(AUDIO_EXTENSIONS)}) found")
    return records, problems


def iter_jsonl(src: str, problems: list[InputProblem]) -> Iterator[tuple[int, dict]]:
    """Objects of a JSONL file (gzipped when its name ends in ``.gz``) with their line numbers; bad lines become
    problems."""
    with open_lines(src) as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                problems.append(InputProblem(src, "not UTF-8 text", n))
                continue
            except json.JSONDecodeError as e:
                problems.append(InputProblem(src, f"not valid JSON ({e.msg})", n))
                continue
            if not isinstance(obj, dict):
                problems.append(InputProblem(src, f"expected a JSON object, got {type(obj).__name__}", n))
                continue
            yield n, obj


def _base_dir(src: str) -> str:
    return os.path.dirname(os.path.abspath(local_path(src))) if is_local(src) else posixpath.dirname(src)


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
    if isinstance(value, bool) or not isinstance(value, (int, float)):
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
    """The segment an entry names: NeMo's ``offset`` (+ ``duration``) in seconds, or SpeechBrain's
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
    if not _real(offset) or offset < 0 or not _real(duration) or duration <= 0:
        return f"a segment needs offset >= 0 and duration > 0 (seconds), got {offset!r} and {duration!r}"
    return Segment(float(offset), float(duration))


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _whole(x: Any) -> bool:
    return _real(x) and float(x).is_integer()


def _entry_key(entry: dict) -> str | None:
    for f in KEY_FIELDS:
        if entry.get(f) not in (None, ""):
            return sanitize_key(str(entry[f]))
    return None


def _fill_path_keys(records: list[Record], base: str) -> None:
    """Records without an id get a key from their path: relative to the manifest's folder, or to the
    folder all their files share when they live elsewhere."""
    todo = [r for r in records if not r.key]
    if not todo:
        return
    local = [p for r in records if (p := r.path) is not None and is_local(p)]
    if local and not all(os.path.abspath(p).startswith(os.path.join(base, "")) for p in local):
        try:
            base = os.path.commonpath([os.path.dirname(p) for p in local])
        except ValueError:
            pass
    for r in todo:
        r.key = path_key(r.path or "", base) + (r.segment.key_suffix() if r.segment is not None else "")
    unique_segment_keys(todo)


def unique_segment_keys(records: list[Record]) -> None:
    """Segments of one recording that start at the same point get ``-sub1``, ``-sub2``, ... after the first
    (in source order, as NeMo names repeated audio), so each segment is a sample of its own."""
    seen: dict[str, int] = {}
    for r in records:
        if r.segment is None:
            continue
        n = seen.get(r.key, 0)
        seen[r.key] = n + 1
        if n:
            r.key = f"{r.key}-sub{n}"


def _read_manifest_jsonl(src: str, data_root: str | None) -> tuple[list[Record], list[InputProblem]]:
    problems: list[InputProblem] = []
    base = _base_dir(src)
    records = []
    for n, obj in iter_jsonl(src, problems):
        rec = record_from_audio_entry(obj, src, n, _entry_key(obj), base, data_root, problems)
        if rec is not None:
            records.append(rec)
    _fill_path_keys(records, base)
    return records, problems


def _read_text_jsonl(src: str) -> tuple[list[Record], list[InputProblem]]:
    problems: list[InputProblem] = []
    stem = sanitize_key(os.path.splitext(posixpath.basename(src))[0])
    records = []
    for n, obj in iter_jsonl(src, problems):
        key = _entry_key(obj) or f"{stem}_{n:09d}"
        text, ids, length = obj.get("text"), obj.get("input_ids"), obj.get("length")
        if text is None and ids is None:
            problems.append(InputProblem(src, "missing 'text' or 'input_ids' field", n, key))
            continue
        if text is not None and not isinstance(text, str):
            problems.append(InputProblem(src, f"'text' is not a string: {text!r:.60}", n, key))
            continue
        if ids is not None and not (
            isinstance(ids, list)
            and all(isinstance(i, int) and not isinstance(i, bool) and -(2**31) <= i < 2**31 for i in ids)
        ):
            problems.append(InputProblem(src, "'input_ids' is not a list of 32-bit integers", n, key))
            continue
        if length is not None:
            if isinstance(length, bool) or not isinstance(length, (int, float)) or length != int(length) or length < 0:
                problems.append(InputProblem(src, f"'length' is not a whole number of tokens: {length!r}", n, key))
                continue
            length = int(length)
        fields = {k: v for k, v in obj.items() if k not in ("text", "input_ids", "length")}
        records.append(Record(key=key, text=text, input_ids=ids, length=length, fields=fields, source=src, line=n))
    return records, problems


def _read_hf(src: str) -> tuple[list[Record], list[InputProblem]]:
    """The rows of a Hugging Face dataset as records (``line``: the row number, from 0)."""
    problems: list[InputProblem] = []
    records = []
    for n, row in hf_rows(src, problems):
        key = sanitize_key(row.pop("key"))
        records.append(Record(key=key, source=src, line=n, **row))
    return records, problems


def token_length(rec: Record) -> int:
    """Tokens of a text record: its precomputed ``length``, else ``len(input_ids)``, else whitespace tokens."""
    if rec.length is not None:
        return int(rec.length)
    if rec.input_ids is not None:
        return len(rec.input_ids)
    return len((rec.text or "").split())
