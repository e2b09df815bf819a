"""Parts (``--part I/N``), the output folder's files, and ``shardify merge``.

Task I of N writes the I-th contiguous slice of the record list as ``shard-pIIII-*.tar`` plus its own
``index.part-IIII.json``; `merge_parts()` checks that all N parts are there and from the same run and
writes ``index.json``. Which files in OUT belong to which write (a whole dataset or one part) decides what
``--overwrite`` removes, what ``--resume`` keeps and what a part may share its folder with.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ShardifyError, output_fits
from ..format.columnar_write import source_date_epoch
from ..format.columns import ColumnError, merged_columns
from ..format.index import INDEX_NAME, ShardIndex, ShardInfo
from ..format.rules import (
    ERRORS_NAME,
    OUR_FILES,
    PART_ERRORS_NAME,
    PART_INDEX_GLOB,
    PART_INDEX_NAME,
    PART_SHARD_NAME,
    SHARD_NAME,
)
from ..io import storage
from ..io.lock import holds_lock, is_lock_file
from ..units import Unit
from .restore import clear_kept, restored_on_failure
from .verify import verify_dataset

_PART_FILE_RE = re.compile(
    r"^(?:shard-p(\d+)-\d+\.tar|index\.part-(\d+)(?:\.json|\.shards\.parquet|\.samples)"
    r"|errors\.part-(\d+)\.jsonl)(?:\.tmp-.*)?$"
)
_SINGLE_FILE_RE = re.compile(
    r"^(?:shard-\d+\.tar|index(?:\.json|\.shards\.parquet|\.samples)|errors\.jsonl)"
    r"(?:\.tmp-.*)?$"
)
#: the name (or start of the name) of the folder in OUT where ``--overwrite`` keeps the dataset it replaces
ASIDE_PREFIX = ".shardify-replaced"
#: index fields that every part of one run must share, and that a ``--resume`` compares with the dataset in OUT
SAME_RUN_FIELDS = ("source", "kind", "shuffle", "seed", "max_count", "max_size", "tokenizer", "output_length")


# ---- parts and the files they make -------------------------------------------------------------
def part_of(name: str) -> int | None:
    """The part number of a file a ``--part`` write makes (its shards, part index, part errors, their
    temporary files), else None."""
    m = _PART_FILE_RE.match(name)
    return None if m is None else int(next(g for g in m.groups() if g is not None))


def parse_part(part: str | Sequence[int] | None) -> tuple[int, int] | None:
    """``"3/8"`` or ``(3, 8)`` → ``(3, 8)``: task 3 of 8, counted from 0 (``SLURM_ARRAY_TASK_ID`` of an array
    ``0-7``)."""
    if part is None:
        return None
    try:
        if isinstance(part, str):
            a, sep, b = part.partition("/")
            if not sep:
                raise ValueError
            i, n = int(a), int(b)
        else:
            i, n = (int(x) for x in part)
    except (TypeError, ValueError):
        raise ShardifyError(f"part must be I/N (task I of N, I from 0 to N-1), not {part!r}") from None
    if n <= 0 or not 0 <= i < n:
        raise ShardifyError(f"part {i}/{n}: I must be between 0 and N-1 (task I of N, counted from 0)")
    return i, n


def part_range(num: int, i: int, n: int) -> tuple[int, int]:
    """The records of part i of n: the i-th of n contiguous slices, as equal as can be."""
    return num * i // n, num * (i + 1) // n


@dataclass(frozen=True)
class Scope:
    """The files one ``write`` makes: a whole dataset, or one part of it."""

    part: tuple[int, int] | None = None

    def shard_name(self, j: int) -> str:
        return SHARD_NAME.format(j) if self.part is None else PART_SHARD_NAME.format(self.part[0], j)

    @property
    def index_name(self) -> str:
        return INDEX_NAME if self.part is None else PART_INDEX_NAME.format(self.part[0])

    @property
    def errors_name(self) -> str:
        return ERRORS_NAME if self.part is None else PART_ERRORS_NAME.format(self.part[0])

    def owns(self, name: str) -> bool:
        if self.part is None:
            return _SINGLE_FILE_RE.match(name) is not None
        return part_of(name) == self.part[0]

    def is_shard(self, name: str) -> bool:
        return self.owns(name) and name.endswith(".tar")


# ---- the output folder -------------------------------------------------------------------------
def _is_ours(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pat) for pat in OUR_FILES)


def is_aside(name: str) -> bool:
    """Whether a name in OUT is a folder where a running (or killed) ``--overwrite`` keeps the dataset it replaces
    (`aside`), or one being discarded: not part of any dataset, handled before OUT is checked."""
    return name.startswith(ASIDE_PREFIX)


def replaced_names(names: Sequence[str], part: tuple[int, int] | None = None) -> list[str]:
    """The names in a listing of OUT that ``--overwrite`` replaces, index files first (so no index ever lists a
    removed shard): every file of streambatch's own; for a part, the merged index, the part's own files, the
    whole-dataset files and parts numbered N or more (left by a run with more parts), not the other parts'."""
    if part is None:
        names = [m for m in names if _is_ours(m)]
    else:
        i, n = part
        names = [m for m in names if _SINGLE_FILE_RE.match(m) or part_of(m) == i or (part_of(m) or 0) >= n]
    first = (INDEX_NAME, ERRORS_NAME)
    return sorted(names, key=lambda m: (m not in first, not m.endswith(".json")))


def remove_quiet(url: str, storage_options: dict | None) -> None:
    """Remove a file (or an index's sample-table folder) another process (a concurrent part) may remove at
    the same time."""
    try:
        storage.remove(url, storage_options, recursive=url.rstrip("/").endswith(".samples"))
    except FileNotFoundError:
        pass


def check_out(
    out: str,
    overwrite: bool,
    storage_options: dict | None = None,
    part: tuple[int, int] | None = None,
    resume: bool = False,
) -> None:
    """Refuse a non-empty ``out`` unless ``overwrite``. A part may share ``out`` with the other parts' files;
    ``resume`` accepts this write's own files (a whole dataset: anything already in ``out``)."""
    if storage.is_local(out) and os.path.exists(storage.local_path(out)) and not os.path.isdir(storage.local_path(out)):
        raise ShardifyError(f"{out} exists and is not a folder")
    if overwrite:
        return
    names = [m for m in storage.listdir(out, storage_options) if not (is_lock_file(m) or is_aside(m))]
    if part is None:
        if names and not resume:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise ShardifyError(
                f"{out} is not empty ({shown}); pass --overwrite to replace the dataset there, or "
                "--resume to finish an interrupted write"
            )
        if resume and INDEX_NAME not in names and any(part_of(m) is not None for m in names):
            raise ShardifyError(
                f"{out} holds the parts of a `shardify write --part I/N` run, not yet merged: finish them with "
                f"`--part I/N --resume` and `shardify merge {out}`, or pass --overwrite to write the dataset whole"
            )
        return
    i, n = part
    if resume and INDEX_NAME in names:
        raise ShardifyError(
            f"{out} already holds the merged dataset ({INDEX_NAME}); pass --overwrite to write part {i}/{n} again"
        )
    scope = Scope(part)
    taken = [m for m in names if not (part_of(m) is not None and (part_of(m) != i or resume and scope.owns(m)))]
    if taken:
        shown = ", ".join(taken[:3]) + (", ..." if len(taken) > 3 else "")
        hint = (
            "pass --resume to finish an interrupted part, or --overwrite to write it again"
            if any(scope.owns(m) for m in taken)
            else "pass --overwrite to replace the dataset there"
        )
        raise ShardifyError(f"{out} holds files other than the other parts' ({shown}); {hint}")


def clear_out(out: str, storage_options: dict | None = None, part: tuple[int, int] | None = None) -> None:
    """Remove what a previous run wrote (`replaced_names()`, index first). ``--overwrite`` does this where it
    cannot set the old dataset aside (object storage; `aside`)."""
    for m in replaced_names(storage.listdir(out, storage_options), part):
        remove_quiet(storage.join_url(out, m), storage_options)


def prepare_resume(out: str, scope: Scope, planned: set[str], storage_options: dict | None) -> None:
    """Before a resumed write: remove the (stale) index first, then temporary files and shards that are
    not in this run's plan; planned shards stay to be checked and kept."""
    names = [m for m in storage.listdir(out, storage_options) if scope.owns(m)]
    if scope.index_name in names:
        storage.remove(storage.join_url(out, scope.index_name), storage_options)
    for m in names:
        if m != scope.index_name and m != scope.errors_name and m not in planned:
            remove_quiet(storage.join_url(out, m), storage_options)


def write_errors(url: str, rows: Sequence[dict[str, Any]], storage_options: dict | None, remove_stale: bool) -> None:
    """Write the skipped inputs as JSON lines to ``url`` (an errors file); with none, remove a stale one
    when ``remove_stale``."""
    if rows:
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
        with output_fits(url):
            storage.write_bytes_atomic(url, data, storage_options)
    elif remove_stale:
        remove_quiet(url, storage_options)


def utc_now() -> str:
    """The ``created`` time of an index: UTC, to the second (``SOURCE_DATE_EPOCH`` when set: reproducible output)."""
    epoch, utc = source_date_epoch(), datetime.timezone.utc
    when = datetime.datetime.now(utc) if epoch is None else datetime.datetime.fromtimestamp(epoch, utc)
    return when.isoformat(timespec="seconds")


# ---- merging parts -----------------------------------------------------------------------------
def find_parts(out: str, storage_options: dict | None = None) -> list[str]:
    """URLs of the part indexes (``index.part-*.json``) in ``out``."""
    names = [m for m in storage.listdir(out, storage_options) if fnmatch.fnmatch(m, PART_INDEX_GLOB)]
    return [storage.join_url(out, m) for m in names]


@holds_lock(lambda a: (str(a.arguments["out"]), None, a.arguments["storage_options"]))
def merge_parts(
    out: str,
    parts: Sequence[str] | None = None,
    storage_options: dict | None = None,
    verify: bool = False,
    progress: bool = True,
    shard_roots: Sequence[str] = (),
) -> ShardIndex:
    """Merge the part indexes of a ``--part i/n`` run into ``out/index.json`` (and ``errors.jsonl``, written
    first: a merge that fails writing the index leaves the pair that was there, ``errors.jsonl`` put back).

    ``parts``: the part index files (default: every ``index.part-*.json`` in ``out``). All n parts must be
    there, once each, written from the same source with the same options; a missing part is an error that
    names it. The shards the parts list must exist (``verify=True`` re-reads them all, as ``shardify verify``)
    and lie beside their part index or under ``shard_roots`` (`trust`).
    """
    out = str(out).rstrip("/") or "/"
    ordered = _all_parts(out, _load_parts(out, parts, storage_options, shard_roots))
    _check_same_run(ordered)
    merged = _merged_index(out, ordered)
    check_shards_there(merged, out, storage_options)
    if verify:
        problems = verify_dataset(merged, storage_options, progress=progress)
        if problems:
            raise ShardifyError(
                f"{len(problems)} shard problems, index.json not written:\n  " + "\n  ".join(problems[:20])
            )
    errors = storage.join_url(out, ERRORS_NAME)
    clear_kept(errors)
    with restored_on_failure(errors, storage_options):  # the pair changes together: index.json last
        write_errors(errors, _merged_errors(out, ordered, storage_options), storage_options, remove_stale=True)
        merged.save(storage.join_url(out, INDEX_NAME), storage_options)
    return merged


def _load_parts(
    out: str, parts: Sequence[str] | None, storage_options: dict | None, shard_roots: Sequence[str] = ()
) -> list[tuple[str, ShardIndex]]:
    """(url, index) of each part index given (default: found in ``out``); each must be a part index."""
    urls = list(parts) if parts else find_parts(out, storage_options)
    if not urls:
        raise ShardifyError(
            f"{out}: no part indexes ({PART_INDEX_GLOB}); write the parts first with "
            "`shardify write SRC OUT --part I/N` for I = 0 .. N-1"
        )
    loaded: list[tuple[str, ShardIndex]] = []
    for url in urls:
        try:
            ix = ShardIndex.load(url, storage_options, shard_roots)
        except FileNotFoundError as e:
            raise ShardifyError(str(e)) from None
        except ValueError as e:  # named once: the index's own messages start with its file
            raise ShardifyError(str(e) if str(e).startswith(url) else f"{url}: {e}") from None
        if not isinstance(ix.meta.get("part"), dict):
            raise ShardifyError(f"{url} is not a part index (written by `shardify write --part I/N`)")
        _check_part_fields(url, ix.meta["part"])
        loaded.append((url, ix))
    return loaded


def _is_whole(value: Any, low: int, high: int | None = None) -> bool:
    """Whether ``value`` is an int (not a bool) from ``low`` to ``high`` (no upper bound when None)."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value and (high is None or value <= high)


def _part_field_problem(url: str, pm: dict[str, Any]) -> tuple[str, str] | None:
    """The first field of a part index's ``meta.part`` that is not as ``write --part`` writes it (of the wrong type,
    out of range, a part number other than its file name's): (field, what it should be); None when all are."""
    count: Any = pm.get("count")
    index, num, span = pm.get("index"), pm.get("num_records"), pm.get("records")
    named = _PART_FILE_RE.match(url.rstrip("/").rsplit("/", 1)[-1])
    if not _is_whole(count, 1):
        return "count", "a whole number of parts, at least 1"
    if not _is_whole(index, 0, count - 1):
        return "index", f"a whole number from 0 to {count - 1} (part I of N = {count}, counted from 0)"
    if named is not None and named.group(2) is not None and int(named.group(2)) != index:
        return "index", f"{int(named.group(2))}, the part its file is named for"
    if not _is_whole(num, 0):
        return "num_records", "a whole number of records, at least 0"
    if not (isinstance(span, list) and len(span) == 2 and _is_whole(span[0], 0, num) and _is_whole(span[1], 0, num)):
        return "records", f"[first, end]: two whole numbers from 0 to num_records ({num})"
    return None


def _check_part_fields(url: str, pm: dict[str, Any]) -> None:
    """Refuse a part index whose ``meta.part`` is malformed, naming the file and the field."""
    problem = _part_field_problem(url, pm)
    if problem is not None:
        field, expected = problem
        got = f"is {pm[field]!r}" if field in pm else "is missing"
        raise ShardifyError(
            f"{url}: malformed part index: meta.part.{field} {got}, expected {expected}; "
            "write that part again with `shardify write SRC OUT --part I/N --overwrite`"
        )


def _all_parts(out: str, loaded: list[tuple[str, ShardIndex]]) -> list[tuple[str, ShardIndex]]:
    """The parts in order 0 .. n-1: all of one run, each once, none missing."""
    counts = sorted({ix.meta["part"]["count"] for _, ix in loaded})
    if len(counts) > 1:
        raise ShardifyError(
            f"{out}: part indexes of different runs (of {' and '.join(map(str, counts))} parts); "
            "remove the stale ones or list the parts to merge"
        )
    n = counts[0]
    by_part: dict[int, tuple[str, ShardIndex]] = {}
    for url, ix in loaded:
        i = ix.meta["part"]["index"]
        if i in by_part:
            raise ShardifyError(f"part {i}/{n} given twice: {by_part[i][0]} and {url}")
        by_part[i] = (url, ix)
    missing = [i for i in range(n) if i not in by_part]
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (", ..." if len(missing) > 20 else "")
        raise ShardifyError(
            f"{out}: {len(missing)} of {n} parts missing (part {shown}: no {PART_INDEX_NAME.format(missing[0])}"
            f"{', ...' if len(missing) > 1 else ''}); those tasks did not finish: run them again with "
            f"`shardify write SRC {out} --part I/{n} --resume` (or resubmit those array tasks), then merge"
        )
    return [by_part[i] for i in range(n)]


def _check_same_run(ordered: list[tuple[str, ShardIndex]]) -> None:
    """Every part was written with the same options from the same records (same count, its own slice)."""
    n = len(ordered)
    first_url, first = ordered[0]
    num_records = first.meta["part"]["num_records"]
    for url, ix in ordered:
        pm = ix.meta["part"]
        for k in SAME_RUN_FIELDS:
            if ix.meta.get(k) != first.meta.get(k):
                raise ShardifyError(
                    f"{url} was written with {k}={ix.meta.get(k)!r} but {first_url} with "
                    f"{first.meta.get(k)!r}: the parts are not from the same run"
                )
        if ix.unit != first.unit or pm.get("on_error") != first.meta["part"].get("on_error"):
            raise ShardifyError(f"{url} and {first_url} differ in unit or --on-error: not from the same run")
        if pm["num_records"] != num_records or list(pm["records"]) != list(part_range(num_records, pm["index"], n)):
            raise ShardifyError(
                f"{url} holds records {pm['records']} of {pm['num_records']}, not part "
                f"{pm['index']}/{n} of the {num_records} records the others saw (did the source "
                "change between tasks?)"
            )


def _merged_index(out: str, ordered: list[tuple[str, ShardIndex]]) -> ShardIndex:
    """One index of every part's shards in part order: one sample rate, the first part's meta."""
    n = len(ordered)
    first = ordered[0][1]
    rates = {ix.sample_rate for _, ix in ordered if ix.num_samples}
    if len(rates) > 1 and first.unit is Unit.SAMPLES:
        listed = ", ".join(str(r) for r in sorted(rates, key=lambda r: r or 0))
        raise ShardifyError(
            f"the parts have different sample rates ({listed} Hz): the source "
            "mixes sample rates; write every part with --sample-rate R to count lengths in samples at R"
        )
    sample_rate = rates.pop() if len(rates) == 1 else None
    if sum(ix.num_samples for _, ix in ordered) == 0:
        raise ShardifyError(f"{out}: the {n} parts hold no samples")
    meta = {k: v for k, v in first.meta.items() if k != "part"}
    meta["created"] = utc_now()
    meta["skipped"] = int(sum(ix.meta.get("skipped", 0) for _, ix in ordered))
    meta["parts"] = n
    try:  # every part's metadata columns (null in the parts without one), so the filters work on the whole
        columns = merged_columns([ix.columns for _, ix in ordered], [url for url, _ in ordered])
    except ColumnError as e:
        raise ShardifyError(str(e)) from None
    return ShardIndex(
        shards=_merged_shards(out, ordered),
        unit=first.unit,
        sample_rate=sample_rate,
        root=out,
        meta=meta,
        columns=columns,
    )


def _merged_shards(out: str, ordered: list[tuple[str, ShardIndex]]) -> list[ShardInfo]:
    """Every part's shards; urls relative where the part index sits in ``out``, else absolute."""
    shards = []
    out_key = _folder_key(out)
    for _, ix in ordered:
        same = _folder_key(ix.root or "") == out_key
        for info, abs_url in zip(ix.shards, ix.shard_urls()):
            info.url = info.url if same else abs_url
            shards.append(info)
    seen: set[str] = set()
    for info in shards:
        if info.url in seen:
            raise ShardifyError(f"shard {info.url} is listed by two parts")
        seen.add(info.url)
    return shards


def missing_shard(index: ShardIndex, out: str, storage_options: dict | None) -> str | None:
    """The URL of the first shard ``index`` lists that is not there (None when every one is)."""
    present = set(storage.listdir(out, storage_options))
    for info, url in zip(index.shards, index.shard_urls()):
        there = info.url in present if info.url == os.path.basename(info.url) else storage.exists(url, storage_options)
        if not there:
            return url
    return None


def check_shards_there(merged: ShardIndex, out: str, storage_options: dict | None) -> None:
    """Refuse a merged index that lists a shard not there, naming it."""
    url = missing_shard(merged, out, storage_options)
    if url is not None:
        raise ShardifyError(f"{url} is listed by a part index but missing; run that part again with --resume")


def _merged_errors(out: str, ordered: list[tuple[str, ShardIndex]], storage_options: dict | None) -> list[dict]:
    """Every part's skipped inputs, in the order a single-process write lists them."""
    rows: list[dict[str, Any]] = []
    for _, ix in ordered:
        if ix.meta.get("skipped"):
            eurl = storage.join_url(ix.root or out, PART_ERRORS_NAME.format(ix.meta["part"]["index"]))
            with storage.open_url(eurl, "rb", storage_options) as f:
                rows += [json.loads(line) for line in f.read().decode("utf-8").splitlines() if line.strip()]
    rows.sort(key=lambda r: (r["source"], r["line"] if r.get("line") is not None else 0))
    return rows


def _folder_key(url: str) -> str:
    url = str(url).rstrip("/")
    return os.path.abspath(storage.local_path(url)) if storage.is_local(url) else url
