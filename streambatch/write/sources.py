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
import os
import posixpath
import re
from array import array
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from .. import limits
from ..errors import InputProblem, ShardifyError
from ..format.audio import AUDIO_EXTENSIONS
from ..io.storage import is_local, local_path
from .hf_source import hf_rows, is_hf_source
from .hf_source import is_text as hf_is_text
from .records import (
    AUDIO_PATH_FIELDS,
    Record,
    entry_key,
    iter_jsonl,
    numbered_lines,
    open_lines,
    path_key,
    record_from_audio_entry,
    sanitize_key,
)
from .spill import SpillList

KINDS = ("folder", "manifest", "speechbrain", "text", "hf", "lhotse", "kaldi")
#: how a JSON document's first line starts: ``[``, or ``{`` alone or followed by a first key whose value is an object
_DOCUMENT_START = re.compile(r'\[|\{\s*(?:"(?:[^"\\]|\\.)*"\s*:\s*)?(?:\{|$)')


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


def _first_json_line(src: str) -> Any:
    """The first JSON value of a JSON-lines file: its first non-empty line's or, when that line is malformed, the
    first later line's that parses (the malformed one is reported as a bad line when the file is read). None when
    the first line opens a JSON document instead (`_opens_document()`). A malformed first line and no line that
    parses is an error naming the first line."""
    with contextlib.closing(_text_lines(src)) as lines:
        n, line = next(lines, (0, ""))
        if not n:
            raise ShardifyError(f"{src}: the file is empty")
        try:
            return limits.loads(line)
        except ValueError as e:  # not JSON, or over a limit
            if _opens_document(src, line):
                return None
            problem = getattr(e, "msg", str(e))
        for _, later in lines:
            with contextlib.suppress(ValueError):
                return limits.loads(later)
    raise ShardifyError(
        f"{src}:{n}: not a valid JSON line ({problem}); a JSON-lines manifest (NeMo style) holds one JSON object "
        "per line"
    )


def _text_lines(src: str) -> Generator[tuple[int, str], None, None]:
    """The non-empty lines of ``src`` (stripped) with their numbers. The first one too long or not UTF-8 is an
    error; such a line later is passed over (reading the file reports it)."""
    with open_lines(src) as f:
        first = True
        for n, raw in numbered_lines(f):
            line, problem = _decoded(raw)
            if problem is not None:
                if first:
                    raise ShardifyError(f"{src}:{n}: {problem}")
                continue
            if line:
                first = False
                yield n, line


def _decoded(raw: bytes | None) -> tuple[str, str | None]:
    """A line as stripped text, or what keeps it from being one (too long, not UTF-8)."""
    if raw is None:
        return "", limits.line_too_long(limits.max_line_bytes())
    try:
        return raw.decode("utf-8").strip(), None
    except UnicodeDecodeError as e:
        return "", (
            f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
            "manifests must be UTF-8 (re-save it as UTF-8, e.g. with iconv)"
        )


def _opens_document(src: str, line: str) -> bool:
    """Whether a first line that is not JSON by itself opens a JSON document (``[``, ``{`` alone or ``{"id": {``:
    a pretty-printed or one-line SpeechBrain manifest) rather than being a malformed JSON line (``{"audio_filepath":
    "a.wav", ...`` cut short). A file named ``.jsonl`` or ``.ndjson`` holds JSON lines."""
    if src.lower().removesuffix(".gz").endswith((".jsonl", ".ndjson")):
        return False
    return _DOCUMENT_START.match(line) is not None


# ---- reading -----------------------------------------------------------------------------------
def read_source(
    src: str, kind: str | None = None, data_root: str | None = None
) -> tuple[SpillList[Record], list[InputProblem]]:
    """Read ``src`` into records (in source order) and the problems found (bad lines, duplicate keys). The records
    wait in a temporary file, not in memory (`SpillList`)."""
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
    if not isinstance(records, SpillList):
        records = SpillList(records)
    records, dup = _drop_duplicate_keys(records)
    return records, problems + dup


def _read_corpus(src: str, kind: str, data_root: str | None) -> tuple[SpillList[Record], list[InputProblem]]:
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


def _drop_duplicate_keys(records: SpillList[Record]) -> tuple[SpillList[Record], list[InputProblem]]:
    """The records without an empty or repeated key (the first of a key is kept), and a problem for each other one,
    in record order. Memory holds a hash of each key, not the keys: records are read back only where hashes meet."""
    empty: list[tuple[int, InputProblem]] = []
    positions, hashes = array("q"), array("q")
    for i, r in enumerate(records):
        if not r.key:
            empty.append((i, r.problem("empty key")))
        else:
            positions.append(i)
            hashes.append(hash(r.key))
    dropped: dict[int, InputProblem] = {}
    for group in same_keys(records, positions, hashes):
        first = records[group[0]].where
        for i in group[1:]:
            r = records[i]
            dropped[i] = r.problem(f"duplicate key {r.key!r} (also at {first})")
    kept = np.frombuffer(positions, dtype=np.int64)
    if dropped:
        kept = kept[~np.isin(kept, np.fromiter(dropped, dtype=np.int64, count=len(dropped)))]
    problems = [p for _, p in sorted(empty + list(dropped.items()), key=lambda ip: ip[0])]
    return records.take(kept), problems


def same_keys(records: Sequence[Record], positions: Sequence[int], hashes: Sequence[int]) -> list[list[int]]:
    """The records among ``positions`` (ascending) that share a key, as groups of two or more positions (each
    ascending, groups in the order of their first); ``hashes``: each one's ``hash(key)``. Only the records whose
    hashes meet are read back, and their keys compared exactly."""
    if len(positions) < 2:
        return []
    h = np.frombuffer(hashes, dtype=np.int64) if isinstance(hashes, array) else np.asarray(hashes, dtype=np.int64)
    at = np.frombuffer(positions, dtype=np.int64) if isinstance(positions, array) else np.asarray(positions)
    order = np.argsort(h, kind="stable")
    hs = h[order]
    meets = np.zeros(len(hs), dtype=bool)
    meets[1:] |= hs[1:] == hs[:-1]
    meets[:-1] |= hs[1:] == hs[:-1]
    by_key: dict[tuple[int, str], list[int]] = {}
    for j in order[meets]:
        p = int(at[j])
        by_key.setdefault((int(h[j]), records[p].key), []).append(p)
    groups = [sorted(g) for g in by_key.values() if len(g) > 1]
    return sorted(groups, key=lambda g: g[0])


def _read_folder(root: str) -> tuple[SpillList[Record], list[InputProblem]]:
    root = os.path.abspath(root)
    records: SpillList[Record] = SpillList()
    problems: list[InputProblem] = []
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


def _base_dir(src: str) -> str:
    return os.path.dirname(os.path.abspath(local_path(src))) if is_local(src) else posixpath.dirname(src)


def _fill_path_keys(records: SpillList[Record], base: str) -> None:
    """Records without an id get a key from their path: relative to the manifest's folder, or to the
    folder all their files share when they live elsewhere."""
    todo = 0
    under, prefix = True, os.path.join(base, "")
    shared: str | None = None  # the folder all the local files share (os.path.commonpath of them, one at a time)
    no_shared = False  # none (Windows: two drives): keys stay relative to ``base``
    for r in records:
        todo += not r.key
        if (p := r.path) is None or not is_local(p):
            continue
        under = under and os.path.abspath(p).startswith(prefix)
        d = os.path.dirname(p)
        if no_shared or d == shared or (shared is not None and d.startswith(os.path.join(shared, ""))):
            continue
        try:
            shared = d if shared is None else os.path.commonpath([shared, d])
        except ValueError:
            no_shared = True
    if not todo:
        return
    if not under and shared is not None and not no_shared:
        base = shared
    segments, hashes = array("q"), array("q")
    for i, r in enumerate(records):
        if r.key:
            continue
        r.key = path_key(r.path or "", base) + (r.segment.key_suffix() if r.segment is not None else "")
        records[i] = r
        if r.segment is not None:
            segments.append(i)
            hashes.append(hash(r.key))
    unique_segment_keys(records, segments, hashes)


def unique_segment_keys(records: SpillList[Record], segments: Sequence[int], hashes: Sequence[int]) -> None:
    """Segments of one recording that start at the same point get ``-sub1``, ``-sub2``, ... after the first
    (in source order, as NeMo names repeated audio), so each segment is a sample of its own. ``segments``: their
    positions in ``records`` (ascending), ``hashes``: their keys' hashes."""
    for group in same_keys(records, segments, hashes):
        for n, i in enumerate(group[1:], 1):
            r = records[i]
            r.key = f"{r.key}-sub{n}"
            records[i] = r


def _read_manifest_jsonl(src: str, data_root: str | None) -> tuple[SpillList[Record], list[InputProblem]]:
    problems: list[InputProblem] = []
    base = _base_dir(src)
    records: SpillList[Record] = SpillList()
    for n, obj in iter_jsonl(src, problems):
        rec = record_from_audio_entry(obj, src, n, entry_key(obj), base, data_root, problems)
        if rec is not None:
            records.append(rec)
    _fill_path_keys(records, base)
    return records, problems


def _read_text_jsonl(src: str) -> tuple[SpillList[Record], list[InputProblem]]:
    problems: list[InputProblem] = []
    stem = sanitize_key(os.path.splitext(posixpath.basename(src))[0])
    records: SpillList[Record] = SpillList()
    for n, obj in iter_jsonl(src, problems):
        key = entry_key(obj) or f"{stem}_{n:09d}"
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


def _read_hf(src: str) -> tuple[SpillList[Record], list[InputProblem]]:
    """The rows of a Hugging Face dataset as records (``line``: the row number, from 0)."""
    problems: list[InputProblem] = []
    records: SpillList[Record] = SpillList()
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
