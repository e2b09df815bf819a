"""Shard encoding: samples as tar members, their exact sizes, and one shard written (or recognised) whole.

A shard is a plain POSIX (pax) tar with, per sample, ``KEY.json`` first and the payload members in name order;
members have mtime 0 and no owner, so the same input gives byte-identical shards. Sizes are known before
writing (`plan_shards()` decides every shard up front), which lets ``--resume`` recognise a complete shard.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, Final

import numpy as np

from ..errors import DataError, ShardifyError, os_problem, output_fits
from ..format.index import ShardInfo
from ..format.rules import keys_sha1
from ..io import storage
from ..io.digest import Digest, size_problem
from ..io.tempname import temporary_name
from .records import Record

TAR_FORMAT: Final = tarfile.PAX_FORMAT
BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE


# ---- samples and their tar members -------------------------------------------------------------
@dataclass
class Member:
    """One tar member: ``data`` in memory, the file at ``path`` (copied byte for byte), or what ``blob.read()``
    returns (audio inside a source, e.g. a Hugging Face dataset row; read when the shard is written)."""

    name: str
    size: int
    data: bytes | None = None
    path: str | None = None
    blob: Any = None


class Sample:
    """One sample to write: its key, its length in the index's unit, its second length (``output_length``, when
    the write counts one), and the bytes its tar members take (``tar_bytes``, what the shard plan cuts by).

    Its ``.json`` dict (``meta``: where the index's metadata columns come from) and its tar ``members`` (``KEY.json``
    first, then the payload in name order) are made from its record each time they are asked for, when its shard
    is written, and dropped after: a write of millions of lines holds per sample this object and its record, not
    the ``.json`` bytes and dicts of every sample at once. Both are made from the record alone, so they are the same
    bytes every time (and ``tar_bytes`` is exact)."""

    __slots__ = ("key", "length", "output_length", "tar_bytes", "_rec", "_rate", "_frames", "_nbytes", "_emitted")

    def __init__(self, rec: Record, length: int | float, audio: tuple[int, int, int, int | None] | None = None):
        self.key, self.length, self.output_length = rec.key, length, rec.output_length
        self._rec = rec
        # the file's rate, frames and bytes and the rate the loader emits; a text sample's rate is 0
        self._rate, self._frames, self._nbytes, self._emitted = audio if audio is not None else (0, 0, 0, None)
        self.tar_bytes = sum(member_tar_bytes(m.name, m.size) for m in self.members)

    @property
    def meta(self) -> dict[str, Any]:
        """The sample's ``.json`` dict (made anew on each call)."""
        rec, length = self._rec, self.length
        if not self._rate:  # text
            return _with_fields(_lengths(rec, length), rec.fields)
        rate = self._emitted or self._rate
        meta: dict[str, Any] = {**_lengths(rec, length), "sample_rate": rate}
        if rate != self._rate:
            meta["original_sample_rate"] = self._rate
        meta["duration"] = rec.fields["duration"] if "duration" in rec.fields else round(self._frames / self._rate, 6)
        if rec.text is not None:
            meta["text"] = rec.text
        return _with_fields(meta, rec.fields, skip=("duration",))

    @property
    def members(self) -> list[Member]:
        """The sample's tar members in tar order (made anew on each call)."""
        rec = self._rec
        payload = []
        if self._rate:
            payload.append(Member(f"{rec.key}.{rec.ext}", self._nbytes, path=rec.path, blob=rec.audio))
        else:
            if rec.text is not None:
                text = rec.text.encode("utf-8")
                payload.append(Member(f"{rec.key}.txt", len(text), data=text))
            if rec.input_ids is not None:
                buf = io.BytesIO()
                np.save(buf, np.asarray(rec.input_ids, dtype=np.int32))
                ids = buf.getvalue()
                payload.append(Member(f"{rec.key}.input_ids.npy", len(ids), data=ids))
        return _members(rec.key, self.meta, payload)

    @property
    def remote_path(self) -> bool:
        """Whether the sample's audio is a file on remote storage (its writer must start fresh processes)."""
        path = self._rec.path
        return bool(self._rate) and path is not None and not storage.is_local(path)


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


def _lengths(rec: Record, length: int | float) -> dict[str, Any]:
    """The ``.json``'s lengths: ``length``, and ``output_length`` when the record has one."""
    return {"length": length} if rec.output_length is None else {"length": length, "output_length": rec.output_length}


def _members(key: str, meta: dict[str, Any], payload: list[Member]) -> list[Member]:
    j = _json_bytes(meta)
    return [Member(f"{key}.json", len(j), data=j)] + sorted(payload, key=lambda m: m.name)


def audio_sample(
    rec: Record, length: int | float, sample_rate: int, frames: int, nbytes: int, emitted_rate: int | None = None
) -> Sample:
    """An audio record as a sample: its ``.json`` (length, rate, duration, text, the source's fields) and
    the audio file's original bytes. ``sample_rate`` is the file's rate, ``emitted_rate`` the one the loader
    resamples it to (``--sample-rate``): the ``.json``'s ``sample_rate`` is the emitted one, and the file's is
    kept as ``original_sample_rate`` when they differ."""
    return Sample(rec, length, (sample_rate, frames, nbytes, emitted_rate))


def text_sample(rec: Record, length: int) -> Sample:
    """A text record as a sample: its ``.json`` and ``.txt`` and/or ``.input_ids.npy`` (int32)."""
    return Sample(rec, length)


# ---- which samples go in which shard -----------------------------------------------------------
def plan_shards(sample_bytes: Sequence[int] | np.ndarray, max_count: int, max_size: int) -> list[tuple[int, int]]:
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


# ---- one shard ---------------------------------------------------------------------------------
@dataclass
class ShardTask:
    """One planned shard: its name in the index, where it goes, and its samples."""

    name: str
    url: str
    samples: Sequence[Sample]
    storage_options: dict | None = None
    #: keep a shard already at ``url`` when its bytes are exactly what this task would write
    resume: bool = False

    @property
    def planned_bytes(self) -> int:
        return shard_tar_bytes(sum(s.tar_bytes for s in self.samples))


class _HashingWriter:
    """A write target that passes everything on to ``f`` and feeds a `Digest` (sha256 and size)."""

    def __init__(self, f: Any):
        self.f, self.digest = f, Digest()

    def write(self, b: bytes) -> int:
        self.f.write(b)
        self.digest.update(b)
        return len(b)

    def tell(self) -> int:
        return self.digest.bytes


def _write_tar(f: Any, samples: Sequence[Sample], storage_options: dict | None) -> str:
    """Write the samples as a tar to the open file ``f``; returns the sha256 of the bytes written."""
    hw = _HashingWriter(f)
    # tarfile writes with write() and tell() only; its stub asks for a whole file object
    with tarfile.open(fileobj=hw, mode="w", format=TAR_FORMAT, encoding="utf-8") as tar:  # type: ignore[call-overload]
        for s in samples:
            for m in s.members:
                ti = _tarinfo(m.name, m.size)
                if m.data is not None or m.blob is not None:
                    tar.addfile(ti, io.BytesIO(_member_bytes(m)))
                    continue
                if m.path is None:
                    raise ValueError(f"tar member {m.name}: no data, blob or path to write")
                with storage.open_url(m.path, "rb", storage_options) as src:
                    if storage.is_local(m.path) and os.fstat(src.fileno()).st_size != m.size:
                        raise ShardifyError(f"{m.path}: the file changed size while shards were being written")
                    tar.addfile(ti, src)
    return hw.digest.hexdigest()


def _member_bytes(m: Member) -> bytes:
    """An in-memory member's bytes (a blob read now), which must be the size planned."""
    if m.data is not None:
        return m.data
    data = m.blob.read()
    if len(data) != m.size:
        raise ShardifyError(f"{m.name}: {len(data)} bytes, but {m.size} when it was measured (the source changed)")
    return data


@contextlib.contextmanager
def atomic_file(url: str, storage_options: dict | None = None, prefix: str = "shardify-") -> Iterator[str]:
    """A local temporary path to write ``url``'s bytes to; when the block succeeds the file appears at ``url``
    whole (a rename beside it, or one upload to an object store), and the temporary file is always removed."""
    local = storage.is_local(url)
    if local:
        target = storage.local_path(url)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        tmp = temporary_name(target)
    else:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tar")
        os.close(fd)
    try:
        with output_fits(url):
            yield tmp
            if local:
                os.replace(tmp, target)
            else:
                storage.put_file_atomic(tmp, url, storage_options)
    finally:
        _remove_temporary(tmp)


def _remove_temporary(tmp: str) -> None:
    """Remove a temporary file left by a write that did not finish; where that fails (the folder went read-only)
    the write's own error is the one to see: the file is named in a warning, not raised over it."""
    try:
        if os.path.exists(tmp):
            os.remove(tmp)
    except OSError as e:
        print(f"shardify: warning: could not remove the temporary file {tmp} ({os_problem(e)})", file=sys.stderr)


def write_shard(task: ShardTask) -> ShardInfo:
    """Write one shard so it appears only complete (see `atomic_file()`)."""
    with atomic_file(task.url, task.storage_options) as tmp, open(tmp, "wb") as f:
        sha = _write_tar(f, task.samples, task.storage_options)
        try:
            f.flush()
            os.fsync(f.fileno())
        except OSError as e:  # named: the disk's input/output error as the package's error, others with the shard
            raise storage.write_error(task.url, e) from None
        nbytes = f.tell()
    return _shard_info(task, nbytes, sha)


class Keys(Sequence[str]):
    """A shard's sample keys, as a list of them reads (``len``, ``[i]``, iteration, ``==`` a list), held as one
    UTF-8 buffer and each key's end in it: a few bytes a key beyond its text, where a list holds a Python string
    object for each (about 50 bytes more). ``pyarrow.array(keys)`` takes the buffer as it is (``__arrow_array__``)."""

    __slots__ = ("_data", "_ends")

    def __init__(self, keys: Iterable[str]):
        encoded = [k.encode("utf-8") for k in keys]
        self._data = b"".join(encoded)
        self._ends = np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)))

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # an IndexError out of range, a negative index from the end
        return self._data[int(self._ends[i - 1]) if i else 0 : int(self._ends[i])].decode("utf-8")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # compared by value, as a list

    def __repr__(self) -> str:
        return f"Keys({list(self)!r})"

    def __arrow_array__(self, type: Any = None) -> Any:
        import pyarrow as pa

        if len(self._data) >= 2**31:  # past a string array's 32-bit offsets: let pyarrow choose
            return pa.array(list(self), type)
        offsets = np.concatenate([np.zeros(1, np.int32), self._ends.astype(np.int32)])
        arr = pa.StringArray.from_buffers(len(self), pa.py_buffer(offsets), pa.py_buffer(self._data))
        return arr if type is None or arr.type == type else arr.cast(type)


def _shard_info(task: ShardTask, nbytes: int, sha: str) -> ShardInfo:
    """The index entry of a written shard, with each sample's key (`Keys`) and the byte range its members span in
    the tar (exact: member sizes are known before writing), for the version 2 sample table."""
    keys = [s.key for s in task.samples]
    lengths = np.asarray([s.length for s in task.samples])
    sizes = np.asarray([s.tar_bytes for s in task.samples], dtype=np.int64)
    offsets = np.cumsum(sizes) - sizes
    outs = [s.output_length for s in task.samples]
    output_lengths = None if any(o is None for o in outs) else np.asarray(outs, dtype=np.int64)
    return ShardInfo(
        url=task.name,
        count=len(keys),
        bytes=nbytes,
        lengths=lengths,
        sha256=sha,
        keys_sha1=keys_sha1(keys),
        keys=Keys(keys),
        offsets=offsets,
        sizes=sizes,
        output_lengths=output_lengths,
    )


class _Differs(DataError):
    """The shard on disk is not what the task would write."""


class _ComparingSink:
    """A write target that compares what is written with an existing file instead of writing it."""

    def __init__(self, f: IO[bytes]):
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
        if size_problem(nbytes, task.planned_bytes):
            return None
        with storage.open_url(task.url, "rb", task.storage_options) as f:
            sha = _write_tar(_ComparingSink(f), task.samples, task.storage_options)
            if f.read(1):
                return None
    except (_Differs, FileNotFoundError):
        return None
    return _shard_info(task, nbytes, sha)
