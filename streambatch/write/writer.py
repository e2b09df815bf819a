"""Length-annotated shard writing: the ``shardify write`` pipeline, and ``verify`` of what it wrote.

Stages, each a plain function:
  ``read_source``   (sources.py) SRC → records + input problems
  ``measure``       records → samples: length probed from audio headers (never decoded) or counted in
                    tokens, the tar members each sample will have, and more problems
  ``plan_shards``   sample sizes → which samples go in which shard, decided before writing, so the output
                    is the same whatever ``workers`` is
  ``write_shard``   one shard: a local temporary file, then an atomic rename or one whole upload
  ``ShardIndex.save``  ``index.json``, written last

``verify.py`` re-reads what this module wrote and checks it against the index.

Parts (``write_shards(..., part=(i, n))``, ``shardify write --part i/n``): task i of n takes the i-th contiguous
slice of the same ordered (optionally shuffled) record list a single-process write uses, writes its shards as
``shard-pIIII-JJJJJJ.tar`` and its own ``index.part-IIII.json`` (last); :func:`merge_parts`
(``shardify merge``) checks that all n parts are there and consistent and writes ``index.json``. The merged
dataset has the same samples, in the same order, with the same lengths, json and payload bytes as a
single-process write; only the shard boundaries (each part's last shard may be short) and names differ.

Resume (``resume=True``, ``shardify write --resume``): the shard plan is deterministic, so a re-run keeps each
planned shard already in OUT whose bytes equal what it would write (size first, then a byte-for-byte
comparison while the tar is regenerated, which also yields its sha256) and writes only the others.

Shard format: a plain POSIX (pax) tar; per sample ``KEY.json`` first (``{"length": N, ...}``), then the
payload members in name order (``KEY.flac`` with the original bytes, or ``KEY.input_ids.npy`` / ``KEY.txt``).
Members have mtime 0, uid/gid 0 and empty owner names, so the same input and seed give byte-identical shards.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import fnmatch
import hashlib
import io
import json
import multiprocessing
import os
import re
import sys
import tarfile
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from ..dataset import storage
from ..dataset.audio import AudioError, probe
from ..errors import InputErrors, InputProblem, ShardifyError
from ..dataset.index import INDEX_NAME, ShardIndex, ShardInfo
from .sources import KINDS, Record, detect_kind, read_source, token_length

SHARD_NAME = "shard-{:06d}.tar"
ERRORS_NAME = "errors.jsonl"
PART_SHARD_NAME = "shard-p{:04d}-{:06d}.tar"
PART_INDEX_NAME = "index.part-{:04d}.json"
PART_ERRORS_NAME = "errors.part-{:04d}.jsonl"
PART_INDEX_GLOB = "index.part-*.json"
#: the files ``--overwrite`` removes: only what this writer makes
OUR_FILES = ("shard-*.tar", INDEX_NAME, ERRORS_NAME, "index.part-*.json", "errors.part-*.jsonl", "*.tmp*")
UNITS = ("samples", "seconds", "tokens")
DEFAULT_MAX_COUNT = 1000
DEFAULT_MAX_SIZE = "1G"
TAR_FORMAT = tarfile.PAX_FORMAT
BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE

# ---- sizes -------------------------------------------------------------------------------------
def parse_size(size: int | str) -> int:
    """Bytes from ``123456``, ``"500M"``, ``"2G"``, ``"1.5GiB"`` (K, M, G, T are powers of 1024); positive."""
    try:
        n = storage.parse_bytes(int(size) if isinstance(size, np.integer) else size, "size")
    except ValueError as e:
        raise ShardifyError(str(e)) from None
    if not n or n <= 0:
        raise ShardifyError(f"size must be positive, got {size!r}")
    return n


# ---- samples and their tar members -------------------------------------------------------------
@dataclass
class Member:
    """One tar member: ``data`` in memory, or the file at ``path`` (copied byte for byte)."""

    name: str
    size: int
    data: bytes | None = None
    path: str | None = None


@dataclass
class Sample:
    key: str
    length: int | float
    members: list[Member]

    @property
    def tar_bytes(self) -> int:
        return sum(member_tar_bytes(m.name, m.size) for m in self.members)


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.type = size, 0, 0o644, tarfile.REGTYPE
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def member_tar_bytes(name: str, size: int) -> int:
    """Exact bytes a member takes in our tar: its header block(s) plus the data padded to 512."""
    header = len(_tarinfo(name, size).tobuf(TAR_FORMAT, "utf-8", "surrogateescape"))
    return header + -(-size // BLOCK) * BLOCK


def shard_tar_bytes(sample_bytes: int) -> int:
    """Size of a tar holding members of ``sample_bytes`` in all: two end blocks, padded to a record."""
    return -(-(sample_bytes + 2 * BLOCK) // RECORD) * RECORD


def _json_bytes(d: dict[str, Any]) -> bytes:
    return json.dumps(d, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _with_fields(d: dict[str, Any], fields: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Add a source's fields; one that would overwrite ours keeps its value as ``source_<name>``."""
    for k, v in fields.items():
        if k in skip:
            continue
        d["source_" + k if k in d else k] = v
    return d


def _members(key: str, meta: dict[str, Any], payload: list[Member]) -> list[Member]:
    j = _json_bytes(meta)
    return [Member(f"{key}.json", len(j), data=j)] + sorted(payload, key=lambda m: m.name)


def audio_sample(rec: Record, length: int | float, sample_rate: int, frames: int, nbytes: int) -> Sample:
    meta: dict[str, Any] = {"length": length, "sample_rate": sample_rate}
    meta["duration"] = rec.fields["duration"] if "duration" in rec.fields else round(frames / sample_rate, 6)
    if rec.text is not None:
        meta["text"] = rec.text
    _with_fields(meta, rec.fields, skip=("duration",))
    payload = [Member(f"{rec.key}.{rec.ext}", nbytes, path=rec.path)]
    return Sample(rec.key, length, _members(rec.key, meta, payload))


def text_sample(rec: Record, length: int) -> Sample:
    meta = _with_fields({"length": length}, rec.fields)
    payload = []
    if rec.text is not None:
        payload.append(Member(f"{rec.key}.txt", 0, data=rec.text.encode("utf-8")))
    if rec.input_ids is not None:
        buf = io.BytesIO()
        np.save(buf, np.asarray(rec.input_ids, dtype=np.int32))
        payload.append(Member(f"{rec.key}.input_ids.npy", 0, data=buf.getvalue()))
    for m in payload:
        m.size = len(m.data)
    return Sample(rec.key, length, _members(rec.key, meta, payload))


# ---- stage: measure ----------------------------------------------------------------------------
def check_unit(kind: str, unit: str | None, sample_rate: int | None) -> str:
    """The dataset's length unit: ``samples`` (audio default), ``seconds``, or ``tokens`` (text)."""
    text = kind == "text"
    unit = unit or ("tokens" if text else "samples")
    if unit not in UNITS:
        raise ShardifyError(f"unknown unit {unit!r}; choose one of {', '.join(UNITS)}")
    if text and unit != "tokens":
        raise ShardifyError(f"a text source is measured in tokens, not {unit}")
    if not text and unit == "tokens":
        raise ShardifyError("an audio source is measured in samples or seconds, not tokens")
    if sample_rate is not None and (text or int(sample_rate) <= 0):
        raise ShardifyError("--sample-rate needs an audio source and a positive rate")
    return unit


def probe_file(path: str, storage_options: dict | None = None) -> tuple[int, int, int] | str:
    """``(sample_rate, frames, bytes)`` of an audio file from its header only, or what is wrong with it."""
    try:
        with storage.open_url(path, "rb", storage_options) as f:
            nbytes = os.fstat(f.fileno()).st_size if storage.is_local(path) else storage.size(path, storage_options)
            if nbytes == 0:
                return "empty audio file (0 bytes)"
            info = probe(f)
    except FileNotFoundError:
        return "audio file not found"
    except IsADirectoryError:
        return "audio path is a folder"
    except OSError as e:
        return f"cannot read audio file ({e.strerror or e})"
    except AudioError as e:
        msg = (str(e.__cause__ or e).strip().splitlines() or ["?"])[-1]
        msg = re.sub(r"^Error opening <.*?>: ", "", msg)
        if "header reports" in msg:
            return "audio file has no frames"
        return f"not readable audio ({msg.rstrip('.')})"
    if info.frames <= 0:
        return "audio file has no frames"
    return info.sample_rate, info.frames, nbytes


def _probe_one(args: tuple[str, dict | None]) -> tuple[int, int, int] | str:
    return probe_file(*args)


def _pool(workers: int, remote: bool) -> cf.ProcessPoolExecutor:
    # fsspec object-store filesystems are not fork-safe: start fresh processes for remote I/O
    ctx = multiprocessing.get_context("spawn") if remote else None
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)


def probe_records(
    records: Sequence[Record], workers: int = 1, progress: bool = True, storage_options: dict | None = None
) -> list[tuple[int, int, int] | str]:
    """Probe every record's audio header (in ``workers`` processes); results in record order."""
    args = [(r.path, storage_options) for r in records]
    bar = tqdm(total=len(args), desc="probing", unit="file", file=sys.stderr, disable=None if progress else True)
    try:
        if workers <= 1 or len(args) < 2:
            results = []
            for a in args:
                results.append(_probe_one(a))
                bar.update()
            return results
        remote = any(not storage.is_local(r.path) for r in records)
        with _pool(workers, remote) as ex:
            results = []
            for res in ex.map(_probe_one, args, chunksize=max(1, min(256, len(args) // (workers * 8)))):
                results.append(res)
                bar.update()
            return results
    finally:
        bar.close()


def _resampled(frames: int, sr: int, target: int) -> int:
    """``round(frames * target / sr)`` in exact integer arithmetic (halves round up)."""
    return frames if sr == target else (2 * frames * target + sr) // (2 * sr)


def measure(
    records: Sequence[Record], kind: str, unit: str, sample_rate: int | None = None, workers: int = 1,
    progress: bool = True, storage_options: dict | None = None, on_error: str = "fail",
) -> tuple[list[Sample], list[InputProblem], int | None]:
    """Lengths and tar members of every record: ``(samples, problems, index sample rate)``.

    Audio lengths come from the header (frames at the file's rate, resampled to ``sample_rate`` when
    given); mixed rates in ``samples`` without ``sample_rate`` raise ``ShardifyError`` naming two files.
    """
    problems: list[InputProblem] = []
    samples: list[Sample] = []
    if kind == "text":
        for rec in records:
            n = token_length(rec)
            if n <= 0:
                problems.append(rec.problem("empty text (0 tokens)"))
            else:
                samples.append(text_sample(rec, n))
        return samples, problems, None

    probed = []
    for rec, res in zip(records, probe_records(records, workers, progress, storage_options)):
        if isinstance(res, str):  # name the audio file unless the problem is reported at it already
            problems.append(rec.problem(res if rec.where == rec.path else f"{res}: {rec.path}"))
        else:
            probed.append((rec, *res))
    if problems and on_error == "fail":
        return [], problems, None
    first_at: dict[int, str] = {}
    for rec, sr, _, _ in probed:
        first_at.setdefault(sr, rec.path if rec.where == rec.path else f"{rec.path} ({rec.where})")
    rates = sorted(first_at)
    if sample_rate is None and len(rates) > 1 and unit == "samples":
        (a, b) = rates[:2]
        raise ShardifyError(
            f"mixed sample rates: {first_at[a]} is {a} Hz but {first_at[b]} is {b} Hz "
            f"(rates found: {', '.join(map(str, rates))}); pass --sample-rate R to count lengths in samples at R"
        )
    index_rate = int(sample_rate) if sample_rate else (rates[0] if len(rates) == 1 else None)
    for rec, sr, frames, nbytes in probed:
        if unit == "samples":
            length: int | float = _resampled(frames, sr, index_rate)
            if length <= 0:
                problems.append(rec.problem(f"{frames} frames at {sr} Hz is 0 samples at {index_rate} Hz"))
                continue
        else:
            length = frames / sr
        samples.append(audio_sample(rec, length, sr, frames, nbytes))
    return samples, problems, index_rate


# ---- stage: plan -------------------------------------------------------------------------------
def plan_shards(sample_bytes: Sequence[int], max_count: int, max_size: int) -> list[tuple[int, int]]:
    """Split samples (in write order) into shards: ``[(start, stop), ...]``. A shard takes samples while it
    has fewer than ``max_count`` and its tar stays within ``max_size`` bytes; a sample bigger than
    ``max_size`` gets a shard of its own."""
    plan, start, acc = [], 0, 0
    for i, b in enumerate(sample_bytes):
        if i > start and (i - start >= max_count or shard_tar_bytes(acc + b) > max_size):
            plan.append((start, i))
            start, acc = i, 0
        acc += b
    if len(sample_bytes) > start:
        plan.append((start, len(sample_bytes)))
    return plan


# ---- stage: write ------------------------------------------------------------------------------
@dataclass
class ShardTask:
    name: str
    url: str
    samples: list[Sample]
    storage_options: dict | None = None
    #: keep a shard already at ``url`` when its bytes are exactly what this task would write
    resume: bool = False

    @property
    def planned_bytes(self) -> int:
        return shard_tar_bytes(sum(s.tar_bytes for s in self.samples))


class _HashingWriter:
    def __init__(self, f):
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def write(self, b: bytes) -> int:
        self.f.write(b)
        self.h.update(b)
        self.n += len(b)
        return len(b)

    def tell(self) -> int:
        return self.n


def _write_tar(f, samples: Sequence[Sample], storage_options: dict | None) -> str:
    """Write the samples as a tar to the open file ``f``; returns the sha256 of the bytes written."""
    hw = _HashingWriter(f)
    with tarfile.open(fileobj=hw, mode="w", format=TAR_FORMAT, encoding="utf-8") as tar:
        for s in samples:
            for m in s.members:
                ti = _tarinfo(m.name, m.size)
                if m.data is not None:
                    tar.addfile(ti, io.BytesIO(m.data))
                    continue
                with storage.open_url(m.path, "rb", storage_options) as src:
                    if storage.is_local(m.path) and os.fstat(src.fileno()).st_size != m.size:
                        raise ShardifyError(f"{m.path}: the file changed size while shards were being written")
                    tar.addfile(ti, src)
    return hw.h.hexdigest()


def write_shard(task: ShardTask) -> ShardInfo:
    """Write one shard so it appears only complete: a temporary file beside it (local) then ``os.replace``,
    or a local temporary file uploaded whole (object stores)."""
    local = storage.is_local(task.url)
    if local:
        dst = storage.local_path(task.url)
        tmp = f"{dst}.tmp-{uuid.uuid4().hex[:8]}"
    else:
        fd, tmp = tempfile.mkstemp(prefix="shardify-", suffix=".tar")
        os.close(fd)
    try:
        with open(tmp, "wb") as f:
            sha = _write_tar(f, task.samples, task.storage_options)
            f.flush()
            os.fsync(f.fileno())
            nbytes = f.tell()
        if local:
            os.replace(tmp, dst)
        else:
            storage.put_file_atomic(tmp, task.url, task.storage_options)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return _shard_info(task, nbytes, sha)


def keys_sha1(keys: Sequence[str]) -> str:
    return hashlib.sha1("\n".join(keys).encode("utf-8")).hexdigest()


def _shard_info(task: ShardTask, nbytes: int, sha: str) -> ShardInfo:
    keys = [s.key for s in task.samples]
    lengths = np.asarray([s.length for s in task.samples])
    return ShardInfo(url=task.name, count=len(keys), bytes=nbytes, lengths=lengths, sha256=sha,
                     keys_sha1=keys_sha1(keys))


class _Differs(Exception):
    """The shard on disk is not what the task would write."""


class _ComparingSink:
    """A write target that compares what is written with an existing file instead of writing it."""

    def __init__(self, f):
        self.f = f

    def write(self, b: bytes) -> int:
        if self.f.read(len(b)) != b:
            raise _Differs()
        return len(b)


def existing_shard(task: ShardTask) -> ShardInfo | None:
    """The info of the shard already at ``task.url`` if its bytes are exactly what ``task`` would write (its
    size first, then byte for byte while the tar is generated again, which gives its sha256), else None."""
    try:
        if not storage.exists(task.url, task.storage_options):
            return None
        nbytes = storage.size(task.url, task.storage_options)
        if nbytes != task.planned_bytes:
            return None
        with storage.open_url(task.url, "rb", task.storage_options) as f:
            sha = _write_tar(_ComparingSink(f), task.samples, task.storage_options)
            if f.read(1):
                return None
    except (_Differs, FileNotFoundError):
        return None
    return _shard_info(task, nbytes, sha)


def _write_task(task: ShardTask) -> tuple[ShardInfo, bool]:
    """(info, kept): with ``task.resume``, a complete shard already there is kept, else written."""
    if task.resume:
        info = existing_shard(task)
        if info is not None:
            return info, True
    return write_shard(task), False


def write_planned(
    tasks: Sequence[ShardTask], workers: int = 1, progress: bool = True, stats: dict[str, int] | None = None
) -> list[ShardInfo]:
    """Write the shards (in ``workers`` processes, at most ``2 * workers`` in flight); infos in shard order.

    Tasks with ``resume`` keep a complete shard already written; ``stats`` (if given) gets ``kept`` and
    ``written`` counts."""
    total = sum(len(t.samples) for t in tasks)
    bar = tqdm(total=total, desc="writing", unit="sample", file=sys.stderr, disable=None if progress else True)
    if stats is not None:
        stats.setdefault("kept", 0)
        stats.setdefault("written", 0)

    def count(kept: bool) -> None:
        if stats is not None:
            stats["kept" if kept else "written"] += 1

    try:
        if workers <= 1 or len(tasks) < 2:
            infos = []
            for t in tasks:
                info, kept = _write_task(t)
                count(kept)
                infos.append(info)
                bar.update(len(t.samples))
            return infos
        remote = any(not storage.is_local(t.url) for t in tasks) or any(
            m.path and not storage.is_local(m.path) for t in tasks for s in t.samples for m in s.members
        )
        infos_by_i: dict[int, ShardInfo] = {}
        with _pool(workers, remote) as ex:
            pending: dict[cf.Future, int] = {}
            todo = iter(enumerate(tasks))
            try:
                for i, t in todo:
                    pending[ex.submit(_write_task, t)] = i
                    if len(pending) >= 2 * workers:
                        _collect(pending, infos_by_i, tasks, bar, cf.FIRST_COMPLETED, count)
                while pending:
                    _collect(pending, infos_by_i, tasks, bar, cf.FIRST_COMPLETED, count)
            except BaseException:
                for fut in pending:
                    fut.cancel()
                raise
        return [infos_by_i[i] for i in range(len(tasks))]
    finally:
        bar.close()


def _collect(pending, infos_by_i, tasks, bar, when, count) -> None:
    done, _ = cf.wait(pending, return_when=when)
    for fut in done:
        i = pending.pop(fut)
        infos_by_i[i], kept = fut.result()
        count(kept)
        bar.update(len(tasks[i].samples))


# ---- the output folder -------------------------------------------------------------------------
def _is_ours(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pat) for pat in OUR_FILES)


_PART_FILE_RE = re.compile(r"^(?:shard-p(\d+)-\d+\.tar|index\.part-(\d+)\.json|errors\.part-(\d+)\.jsonl)(?:\.tmp-.*)?$")
_SINGLE_FILE_RE = re.compile(r"^(?:shard-\d+\.tar|index\.json|errors\.jsonl)(?:\.tmp-.*)?$")


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
class _Scope:
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


def _remove_quiet(url: str, storage_options: dict | None) -> None:
    """Remove a file another process (a concurrent part) may remove at the same time."""
    try:
        storage.remove(url, storage_options)
    except FileNotFoundError:
        pass


def check_out(
    out: str, overwrite: bool, storage_options: dict | None = None, part: tuple[int, int] | None = None,
    resume: bool = False,
) -> None:
    """Refuse a non-empty ``out`` unless ``overwrite``. A part may share ``out`` with the other parts' files;
    ``resume`` accepts this write's own files (a whole dataset: anything already in ``out``)."""
    if storage.is_local(out) and os.path.exists(storage.local_path(out)) and not os.path.isdir(storage.local_path(out)):
        raise ShardifyError(f"{out} exists and is not a folder")
    if overwrite:
        return
    names = storage.listdir(out, storage_options)
    if part is None:
        if names and not resume:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise ShardifyError(f"{out} is not empty ({shown}); pass --overwrite to replace the dataset there, or "
                                "--resume to finish an interrupted write")
        return
    i, n = part
    if resume and INDEX_NAME in names:
        raise ShardifyError(f"{out} already holds the merged dataset ({INDEX_NAME}); pass --overwrite to write "
                            f"part {i}/{n} again")
    scope = _Scope(part)
    taken = [m for m in names if not (part_of(m) is not None and (part_of(m) != i or resume and scope.owns(m)))]
    if taken:
        shown = ", ".join(taken[:3]) + (", ..." if len(taken) > 3 else "")
        hint = "pass --resume to finish an interrupted part, or --overwrite to write it again" if any(
            scope.owns(m) for m in taken) else "pass --overwrite to replace the dataset there"
        raise ShardifyError(f"{out} holds files other than the other parts' ({shown}); {hint}")


def clear_out(out: str, storage_options: dict | None = None, part: tuple[int, int] | None = None) -> None:
    """Remove what a previous run wrote (index first, so no index ever lists a removed shard). For a part:
    the merged index, the part's own files, the whole-dataset files and parts numbered N or more (left by a
    run with more parts); other parts' files stay."""
    names = storage.listdir(out, storage_options)
    if part is None:
        names = [n for n in names if _is_ours(n)]
    else:
        i, n = part
        names = [m for m in names if _SINGLE_FILE_RE.match(m) or part_of(m) == i or (part_of(m) or 0) >= n]
    first = (INDEX_NAME, ERRORS_NAME)
    for m in sorted(names, key=lambda m: (m not in first, not m.startswith("index"))):
        _remove_quiet(storage.join_url(out, m), storage_options)


def _prepare_resume(out: str, scope: _Scope, planned: set[str], storage_options: dict | None) -> None:
    """Before a resumed write: remove the (stale) index first, then temporary files and shards that are
    not in this run's plan; planned shards stay to be checked and kept."""
    names = [m for m in storage.listdir(out, storage_options) if scope.owns(m)]
    if scope.index_name in names:
        storage.remove(storage.join_url(out, scope.index_name), storage_options)
    for m in names:
        if m != scope.index_name and m != scope.errors_name and m not in planned:
            _remove_quiet(storage.join_url(out, m), storage_options)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("streambatch")
    except Exception:
        return "unknown"


# ---- the whole pipeline ------------------------------------------------------------------------
def write_shards(
    src: str,
    out: str,
    *,
    kind: str | None = None,
    unit: str | None = None,
    sample_rate: int | None = None,
    data_root: str | None = None,
    max_count: int = DEFAULT_MAX_COUNT,
    max_size: int | str = DEFAULT_MAX_SIZE,
    shuffle: bool = False,
    seed: int = 0,
    workers: int = 1,
    on_error: str = "fail",
    overwrite: bool = False,
    resume: bool = False,
    part: str | tuple[int, int] | None = None,
    storage_options: dict | None = None,
    progress: bool = True,
    stats: dict[str, int] | None = None,
) -> ShardIndex:
    """Write ``src`` (audio folder, JSONL manifest, SpeechBrain JSON/CSV, or text JSONL) as
    length-annotated WebDataset shards plus ``index.json`` under ``out`` (a folder or fsspec URL).

    Bad input records raise :class:`InputErrors` before anything is written (``on_error="fail"``), or are
    skipped and listed in ``out/errors.jsonl`` (``on_error="skip"``; ``index.meta["skipped"]`` counts them).

    ``part=(i, n)`` (or ``"i/n"``) writes only part i of n (see the module docstring) and its
    ``index.part-IIII.json``; :func:`merge_parts` then writes ``index.json``. ``resume=True`` keeps the
    complete shards a previous (interrupted) run of the same command wrote and writes the rest.
    ``stats`` (if given) receives ``kept`` and ``written`` shard counts.
    """
    src, out = str(src), str(out).rstrip("/") or "/"
    if on_error not in ("fail", "skip"):
        raise ShardifyError(f"on_error must be 'fail' or 'skip', not {on_error!r}")
    if kind is not None and kind not in KINDS:
        raise ShardifyError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    if int(max_count) <= 0:
        raise ShardifyError("max_count must be positive")
    if int(workers) <= 0:
        raise ShardifyError("workers must be positive")
    if resume and overwrite:
        raise ShardifyError("--resume keeps what is in OUT and --overwrite replaces it: pass one of them")
    part = parse_part(part)
    scope = _Scope(part)
    max_bytes = parse_size(max_size)
    kind = kind or detect_kind(src)
    unit = check_unit(kind, unit, sample_rate)
    check_out(out, overwrite, storage_options, part, resume)

    records, problems = read_source(src, kind, data_root)
    # the write order is decided on the records, so that every part of a --part run slices the same list
    order = np.random.default_rng(seed).permutation(len(records)) if shuffle else np.arange(len(records))
    records = [records[i] for i in order]
    num_records = len(records)
    if part is not None:
        a, b = part_range(num_records, *part)
        records = records[a:b]
    samples, more, index_rate = measure(records, kind, unit, sample_rate, workers, progress, storage_options,
                                        on_error)
    if problems and on_error == "fail" or more and on_error == "fail":
        raise InputErrors(_sorted(problems + more))
    if part is not None and part[0] != 0:
        problems = []  # problems of the source as a whole are reported (and counted) by part 0 only
    problems = _sorted(problems + more)
    if not samples and (part is None or num_records == 0):
        if problems:
            raise InputErrors(problems, "no valid samples left; nothing was written")
        raise ShardifyError(f"{src}: no samples found")

    plan = plan_shards([s.tar_bytes for s in samples], int(max_count), max_bytes)
    names = [scope.shard_name(j) for j in range(len(plan))]

    if overwrite:
        clear_out(out, storage_options, part)
    storage.makedirs(out, storage_options)
    if resume:
        _prepare_resume(out, scope, set(names), storage_options)
    tasks = [
        ShardTask(name, storage.join_url(out, name), samples[a:b], storage_options, resume=resume)
        for name, (a, b) in zip(names, plan)
    ]
    infos = write_planned(tasks, int(workers), progress, stats)
    errors_url = storage.join_url(out, scope.errors_name)
    if problems:
        data = "".join(json.dumps(p.to_json(), ensure_ascii=False) + "\n" for p in problems).encode("utf-8")
        storage.write_bytes_atomic(errors_url, data, storage_options)
    elif resume:
        _remove_quiet(errors_url, storage_options)
    meta: dict[str, Any] = {
        "source": os.path.abspath(src) if storage.is_local(src) else src,
        "kind": kind,
        "created": _now(),
        "streambatch_version": _version(),
        "shuffle": bool(shuffle),
        "seed": int(seed),
        "max_count": int(max_count),
        "max_size": max_bytes,
        "skipped": len(problems),
    }
    if part is not None:
        meta["part"] = {"index": part[0], "count": part[1], "records": [a, b], "num_records": num_records,
                        "on_error": on_error}
    index = ShardIndex(shards=infos, unit=unit, sample_rate=index_rate, root=out, meta=meta)
    index.save(storage.join_url(out, scope.index_name), storage_options)
    return index


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---- merging parts -----------------------------------------------------------------------------
#: part index fields that every part of one run must share
_PART_SAME = ("source", "kind", "shuffle", "seed", "max_count", "max_size")


def find_parts(out: str, storage_options: dict | None = None) -> list[str]:
    """URLs of the part indexes (``index.part-*.json``) in ``out``."""
    names = [m for m in storage.listdir(out, storage_options) if fnmatch.fnmatch(m, PART_INDEX_GLOB)]
    return [storage.join_url(out, m) for m in names]


def merge_parts(
    out: str, parts: Sequence[str] | None = None, storage_options: dict | None = None, verify: bool = False,
    progress: bool = True,
) -> ShardIndex:
    """Merge the part indexes of a ``--part i/n`` run into ``out/index.json`` (and ``errors.jsonl``).

    ``parts``: the part index files (default: every ``index.part-*.json`` in ``out``). All n parts must be
    there, once each, written from the same source with the same options; a missing part is an error that
    names it. The shards the parts list must exist (``verify=True`` re-reads them all, as ``shardify verify``).
    """
    out = str(out).rstrip("/") or "/"
    urls = list(parts) if parts else find_parts(out, storage_options)
    if not urls:
        raise ShardifyError(f"{out}: no part indexes ({PART_INDEX_GLOB}); write the parts first with "
                            "`shardify write SRC OUT --part I/N` for I = 0 .. N-1")
    loaded: list[tuple[str, ShardIndex]] = []
    for url in urls:
        try:
            ix = ShardIndex.load(url, storage_options)
        except FileNotFoundError as e:
            raise ShardifyError(str(e)) from None
        except ValueError as e:
            raise ShardifyError(f"{url}: {e}") from None
        if not isinstance(ix.meta.get("part"), dict):
            raise ShardifyError(f"{url} is not a part index (written by `shardify write --part I/N`)")
        loaded.append((url, ix))
    counts = sorted({ix.meta["part"]["count"] for _, ix in loaded})
    if len(counts) > 1:
        raise ShardifyError(f"{out}: part indexes of different runs (of {' and '.join(map(str, counts))} parts); "
                            "remove the stale ones or list the parts to merge")
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
    ordered = [by_part[i] for i in range(n)]
    first_url, first = ordered[0]
    num_records = first.meta["part"]["num_records"]
    for url, ix in ordered:
        pm = ix.meta["part"]
        for k in _PART_SAME:
            if ix.meta.get(k) != first.meta.get(k):
                raise ShardifyError(f"{url} was written with {k}={ix.meta.get(k)!r} but {first_url} with "
                                    f"{first.meta.get(k)!r}: the parts are not from the same run")
        if ix.unit != first.unit or pm.get("on_error") != first.meta["part"].get("on_error"):
            raise ShardifyError(f"{url} and {first_url} differ in unit or --on-error: not from the same run")
        if pm["num_records"] != num_records or list(pm["records"]) != list(part_range(num_records, pm["index"], n)):
            raise ShardifyError(f"{url} holds records {pm['records']} of {pm['num_records']}, not part "
                                f"{pm['index']}/{n} of the {num_records} records the others saw (did the source "
                                "change between tasks?)")
    rates = {ix.sample_rate for _, ix in ordered if ix.num_samples}
    if len(rates) > 1 and first.unit == "samples":
        raise ShardifyError(
            f"the parts have different sample rates ({', '.join(str(r) for r in sorted(rates))} Hz): the source "
            "mixes sample rates; write every part with --sample-rate R to count lengths in samples at R"
        )
    sample_rate = rates.pop() if len(rates) == 1 else None
    total = sum(ix.num_samples for _, ix in ordered)
    if total == 0:
        raise ShardifyError(f"{out}: the {n} parts hold no samples")

    # shard urls: relative where the part index sits in out, else absolute
    shards = []
    out_key = _folder_key(out)
    for url, ix in ordered:
        same = _folder_key(ix.root or "") == out_key
        for info, abs_url in zip(ix.shards, ix.shard_urls()):
            info.url = info.url if same else abs_url
            shards.append(info)
    seen: set[str] = set()
    for info in shards:
        if info.url in seen:
            raise ShardifyError(f"shard {info.url} is listed by two parts")
        seen.add(info.url)
    meta = {k: v for k, v in first.meta.items() if k != "part"}
    meta["created"] = _now()
    meta["skipped"] = int(sum(ix.meta.get("skipped", 0) for _, ix in ordered))
    meta["parts"] = n
    merged = ShardIndex(shards=shards, unit=first.unit, sample_rate=sample_rate, root=out, meta=meta)

    present = set(storage.listdir(out, storage_options))
    for info, url in zip(merged.shards, merged.shard_urls()):
        there = info.url in present if info.url == os.path.basename(info.url) else storage.exists(url, storage_options)
        if not there:
            raise ShardifyError(f"{url} is listed by a part index but missing; run that part again with --resume")
    if verify:
        from .verify import verify_dataset

        problems = verify_dataset(merged, storage_options, progress=progress)
        if problems:
            raise ShardifyError(f"{len(problems)} shard problems, index.json not written:\n  "
                                + "\n  ".join(problems[:20]))
    # errors.jsonl: every part's problems, in the order a single-process write lists them
    rows: list[dict[str, Any]] = []
    for url, ix in ordered:
        if ix.meta.get("skipped"):
            eurl = storage.join_url(ix.root or out, PART_ERRORS_NAME.format(ix.meta["part"]["index"]))
            with storage.open_url(eurl, "rb", storage_options) as f:
                rows += [json.loads(line) for line in f.read().decode("utf-8").splitlines() if line.strip()]
    errors_url = storage.join_url(out, ERRORS_NAME)
    if rows:
        rows.sort(key=lambda r: (r["source"], r["line"] if r.get("line") is not None else 0))
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
        storage.write_bytes_atomic(errors_url, data, storage_options)
    else:
        _remove_quiet(errors_url, storage_options)
    merged.save(storage.join_url(out, INDEX_NAME), storage_options)
    return merged


def _folder_key(url: str) -> str:
    url = str(url).rstrip("/")
    return os.path.abspath(storage.local_path(url)) if storage.is_local(url) else url


def _sorted(problems: list[InputProblem]) -> list[InputProblem]:
    return sorted(problems, key=lambda p: (p.source, p.line if p.line is not None else 0))
