"""A Kaldi data folder as a ``shardify write`` source: ``wav.scp`` (recording id → audio file), and optionally
``segments`` (utterance id → recording, start and end in seconds; end ``-1``: to the end), ``text`` (utterance id →
transcript) and ``utt2spk`` (utterance id → speaker).

With ``segments``, each utterance is a segment of its recording (`segments`); without, each recording is a
sample (its id the utterance id, as Kaldi has it). A relative path in ``wav.scp`` is relative to ``--data-root``
when given, else to the working directory (Kaldi runs from the recipe's folder); where not one of them is found,
one line says so with the first path and ``--data-root``. A command (``... |``) or an
archive offset (``file.ark:123``) in ``wav.scp`` is an input error naming its line: shardify never runs commands.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from ..errors import InputProblem, ShardifyError
from .records import Record, resolve_path, sanitize_key
from .segments import Segment
from .spill import SpillList

WAV_SCP = "wav.scp"


def is_kaldi_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, WAV_SCP))


def _table(path: str, problems: list[InputProblem], fields: int) -> Iterator[tuple[int, list[str]]]:
    """``(line, [first, rest...])`` of a Kaldi table: an id, then ``fields - 1`` whitespace-separated fields (the
    last one takes the rest of the line); a line with fewer is a problem."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                problems.append(InputProblem(path, "not UTF-8 text", n))
                continue
            if not line:
                continue
            parts = line.split(None, fields - 1)
            if len(parts) < fields:
                problems.append(InputProblem(path, f"expected {fields} fields, got {len(parts)}: {line[:60]!r}", n))
                continue
            yield n, parts


def _mapping(path: str, problems: list[InputProblem]) -> dict[str, str]:
    """An optional ``id value`` table (``text``, ``utt2spk``) as a dict; {} when the file is absent."""
    if not os.path.isfile(path):
        return {}
    return {parts[0]: parts[1] for _, parts in _table(path, problems, 2)}


def _wav_scp(folder: str, data_root: str | None, problems: list[InputProblem]) -> dict[str, tuple[str, int]]:
    """Recording id → (resolved audio path, line); commands and archive offsets are problems."""
    src = os.path.join(folder, WAV_SCP)
    base = data_root or os.getcwd()
    out: dict[str, tuple[str, int]] = {}
    relative: list[tuple[int, str, str]] = []  # (line, as written, resolved)
    for n, (rec, spec) in _table(src, problems, 2):
        spec = spec.strip()
        if spec.endswith("|") or spec.startswith("-"):
            problems.append(
                InputProblem(
                    src,
                    f"{rec}: a command, not an audio file ({spec[:60]!r}); convert the audio "
                    "to files first (shardify never runs commands)",
                    n,
                )
            )
            continue
        if len(spec.split()) > 1:
            problems.append(InputProblem(src, f"{rec}: expected one audio path, got {spec[:60]!r}", n))
            continue
        if rec in out:
            problems.append(InputProblem(src, f"recording {rec!r} listed twice (also at line {out[rec][1]})", n))
            continue
        out[rec] = (resolve_path(spec, base, None, f"{src}:{n}"), n)
        if not os.path.isabs(spec) and "://" not in spec:
            relative.append((n, spec, out[rec][0]))
    _check_root(src, data_root, base, relative)
    return out


def _check_root(src: str, data_root: str | None, base: str, relative: list[tuple[int, str, str]]) -> None:
    """Relative paths of which not one is found: the folder they are relative to is another (one line with the
    count, the first path and ``--data-root``, not a "not found" line per recording). One found is enough to go on
    (the check stops there): files missing among found ones are each reported as bad input."""
    if not relative or not os.path.isdir(base) or any(os.path.exists(path) for _, _, path in relative):
        return
    n, spec, path = relative[0]
    where = f"--data-root {data_root}" if data_root else f"the working directory {base}"
    fix = "check --data-root" if data_root else "pass --data-root DIR, the folder they are relative to"
    raise ShardifyError(
        f"{src}: none of its {len(relative):,} relative audio path{'s' if len(relative) != 1 else ''} is found "
        f"from {where} (the first, line {n}: {spec!r} -> {path}); {fix}"
    )


def read_kaldi(folder: str, data_root: str | None) -> tuple[SpillList[Record], list[InputProblem]]:
    """The utterances of a Kaldi data folder as records, and the problems found."""
    if not is_kaldi_dir(folder):
        raise ShardifyError(f"{folder}: not a Kaldi data folder (no {WAV_SCP})")
    problems: list[InputProblem] = []
    wavs = _wav_scp(folder, data_root, problems)
    texts = _mapping(os.path.join(folder, "text"), problems)
    speakers = _mapping(os.path.join(folder, "utt2spk"), problems)
    seg_path = os.path.join(folder, "segments")
    if os.path.isfile(seg_path):
        made = _segment_records(seg_path, wavs, problems)
    else:
        src = os.path.join(folder, WAV_SCP)
        made = (Record(key="", path=path, source=src, line=n, fields={"id": rec}) for rec, (path, n) in wavs.items())
    records: SpillList[Record] = SpillList()
    for r in made:
        utt = r.fields["id"]
        r.key = sanitize_key(utt)
        r.text = texts.get(utt)
        if utt in speakers:
            r.fields["speaker"] = speakers[utt]
        records.append(r)
    return records, problems


def _segment_records(path: str, wavs: dict[str, tuple[str, int]], problems: list[InputProblem]) -> Iterator[Record]:
    for n, (utt, rest) in _table(path, problems, 2):
        parts = rest.split()
        if len(parts) != 3:
            problems.append(InputProblem(path, f"{utt}: expected 'UTT RECORDING START END', got {rest[:60]!r}", n))
            continue
        rec, start, end = parts
        try:
            a, b = float(start), float(end)
        except ValueError:
            problems.append(InputProblem(path, f"{utt}: start and end must be seconds, got {start!r} {end!r}", n))
            continue
        if rec not in wavs:
            problems.append(InputProblem(path, f"{utt}: recording {rec!r} is not in {WAV_SCP}", n))
            continue
        if a < 0 or (b >= 0 and b <= a):
            problems.append(InputProblem(path, f"{utt}: the segment {a:g}-{b:g} s is empty or negative", n))
            continue
        segment = Segment(a, None if b < 0 else b - a)
        yield Record(
            key="",
            path=wavs[rec][0],
            source=path,
            line=n,
            segment=segment,
            fields={"id": utt, "recording_id": rec, "offset": a},
        )
