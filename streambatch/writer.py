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

from . import storage
from .audio import AudioError, probe
from .errors import InputErrors, InputProblem, ShardifyError
from .index import INDEX_NAME, ShardIndex, ShardInfo
from .sources import KINDS, Record, detect_kind, read_source, token_length

SHARD_NAME = "shard-{:06d}.tar"
ERRORS_NAME = "errors.jsonl"
#: the files ``--overwrite`` removes: only what this writer makes
OUR_FILES = ("shard-*.tar", INDEX_NAME, ERRORS_NAME, "*.tmp*")
UNITS = ("samples", "seconds", "tokens")
DEFAULT_MAX_COUNT = 1000
DEFAULT_MAX_SIZE = "1G"
TAR_FORMAT = tarfile.PAX_FORMAT
BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE

# ---- sizes -------------------------------------------------------------------------------------
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(size: int | str) -> int:
    """Bytes from ``123456``, ``"500M"``, ``"2G"``, ``"1.5GiB"`` (K, M, G, T are powers of 1024)."""
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        n = int(size)
    else:
        m = _SIZE_RE.fullmatch(str(size))
        if not m:
            raise ShardifyError(f"cannot read size {size!r}; write e.g. 500M, 2G or a number of bytes")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if n <= 0:
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
    keys = [s.key for s in task.samples]
    lengths = np.asarray([s.length for s in task.samples])
    return ShardInfo(url=task.name, count=len(keys), bytes=nbytes, lengths=lengths, sha256=sha,
                     keys_sha1=keys_sha1(keys))


def keys_sha1(keys: Sequence[str]) -> str:
    return hashlib.sha1("\n".join(keys).encode("utf-8")).hexdigest()


def _write_task(task: ShardTask) -> ShardInfo:
    return write_shard(task)


def write_planned(
    tasks: Sequence[ShardTask], workers: int = 1, progress: bool = True
) -> list[ShardInfo]:
    """Write the shards (in ``workers`` processes, at most ``2 * workers`` in flight); infos in shard order."""
    total = sum(len(t.samples) for t in tasks)
    bar = tqdm(total=total, desc="writing", unit="sample", file=sys.stderr, disable=None if progress else True)
    try:
        if workers <= 1 or len(tasks) < 2:
            infos = []
            for t in tasks:
                infos.append(write_shard(t))
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
                        _collect(pending, infos_by_i, tasks, bar, cf.FIRST_COMPLETED)
                while pending:
                    _collect(pending, infos_by_i, tasks, bar, cf.FIRST_COMPLETED)
            except BaseException:
                for fut in pending:
                    fut.cancel()
                raise
        return [infos_by_i[i] for i in range(len(tasks))]
    finally:
        bar.close()


def _collect(pending, infos_by_i, tasks, bar, when) -> None:
    done, _ = cf.wait(pending, return_when=when)
    for fut in done:
        i = pending.pop(fut)
        infos_by_i[i] = fut.result()
        bar.update(len(tasks[i].samples))


# ---- the output folder -------------------------------------------------------------------------
def _is_ours(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pat) for pat in OUR_FILES)


def check_out(out: str, overwrite: bool, storage_options: dict | None = None) -> None:
    """Refuse a non-empty ``out`` unless ``overwrite``."""
    if storage.is_local(out) and os.path.exists(storage.local_path(out)) and not os.path.isdir(storage.local_path(out)):
        raise ShardifyError(f"{out} exists and is not a folder")
    names = storage.listdir(out, storage_options)
    if names and not overwrite:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ShardifyError(f"{out} is not empty ({shown}); pass --overwrite to replace the dataset there")


def clear_out(out: str, storage_options: dict | None = None) -> None:
    """Remove what a previous run wrote (index first, so no index ever lists a removed shard)."""
    names = [n for n in storage.listdir(out, storage_options) if _is_ours(n)]
    for n in sorted(names, key=lambda n: n != INDEX_NAME):
        storage.remove(storage.join_url(out, n), storage_options)


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
    storage_options: dict | None = None,
    progress: bool = True,
) -> ShardIndex:
    """Write ``src`` (audio folder, JSONL manifest, SpeechBrain JSON/CSV, or text JSONL) as
    length-annotated WebDataset shards plus ``index.json`` under ``out`` (a folder or fsspec URL).

    Bad input records raise :class:`InputErrors` before anything is written (``on_error="fail"``), or are
    skipped and listed in ``out/errors.jsonl`` (``on_error="skip"``; ``index.meta["skipped"]`` counts them).
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
    max_bytes = parse_size(max_size)
    kind = kind or detect_kind(src)
    unit = check_unit(kind, unit, sample_rate)
    check_out(out, overwrite, storage_options)

    records, problems = read_source(src, kind, data_root)
    samples, more, index_rate = measure(records, kind, unit, sample_rate, workers, progress, storage_options,
                                        on_error)
    problems = _sorted(problems + more)
    if problems and on_error == "fail":
        raise InputErrors(problems)
    if not samples:
        if problems:
            raise InputErrors(problems, "no valid samples left; nothing was written")
        raise ShardifyError(f"{src}: no samples found")

    order = np.random.default_rng(seed).permutation(len(samples)) if shuffle else np.arange(len(samples))
    ordered = [samples[i] for i in order]
    plan = plan_shards([s.tar_bytes for s in ordered], int(max_count), max_bytes)

    if overwrite:
        clear_out(out, storage_options)
    storage.makedirs(out, storage_options)
    tasks = [
        ShardTask(SHARD_NAME.format(i), storage.join_url(out, SHARD_NAME.format(i)), ordered[a:b], storage_options)
        for i, (a, b) in enumerate(plan)
    ]
    infos = write_planned(tasks, int(workers), progress)
    if problems:
        data = "".join(json.dumps(p.to_json(), ensure_ascii=False) + "\n" for p in problems).encode("utf-8")
        storage.write_bytes_atomic(storage.join_url(out, ERRORS_NAME), data, storage_options)
    index = ShardIndex(
        shards=infos,
        unit=unit,
        sample_rate=index_rate,
        root=out,
        meta={
            "source": os.path.abspath(src) if storage.is_local(src) else src,
            "kind": kind,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "streambatch_version": _version(),
            "shuffle": bool(shuffle),
            "seed": int(seed),
            "max_count": int(max_count),
            "max_size": max_bytes,
            "skipped": len(problems),
        },
    )
    index.save(out, storage_options)
    return index


def _sorted(problems: list[InputProblem]) -> list[InputProblem]:
    return sorted(problems, key=lambda p: (p.source, p.line if p.line is not None else 0))
