"""NeMo tarred audio datasets for ``shardify index``: the tarred manifest and its entries matched to tar members.

NeMo's ``convert_to_tarred_audio_dataset.py`` writes ``audio_0.tar`` … ``audio_{N-1}.tar`` (one member per
utterance, named by the manifest's ``audio_filepath``) and ``tarred_audio_manifest.json`` (JSON lines:
``audio_filepath``, ``duration``, ``text``, ``shard_id``, …), optionally also ``sharded_manifests/manifest_I.json``.
Each manifest entry must name a member of its tar (``shard_id`` says which); members the manifest does not name
are left out of the epoch, as NeMo leaves them out.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ... import limits
from ...errors import OptionError, ShardifyError, shown
from ...io import storage
from ..probe import DURATION_TOLERANCE, DURATION_TOLERANCE_S
from .scan import ShardScan, finite_number

MANIFEST_NAME = "tarred_audio_manifest.json"
SHARDED_DIR = "sharded_manifests"
_TAR_NUMBER = re.compile(r"(\d+)\.tar$")
#: what ``index_tars``' ``manifest`` must be, as its error says
MANIFEST_IS = "None (found beside the tars) or a NeMo manifest file or URL (text or a path)"


@dataclass(frozen=True)
class Entry:
    """One manifest line: the member it names, its tar (``shard_id``; None when not given), its duration and
    text, where it is (``FILE:LINE``), all its fields (for ``--columns`` and ``--output-length
    column:FIELD``), and what is wrong with it (None: nothing; the sample it names is not indexed)."""

    member: str
    shard: int | None
    duration: float | None
    text: str | None
    where: str
    fields: dict[str, Any] = field(default_factory=dict, compare=False)
    problem: str | None = None


def find_manifests(src: str, storage_options: dict | None = None) -> list[str]:
    """The tarred manifest beside the tars (``tarred_audio_manifest.json``), else every
    ``sharded_manifests/manifest_*.json``; none: not a NeMo tarred dataset."""
    names = storage.listdir(src, storage_options)
    if MANIFEST_NAME in names:
        return [storage.join_url(src, MANIFEST_NAME)]
    if SHARDED_DIR in names:
        sub = storage.join_url(src, SHARDED_DIR)
        found = [n for n in storage.listdir(sub, storage_options) if re.fullmatch(r"manifest_\d+\.json", n)]
        return [storage.join_url(sub, n) for n in sorted(found, key=lambda n: int(re.findall(r"\d+", n)[0]))]
    return []


def manifests_to_read(src: str, layout: str, manifest: str | None, storage_options: dict | None) -> list[str]:
    """The NeMo manifest(s) to read: ``manifest`` if given (a file: not a folder), else found beside the tars (layout
    auto/nemo)."""
    if manifest and layout not in ("auto", "nemo"):
        raise ShardifyError(f"--manifest is for NeMo tarred datasets, not layout {layout!r}")
    if manifest:
        if not storage.exists(manifest, storage_options):
            raise ShardifyError(f"{manifest}: manifest not found")
        if storage.is_local(manifest) and os.path.isdir(storage.local_path(manifest)):
            raise OptionError(f"manifest must be a NeMo manifest file, got the folder {shown(manifest)}")
        return [manifest]
    found = find_manifests(src, storage_options) if layout in ("auto", "nemo") else []
    if layout == "nemo" and not found:
        raise ShardifyError(
            f"{src}: no tarred_audio_manifest.json (or sharded_manifests/manifest_*.json) beside "
            "the tars; pass --manifest FILE"
        )
    return found


def read_manifests(urls: Sequence[str], storage_options: dict | None = None) -> list[Entry]:
    """Every entry of the manifests; a line that is not a JSON object with an ``audio_filepath`` is an error
    naming it (the manifest is the dataset's definition: it is not skipped around)."""
    entries: list[Entry] = []
    for url in urls:
        with storage.open_url(url, "rb", storage_options) as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
        for n, line in enumerate(lines, 1):
            if line.strip():
                entries.append(_entry(json_line(line, f"{url}:{n}"), f"{url}:{n}"))
    if not entries:
        raise ShardifyError(f"{', '.join(urls)}: the manifest has no entries")
    return entries


def json_line(line: str, where: str) -> dict[str, Any]:
    try:
        d = limits.loads(line)
    except ValueError as e:  # not JSON, or nested deeper than the limit
        raise ShardifyError(f"{where}: not a JSON line ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("audio_filepath"), str):
        raise ShardifyError(f"{where}: a manifest entry needs an audio_filepath (the member's name in its tar)")
    return d


def _entry(d: dict[str, Any], where: str) -> Entry:
    """The entry of a manifest line; a ``duration`` that is not a finite number is the entry's problem (as
    ``shardify write`` reports it), not a duration left unchecked."""
    shard = d.get("shard_id")
    duration = d.get("duration")
    seconds = finite_number(duration)
    problem = f"'duration' is not a number: {duration!r}"[:120] if duration is not None and seconds is None else None
    return Entry(
        d["audio_filepath"],
        int(number) if (number := finite_number(shard)) is not None else None,
        seconds,
        d["text"] if isinstance(d.get("text"), str) else None,
        where,
        d,
        problem,
    )


def tar_number(url: str) -> int | None:
    """The shard number in a NeMo tar's name (``audio_12.tar`` → 12)."""
    m = _TAR_NUMBER.search(url.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


#: NeMo's name for the n-th repeat of one member in a tarred manifest (its converter writes a recording cut into
#: several entries once, naming the entries ``NAME.wav``, ``NAME-sub1.wav``, ``NAME-sub2.wav``, ...)
_SUB = re.compile(r"^(?P<stem>.+)-sub\d+(?P<ext>\.[^./]+)?$")


def member_of(name: str, members: Any) -> str:
    """The member a manifest's ``audio_filepath`` names: itself if the tar holds it, else (NeMo's rule for
    repeated audio) ``NAME.EXT`` for ``NAME-subN.EXT``."""
    if name in members:
        return name
    m = _SUB.match(name)
    return m.group("stem") + (m.group("ext") or "") if m else name


def match_manifest(entries: Sequence[Entry], scans: Sequence[ShardScan], whole: bool) -> list[list[list[Entry]]]:
    """For each tar, each sample's manifest entries (none: the manifest does not name it; several: segments of
    it, by ``offset`` or NeMo's ``-subN`` names). ``whole``: the scans are every tar of the dataset (not one
    ``--part``), so an entry without ``shard_id`` must be found too.

    An entry naming a member no tar holds is an error that names the line."""
    numbers = {tar_number(s.url): j for j, s in enumerate(scans)}
    by_name: dict[tuple[int, str], int] = {}
    for j, scan in enumerate(scans):
        for i, s in enumerate(scan.samples):
            if s.audio is not None:
                by_name.setdefault((j, f"{s.key}.{s.audio}"), i)
            for ext in s.exts:  # a member soundfile does not know is still named by the manifest
                by_name.setdefault((j, f"{s.key}.{ext}"), i)
    names = {name for _, name in by_name}
    found: list[list[list[Entry]]] = [[[] for _ in s.samples] for s in scans]
    for e in entries:
        if e.shard is not None and e.shard not in numbers:
            if whole:
                raise ShardifyError(
                    f"{e.where}: shard_id {e.shard} names a tar that is not there "
                    f"(no audio_{e.shard}.tar beside the others)"
                )
            continue  # another part's tar
        tars = [numbers[e.shard]] if e.shard is not None else range(len(scans))
        member = member_of(e.member, names)
        hit = next(((j, by_name[(j, member)]) for j in tars if (j, member) in by_name), None)
        if hit is None:
            if e.shard is None and not whole:
                continue
            in_tar = scans[tars[0]].url if e.shard is not None else "any tar"
            raise ShardifyError(f"{e.where}: the manifest names {e.member!r}, which is not a member of {in_tar}")
        found[hit[0]][hit[1]].append(e)
    return found


def duration_problem(duration: float | None, where: str, rate: int, frames: int) -> str | None:
    """A declared duration (``where``: the manifest line, or the sample's ``.json``) against the member's
    header: None when they agree (see `DURATION_TOLERANCE`) or none is declared."""
    if duration is None or rate <= 0:
        return None
    header = frames / rate
    if abs(duration - header) <= max(DURATION_TOLERANCE_S, DURATION_TOLERANCE * header):
        return None
    return (
        f"{where} says duration {duration:g} s but the audio header says {header:.6g} s ({frames} frames at {rate} Hz)"
    )
