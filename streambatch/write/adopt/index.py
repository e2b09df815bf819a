"""``shardify index SRC``: adopt tar shards that already exist, without rewriting a byte of them.

The tars in SRC (plain webdataset tars of audio and/or text, or a NeMo tarred audio dataset) are read once
(`scan`, in ``workers`` processes): every sample the loader will stream, its byte range, its length
(audio headers; a ``.json`` ``length``; text tokens) and the tar's size and sha256. The result is a normal
version 2 index beside the tars (or in ``out``, pointing back at them), so ``verify``, the loader, DDP,
resume and mixing all work on it.

A NeMo manifest may cut one member into segments (``offset`` + ``duration`` entries, or NeMo's ``-subN`` names for
repeated audio): each segment is a sample of its own, one row of the sample table pointing at the one member
group, with its own key and the frames it takes of the member (`streambatch.format.members`). Where the
layout says how member names end (NeMo, lhotse Shar), keys may hold dots: the index records the suffixes, and
every reader splits names by them.

A sample the loader could not use (a member that does not read, a NeMo member the manifest does not name)
cannot be cut out of a tar that is not rewritten: it stays in the index with length 0, which the loader never
plans (as it never plans a sample outside ``min_length``), so its position in the stream stays right. A tar
the loader cannot read past (damaged, or an invalid ``.json``) is left out whole.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from ...errors import InputProblem, ShardifyError, bool_option, choice_option, int_option, os_problem, path_option
from ...format.index import ShardIndex, ShardInfo
from ...format.members import ADOPTED_SUFFIXES, SEGMENT_FRAMES, SEGMENT_START, SUFFIXES_META, WHOLE
from ...format.rules import keys_sha1
from ...format.tar import split_name
from ...io import storage
from ...io.lock import holds_lock
from ..engines import Engine
from ..parts import Scope, parse_part, part_range, utc_now, write_errors
from ..probe import MAX_SAMPLE_RATE, MAX_WORKERS, check_storage_options, check_unit, process_pool
from ..records import entry_segment
from ..segments import Segment
from .fields import SampleExtras
from .lengths import AUDIO_MEMBERS, sample_length
from .nemo import MANIFEST_IS, Entry, manifests_to_read, match_manifest, read_manifests
from .scan import SampleScan, ShardScan, scan_tar
from .shar import SHAR_CUTS, shar_transcripts

LAYOUTS = ("auto", "audio", "text", "nemo")


@dataclass
class Adopted:
    """The index's view of the scanned tars: per kept tar its lengths (0: left out), the problems found, and
    counts for the index's ``meta``."""

    infos: list[ShardInfo] = field(default_factory=list)
    problems: list[InputProblem] = field(default_factory=list)
    unnamed: int = 0  # samples a NeMo manifest does not name
    columns: dict[str, str] = field(default_factory=dict)  # the sample table's metadata columns
    segments: int = 0  # samples that are a stretch of their member (NeMo offset / -subN entries)


@dataclass(frozen=True)
class Row:
    """One sample of the index: member group ``i`` of its tar (``sample``: what its members say), the manifest
    entry naming it (None: none; ``unnamed``: a manifest names other members but not this one), its key, and the
    stretch of the member it is (None: all of it; a str: why the entry's stretch is wrong)."""

    i: int
    sample: SampleScan
    entry: Entry | None
    key: str
    segment: Segment | str | None = None
    unnamed: bool = False


def tar_rows(scan: ShardScan, named: Sequence[Sequence[Entry]] | None) -> list[Row]:
    """The index rows of one tar: one per member group, or one per manifest entry where entries cut a member
    into segments (an ``offset``, or several entries naming it)."""
    rows: list[Row] = []
    where: dict[str, str] = {}  # segment key -> the manifest line that gave it
    for i, s in enumerate(scan.samples):
        got = named[i] if named is not None else None
        if not got or (len(got) == 1 and "offset" not in got[0].fields):
            rows.append(Row(i, s, got[0] if got else None, s.key, unnamed=got is not None and not got))
            continue
        for e in got:
            segment = entry_segment(e.member, e.fields) or Segment(0.0, e.duration)
            key = split_name(e.member, ADOPTED_SUFFIXES)[0]
            if key in where and isinstance(segment, Segment):
                key += segment.key_suffix()  # one name listed twice, at other offsets
            if key in where:
                raise ShardifyError(
                    f"{e.where}: {e.member!r} is named twice at the same offset (also at {where[key]}); "
                    "each segment must be a sample of its own"
                )
            where[key] = e.where
            rows.append(Row(i, s, e, key, segment))
    return rows


def find_tars(src: str, storage_options: dict | None = None) -> list[str]:
    """URLs of the ``.tar`` files in the folder ``src``, in natural order (``audio_2`` before ``audio_10``)."""
    if storage.is_local(src) and not os.path.isdir(storage.local_path(src)):
        what = "does not exist" if not os.path.exists(storage.local_path(src)) else "is not a folder"
        raise ShardifyError(f"{src} {what}: SRC is the folder that holds the tar shards")
    names = [n for n in storage.listdir(src, storage_options) if n.endswith(".tar")]
    if not names:
        raise ShardifyError(f"{src}: no .tar files found (SRC is the folder that holds the tar shards)")
    natural = [[int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)] for n in names]
    return [storage.join_url(src, n) for _, n in sorted(zip(natural, names))]


def _output(a: Any) -> Any:
    """The folder ``index_tars`` holds the lock of (`lock`): where the index goes, whole or for its part
    (none where SRC is not a folder: refused with its own message)."""
    src, out = _paths(a.arguments["src"], a.arguments["out"])
    storage_options = check_storage_options(a.arguments["storage_options"])
    if storage.is_local(src) and not os.path.isdir(storage.local_path(src)):
        return None
    return out, parse_part(a.arguments["part"]), storage_options


#: what ``src``, ``out`` and ``manifest`` must be, as their errors say
SRC_IS = "the folder or URL that holds the tar shards (text or a path)"
OUT_IS = "None (beside the tars) or the folder or URL for the index (text or a path)"


def _paths(src: Any, out: Any) -> tuple[str, str]:
    """SRC and where the index goes (default: SRC), checked: text or a path, not empty."""
    src = path_option("src", src, SRC_IS).rstrip("/") or "/"
    out = src if out is None else path_option("out", out, OUT_IS).rstrip("/") or "/"
    return src, out


def _unwritable(folder: str, e: OSError) -> ShardifyError:
    """The error where the index's folder cannot be written (read-only storage): pass ``--out``."""
    why = "read-only storage" if e.errno == errno.EROFS else f"cannot write the index there ({os_problem(e)})"
    return ShardifyError(f"{folder}: {why}; pass --out DIR to put the index elsewhere (it points back at the tars)")


@holds_lock(_output, unwritable=_unwritable)
def index_tars(
    src: str,
    out: str | None = None,
    *,
    layout: str = "auto",
    manifest: str | None = None,
    unit: str | None = None,
    sample_rate: int | None = None,
    workers: int = 1,
    on_error: str = "fail",
    overwrite: bool = False,
    part: str | tuple[int, int] | None = None,
    output_length: str | None = None,
    columns: str | Sequence[str] | None = None,
    storage_options: dict | None = None,
    progress: bool = True,
    engine: Engine | None = None,
) -> ShardIndex:
    """Index the tars in ``src`` as they are: ``index.json`` (version 2) in ``out`` (default ``src``).

    ``layout``: ``audio`` (webdataset tars with an audio member per sample, optional ``.txt``/``.json``),
    ``text`` (``.txt``, ``.input_ids.npy`` or a ``.json`` ``text``), ``nemo`` (a tarred manifest beside the
    tars, or ``manifest``), or ``auto``. Members the loader could not use raise `ShardifyError` naming
    the first (``on_error="fail"``), or are left out and listed in ``errors.jsonl`` (``"skip"``). ``part=(i, n)``
    indexes the i-th of n slices of the tars as ``index.part-IIII.json``; ``shardify merge`` joins them.
    ``output_length``: ``chars``, ``tokens:TOKENIZER`` (of each transcript) or ``column:FIELD`` (an integer field
    of the manifest entry or ``.json``); ``columns``: the fields stored as metadata columns (default: every
    scalar field but the transcript; a NeMo dataset's transcripts are always stored, as ``text``). ``engine``: where
    the tars are scanned (default: this process and its ``workers``, 1 to 1,024 processes;
    `RayEngine`: Ray tasks). ``unit`` and ``sample_rate``: what the lengths count (default:
    samples at the tars' rate for audio, tokens for text). ``overwrite`` replaces an earlier index (never a tar);
    ``storage_options`` go to fsspec for a remote ``src`` or ``out``.
    """
    src, out = _paths(src, out)
    storage_options = check_storage_options(storage_options)
    manifest = _check_options(layout, workers, on_error, overwrite, progress, manifest, sample_rate)
    part = parse_part(part)
    scope = Scope(part)
    tars = find_tars(src, storage_options)
    shar = _refuse_shar_in_place(src, out, storage_options)
    num_tars = len(tars)
    if part is not None:
        tars = tars[slice(*part_range(num_tars, *part))]
        if not tars:
            raise ShardifyError(
                f"part {part[0]}/{part[1]} has no tars: {src} holds {num_tars}; use at most {num_tars} parts"
            )
    _check_out(out, scope, overwrite, storage_options)
    manifests = manifests_to_read(src, layout, manifest, storage_options)
    extras = SampleExtras(output_length, columns)
    suffixes = ADOPTED_SUFFIXES if manifests or shar else ()  # the layout says how names end: keys may hold dots
    scans = (engine.scan if engine else scan_tars)(tars, workers, progress, storage_options, suffixes)
    if shar:  # the transcripts are in the cuts files, not in the tars
        _add_transcripts(scans, shar_transcripts(src, storage_options))
    layout = "nemo" if manifests else _layout(layout, scans)
    kind = "text" if layout == "text" else "audio"
    unit = check_unit(kind, unit, sample_rate)
    named = match_manifest(read_manifests(manifests, storage_options), scans, part is None) if manifests else None
    rows = [tar_rows(scan, named[j] if named is not None else None) for j, scan in enumerate(scans)]
    rate = None if kind == "text" else index_rate(scans, rows, unit, sample_rate)
    adopted = adopt(scans, rows, layout, unit, rate, out, extras.for_layout(layout, text_column=shar))
    _report(adopted.problems, on_error)
    if not any(int(np.count_nonzero(i.lengths)) for i in adopted.infos):
        raise ShardifyError(f"{src}: no sample the loader could use; nothing was written")
    meta = {**_meta(src, layout, manifests, adopted, tars, part, num_tars, on_error), **extras.meta()}
    if suffixes:
        meta[SUFFIXES_META] = list(suffixes)
    write_errors(
        storage.join_url(out, scope.errors_name),
        [p.to_json() for p in adopted.problems],
        storage_options,
        remove_stale=True,
    )
    index = ShardIndex(shards=adopted.infos, unit=unit, sample_rate=rate, root=out, meta=meta, columns=adopted.columns)
    _save(index, storage.join_url(out, scope.index_name), storage_options)
    return index


def _refuse_shar_in_place(src: str, out: str, storage_options: dict | None) -> bool:
    """Whether ``src`` is a lhotse Shar folder (``cuts.NNNNNN.jsonl.gz`` beside the tars). It is not indexed in
    place: lhotse reads every file there as a Shar field, and ``CutSet.from_shar`` would fail on the index files."""
    shar = any(SHAR_CUTS.match(n) for n in storage.listdir(src, storage_options))
    if shar and out.rstrip("/") == src.rstrip("/"):
        raise ShardifyError(
            f"{src} is a lhotse Shar folder: an index written there would break lhotse's CutSet.from_shar (it "
            "reads every file there as a Shar field); pass --out DIR to write the index elsewhere (it points back at "
            "the tars)"
        )
    return shar


def _add_transcripts(scans: Sequence[ShardScan], texts: dict[str, str]) -> None:
    """Give each audio sample without a transcript of its own the one ``texts`` holds for its key (a Shar cut's)."""
    for scan in scans:
        for s in scan.samples:
            if s.audio is not None and s.text is None and s.key in texts:
                s.text = texts[s.key]


def _check_options(
    layout: str, workers: int, on_error: str, overwrite: bool, progress: bool, manifest: Any, sample_rate: Any
) -> str | None:
    """The options, each checked before a tar is read, as `write_shards()` checks its own; the
    manifest's path (None: found beside the tars)."""
    choice_option("layout", layout, LAYOUTS)
    choice_option("on_error", on_error, ("fail", "skip"))
    int_option("workers", workers, 1, MAX_WORKERS)
    bool_option("overwrite", overwrite)
    bool_option("progress", progress)
    if sample_rate is not None:
        int_option("sample_rate", sample_rate, 1, MAX_SAMPLE_RATE)
    return None if manifest is None else path_option("manifest", manifest, MANIFEST_IS)


def _check_out(out: str, scope: Scope, overwrite: bool, storage_options: dict | None) -> None:
    """Refuse to replace an index in ``out`` unless ``overwrite`` (the tars are never touched)."""
    if storage.is_local(out) and os.path.exists(storage.local_path(out)) and not os.path.isdir(storage.local_path(out)):
        raise ShardifyError(f"{out} exists and is not a folder")
    if not overwrite and storage.exists(storage.join_url(out, scope.index_name), storage_options):
        raise ShardifyError(
            f"{out} already has {scope.index_name}; pass --overwrite to index the tars again "
            "(only the index is replaced, never a tar)"
        )
    storage.makedirs(out, storage_options)


def scan_tars(
    tars: Sequence[str],
    workers: int = 1,
    progress: bool = True,
    storage_options: dict | None = None,
    suffixes: tuple[str, ...] = (),
) -> list[ShardScan]:
    """Read every tar once (in ``workers`` processes); scans in tar order. ``suffixes``: the member suffixes
    that end the keys (`streambatch.format.members`; none: the first dot)."""
    bar = tqdm(total=len(tars), desc="indexing", unit="tar", file=sys.stderr, disable=None if progress else True)
    scans: list[ShardScan] = []
    try:
        if workers <= 1 or len(tars) < 2:
            for url in tars:
                scans.append(scan_tar(url, storage_options, suffixes))
                bar.update()
            return scans
        remote = any(not storage.is_local(u) for u in tars)
        with process_pool(min(workers, len(tars)), remote) as ex:
            for scan in ex.map(scan_tar, tars, [storage_options] * len(tars), [suffixes] * len(tars)):
                scans.append(scan)
                bar.update()
        return scans
    finally:
        bar.close()


def _layout(layout: str, scans: Sequence[ShardScan]) -> str:
    """``auto``: audio when any sample has an audio member, else text when any has a text member (by the members'
    names: a member that does not read is reported as the sample's problem, not as an unknown layout); else the
    first problem found, or an error naming the members seen."""
    if layout != "auto":
        return layout
    samples = [s for scan in scans for s in scan.samples]
    if any(s.audio is not None for s in samples):
        return "audio"
    if any(s.tokens >= 0 or {"txt", "input_ids.npy"} & set(s.exts) for s in samples):
        return "text"
    first = next((scan for scan in scans if scan.samples), None)
    if first is None:
        raise ShardifyError(f"no readable samples in the tars ({scans[0].url}: {scans[0].fatal or 'empty'})")
    bad = next((InputProblem(scan.url, scan.fatal) for scan in scans if scan.fatal), None)
    bad = bad or next((InputProblem(c.url, s.problem) for c in scans for s in c.samples if s.problem), None)
    if bad is not None:
        raise ShardifyError(f"{bad}; nothing was written")
    s = first.samples[0]
    raise ShardifyError(
        f"unknown layout: {first.url} sample {s.key!r} has members "
        f"{', '.join('.' + e for e in s.exts)}; expected audio ({AUDIO_MEMBERS}) or "
        "text (.txt, .input_ids.npy, a .json text); pass --layout, or --manifest for NeMo"
    )


def index_rate(
    scans: Sequence[ShardScan], rows: Sequence[Sequence[Row]], unit: str, sample_rate: int | None
) -> int | None:
    """The index's sample rate: ``sample_rate`` if given, else the one rate of the usable audio members (mixed
    rates are an error when lengths are counted in samples)."""
    first_at: dict[int, str] = {}
    for scan, tar in zip(scans, rows):
        for row in tar:
            s = row.sample
            if s.rate and s.problem is None and not row.unnamed:
                first_at.setdefault(s.rate, f"{scan.url} ({s.key}.{s.audio})")
    if sample_rate:
        return int(sample_rate)
    rates = sorted(first_at)
    if len(rates) > 1 and unit == "samples":
        a, b = rates[:2]
        raise ShardifyError(
            f"mixed sample rates: {first_at[a]} is {a} Hz but {first_at[b]} is {b} Hz; pass "
            "--sample-rate R to count lengths in samples at R"
        )
    return rates[0] if len(rates) == 1 else None


def adopt(
    scans: Sequence[ShardScan],
    rows: Sequence[Sequence[Row]],
    layout: str,
    unit: str,
    rate: int | None,
    out: str,
    extras: SampleExtras | None = None,
) -> Adopted:
    """The index entries of the scanned tars (``rows``: each tar's `tar_rows()`; urls relative to ``out``
    where they can be) and every problem; with ``extras``, their output lengths and metadata columns too."""
    res = Adopted()
    spans: list[tuple[list[int], list[int]]] = []
    for scan, tar in zip(scans, rows):
        if scan.fatal:
            res.problems.append(InputProblem(scan.url, f"{scan.fatal}; the whole tar is left out"))
            continue
        for name, why in scan.dropped:  # no reader reads them: listed, never lost without a word
            res.problems.append(InputProblem(scan.url, f"{name}: {why}; not indexed", key=name))
        lengths, stretch = _lengths(scan, tar, layout, unit, rate, res)
        pairs = [(row.sample, row.entry) for row in tar]
        outs = extras.add(scan.url, pairs, lengths, res.problems) if extras is not None else None
        keys = [row.key for row in tar]
        spans.append(stretch)
        res.infos.append(
            ShardInfo(
                shard_url(scan.url, out),
                len(keys),
                scan.bytes,
                lengths,
                scan.sha256,
                keys_sha1(keys),
                keys=keys,
                offsets=np.asarray([scan.offsets[row.i] for row in tar], np.int64),
                sizes=np.asarray([scan.sizes[row.i] for row in tar], np.int64),
                output_lengths=outs,
            )
        )
    if extras is not None:
        res.columns = extras.columns(res.infos)
    if res.segments:  # which stretch of its member each row is: the readers decode only that
        res.columns.update({SEGMENT_START: "int64", SEGMENT_FRAMES: "int64"})
        for info, (first, frames) in zip(res.infos, spans):
            info.columns = {**(info.columns or {}), SEGMENT_START: first, SEGMENT_FRAMES: frames}
    return res


def _lengths(
    scan: ShardScan, rows: Sequence[Row], layout: str, unit: str, rate: int | None, res: Adopted
) -> tuple[np.ndarray, tuple[list[int], list[int]]]:
    """One tar's sample lengths (0: left out; the problems, unnamed members and segments counted in ``res``), and
    each row's stretch of its member: first frames and frame counts (`WHOLE`: all of it)."""
    lengths = np.zeros(len(rows), dtype=np.float64 if unit == "seconds" else np.int64)
    first, frames = [0] * len(rows), [WHOLE] * len(rows)
    for r, row in enumerate(rows):
        if row.unnamed:
            res.unnamed += 1
            continue
        got = sample_length(row.sample, layout, unit, rate, row.entry, row.segment)
        if isinstance(got, str):
            res.problems.append(InputProblem(scan.url, got, key=row.key))
            continue
        length, stretch = got
        lengths[r] = length
        if stretch is not None:
            first[r], frames[r] = stretch
            res.segments += 1
    return lengths, (first, frames)


def shard_url(tar: str, out: str) -> str:
    """The tar's url as the index in ``out`` lists it: its name when beside the index, a relative path when
    both are local, else its full URL."""
    if storage.parent_url(tar).rstrip("/") == out.rstrip("/"):
        return tar.rstrip("/").rsplit("/", 1)[-1]
    if (
        storage.is_local(tar)
        and storage.is_local(out)
        and not tar.startswith("file://")
        and not out.startswith("file://")
    ):
        return os.path.relpath(os.path.abspath(tar), os.path.abspath(out)).replace(os.sep, "/")
    return tar


def _report(problems: Sequence[InputProblem], on_error: str) -> None:
    """With ``on_error="fail"``, the first problem as one line (and how many more)."""
    if problems and on_error == "fail":
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ShardifyError(
            f"{problems[0]}{more}; nothing was written: pass --on-error skip to index the rest "
            "(the samples left out are listed in errors.jsonl)"
        )


def _meta(
    src: str,
    layout: str,
    manifests: list[str],
    adopted: Adopted,
    tars: Sequence[str],
    part: tuple[int, int] | None,
    num_tars: int,
    on_error: str,
) -> dict[str, Any]:
    left_out = sum(int(len(i.lengths) - np.count_nonzero(i.lengths)) for i in adopted.infos)
    meta: dict[str, Any] = {
        "source": os.path.abspath(src) if storage.is_local(src) else src,
        "kind": "adopted",
        "adopted": {
            "layout": layout,
            "left_out": left_out,
            "unnamed": adopted.unnamed,
            "segments": adopted.segments,
            "manifests": [os.path.abspath(m) if storage.is_local(m) else m for m in manifests],
        },
        "created": utc_now(),
        "skipped": len(adopted.problems),
    }
    if part is not None:
        a, b = part_range(num_tars, *part)
        meta["part"] = {
            "index": part[0],
            "count": part[1],
            "records": [a, b],
            "num_records": num_tars,
            "on_error": on_error,
        }
    return meta


def _save(index: ShardIndex, url: str, storage_options: dict | None) -> None:
    """Write the index; a folder that cannot be written (read-only storage) is one clear line."""
    try:
        index.save(url, storage_options)
    except OSError as e:
        if not isinstance(e, PermissionError) and e.errno != errno.EROFS:
            raise
        raise _unwritable(storage.parent_url(url), e) from None
