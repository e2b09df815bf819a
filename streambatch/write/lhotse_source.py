"""lhotse manifests as a ``shardify write`` source, read as plain JSON lines (lhotse is not needed): a cuts manifest
(``cuts.jsonl.gz``: one sample per cut), or a recordings manifest with its supervisions (``recordings.jsonl.gz`` +
``supervisions.jsonl.gz``, either one given: one sample per supervision, as icefall's recipes cut them).

A cut or supervision that does not cover its whole recording is a segment of it (`segments`). A sample's
``text`` is its supervisions' texts (in time order, joined by a space) and its ``speaker`` the one speaker they
share. Only recordings stored as one audio file (``"type": "file"``) are read; a command, URL or in-memory source,
or a ``MixedCut``, is an input error naming its line. A relative ``source`` path is relative to ``--data-root``
when given, else to the working directory (lhotse opens it as it is).
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import InputProblem, ShardifyError
from ..io.storage import is_local, local_path
from .records import Record, iter_jsonl, resolve_path, sanitize_key
from .segments import Segment
from .spill import SpillList

CUT_FIELDS = ("recording", "supervisions")
RECORDING_FIELDS = ("sources", "sampling_rate")
SUPERVISION_FIELDS = ("recording_id", "start", "duration")


def lhotse_role(first: Any) -> str | None:
    """``cuts``, ``recordings`` or ``supervisions``: which lhotse manifest a first JSON line belongs to (None:
    not lhotse)."""
    if not isinstance(first, dict):
        return None
    for role, names in (("cuts", CUT_FIELDS), ("recordings", RECORDING_FIELDS), ("supervisions", SUPERVISION_FIELDS)):
        if all(n in first for n in names):
            return role
    if first.get("type") == "MixedCut":
        return "cuts"
    return None


def read_lhotse(src: str, first: Any, data_root: str | None) -> tuple[SpillList[Record], list[InputProblem]]:
    """The samples of a lhotse manifest (``first``: its first JSON object, which tells which one it is)."""
    role = lhotse_role(first)
    base = data_root or os.getcwd()
    problems: list[InputProblem] = []
    if role == "cuts":
        return SpillList(
            r for n, cut in iter_jsonl(src, problems) if (r := _cut(cut, src, n, base, problems))
        ), problems
    if role is None:
        raise ShardifyError(f"{src}:1: not a lhotse manifest (no cut, recording or supervision fields)")
    recordings_src, supervisions_src = _pair(src, role)
    recordings = {}
    for n, rec in iter_jsonl(recordings_src, problems):
        recordings[str(rec.get("id"))] = (rec, n)
    records: SpillList[Record] = SpillList()
    for n, sup in iter_jsonl(supervisions_src, problems):
        found = recordings.get(str(sup.get("recording_id")))
        if found is None:
            problems.append(
                InputProblem(
                    supervisions_src,
                    f"recording {sup.get('recording_id')!r} is not in {os.path.basename(recordings_src)}",
                    n,
                )
            )
            continue
        r = _sample(
            found[0],
            sup.get("start"),
            sup.get("duration"),
            [sup],
            str(sup.get("id")),
            supervisions_src,
            n,
            base,
            problems,
        )
        if r is not None:
            r.fields["recording_id"] = found[0].get("id")
            records.append(r)
    return records, problems


def _pair(src: str, role: str) -> tuple[str, str]:
    """The recordings and supervisions manifests, from either one (the other's name has the other word)."""
    other = "supervisions" if role == "recordings" else "recordings"
    head, name = os.path.split(src)
    if role not in name:
        raise ShardifyError(
            f"{src}: a lhotse {role} manifest whose name does not say {role!r}; give its cuts "
            f"manifest, or name the pair {role}*.jsonl.gz and {other}*.jsonl.gz"
        )
    sibling = os.path.join(head, name.replace(role, other, 1))
    if is_local(sibling) and not os.path.exists(local_path(sibling)):
        raise ShardifyError(f"{src}: a lhotse {role} manifest needs its {other} manifest beside it ({sibling})")
    return (src, sibling) if role == "recordings" else (sibling, src)


def _cut(cut: dict, src: str, n: int, base: str, problems: list[InputProblem]) -> Record | None:
    if cut.get("type", "MonoCut") != "MonoCut" or not isinstance(cut.get("recording"), dict):
        problems.append(
            InputProblem(
                src, f"a {cut.get('type', 'cut without a recording')} is not supported (only MonoCuts of recordings)", n
            )
        )
        return None
    sups = cut.get("supervisions") or []
    return _sample(
        cut["recording"], cut.get("start", 0), cut.get("duration"), sups, str(cut.get("id")), src, n, base, problems
    )


def _sample(
    recording: dict,
    start: Any,
    duration: Any,
    sups: list[dict],
    ident: str,
    src: str,
    n: int,
    base: str,
    problems: list[InputProblem],
) -> Record | None:
    """One sample: ``[start, start + duration)`` of the recording, with its supervisions' text and speaker."""
    path = _audio_path(recording, src, n, base, problems)
    if path is None:
        return None
    if not _real(start) or not _real(duration) or start < 0 or duration <= 0:
        problems.append(InputProblem(src, f"start and duration must be seconds >= 0, got {start!r}, {duration!r}", n))
        return None
    rec = Record(key=sanitize_key(ident), path=path, source=src, line=n, fields={"id": ident, "duration": duration})
    total = recording.get("duration")
    if start > 0 or not _real(total) or abs(duration - total) > 0.5 / max(1, recording.get("sampling_rate") or 1):
        rec.segment = Segment(float(start), float(duration))
        rec.fields["offset"] = start
    ordered = sorted(sups, key=lambda s: s.get("start") or 0)
    texts: list[str] = [s["text"] for s in ordered if isinstance(s.get("text"), str)]
    rec.text = " ".join(texts) if texts else None
    speakers = {s.get("speaker") for s in sups if s.get("speaker") is not None}
    if len(speakers) == 1:
        rec.fields["speaker"] = speakers.pop()
    return rec


_URL = re.compile(r"^[a-z][a-z0-9+.-]*://")


def _audio_path(recording: dict, src: str, n: int, base: str, problems: list[InputProblem]) -> str | None:
    sources = recording.get("sources")
    if not isinstance(sources, list) or len(sources) != 1 or not isinstance(sources[0], dict):
        problems.append(
            InputProblem(
                src,
                f"recording {recording.get('id')!r}: expected one audio source, "
                f"got {len(sources) if isinstance(sources, list) else sources!r}",
                n,
            )
        )
        return None
    kind, where = sources[0].get("type"), sources[0].get("source")
    if kind != "file" or not isinstance(where, str) or not where:
        problems.append(
            InputProblem(
                src,
                f"recording {recording.get('id')!r}: a {kind!r} audio source is not "
                "supported (only files; shardify never runs commands)",
                n,
            )
        )
        return None
    return resolve_path(where, base, None, f"{src}:{n}")


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def first_object(src: str) -> Any:
    """The first JSON object of a (possibly gzipped) JSON lines file, or None."""
    problems: list[InputProblem] = []
    for _, obj in iter_jsonl(src, problems):
        return obj
    return None
