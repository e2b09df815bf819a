"""``shardify stage SRC DEST``: copy a dataset (its shards, then its index) to node-local disk.

Each shard is copied to a temporary name, checked against the index (size, and sha256 computed while
copying) and renamed; a shard already complete in DEST is kept, so stage can be re-run to finish a copy. Whether
a shard there counts as complete at its size, or only when its sha256 matches, and whether DEST may be replaced,
depends on what DEST holds (`stage_dest`: this dataset, another one, a copy cut short). The index is written
last: DEST only has an ``index.json`` once every shard it lists is complete. With ``--overwrite`` the dataset
DEST held stays readable until every shard is copied, then the two are swapped (`stage_dest.publish()`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import posixpath
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from ..errors import ShardifyError, StorageError
from ..format.index import INDEX_NAME, ShardIndex, ShardInfo, is_index_file
from ..io import storage
from ..io.digest import Digest, HashingReader, sha256_problem, size_problem
from ..io.lock import holds_lock
from .stage_dest import DestState, begin, finish, publish, recover, survey, wait_in_place, waiting_url
from .tarwrite import atomic_file

CHUNK = 4 << 20
ATTEMPTS = 3


@dataclass
class StageResult:
    """What ``stage_dataset`` did: the staged index, the shards it copied and those it kept."""

    dest: str
    index: ShardIndex
    copied: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    bytes_copied: int = 0


def _index_url(src: str) -> str:
    return src if is_index_file(src) else storage.join_url(src, INDEX_NAME)


def _is_absolute(url: str) -> bool:
    return "://" in url or url.startswith("/")


def _sha256_of(url: str, storage_options: dict | None) -> str:
    with storage.open_url(url, "rb", storage_options) as f:
        return HashingReader(f.read).drain(CHUNK).hexdigest()


@dataclass(frozen=True)
class _Keep:
    """When a shard already in DEST is kept: ``trusted`` (DEST holds this dataset) at the index's size, re-hashed
    with ``rehash`` (``--verify``); otherwise only when its sha256 is the index's."""

    trusted: bool
    rehash: bool


def _complete(dst: str, info: ShardInfo, keep: _Keep, storage_options: dict | None) -> bool:
    """Is the shard at ``dst`` already the one the index lists (see `_Keep`)? A shard whose sha256 the
    index does not list is kept only where DEST holds this dataset."""
    try:
        if size_problem(storage.size(dst, storage_options), info.bytes):
            return False
    except (FileNotFoundError, OSError):
        return False
    if keep.trusted and not keep.rehash:
        return True
    if not info.sha256:
        return keep.trusted
    return sha256_problem(_sha256_of(dst, storage_options), info.sha256) is None


def _copy_one(
    src: str,
    dst: str,
    info: ShardInfo,
    src_options: dict | None,
    dest_options: dict | None,
    bar: tqdm,
    lock: threading.Lock,
) -> int:
    """Copy one shard to a temporary name, check its size and sha256 against the index, then rename."""
    with atomic_file(dst, dest_options, prefix="shardify-stage-") as tmp:
        digest = _copy_with_retries(src, (tmp, dst), src_options, bar, lock)
        problem = size_problem(digest.bytes, info.bytes) or sha256_problem(digest.hexdigest(), info.sha256)
        if problem:
            raise ShardifyError(f"{src}: {problem} (check with `shardify verify`)")
    return digest.bytes


def _copy_with_retries(
    src: str, to: tuple[str, str], src_options: dict | None, bar: tqdm, lock: threading.Lock
) -> Digest:
    """Copy ``src`` to the local file ``to[0]`` (the temporary file of ``to[1]``), hashing on the way; a remote
    read error is retried from the start (``ATTEMPTS`` in all). An error writing the copy is not retried: it is
    raised naming ``to[1]`` (`storage.write_error()`)."""
    attempt = 0
    while True:
        done = 0
        try:
            with storage.open_url(src, "rb", src_options) as fi, _Written(to[0]) as fo:
                reader = HashingReader(fi.read)
                while chunk := reader.read(CHUNK):
                    fo.write(chunk)
                    with lock:
                        bar.update(len(chunk))
                    done += len(chunk)
            return reader.digest
        except _WriteFailed as e:
            raise storage.write_error(to[1], e.error) from None
        except FileNotFoundError:
            raise ShardifyError(f"{src}: listed in the index but missing") from None
        except OSError:
            with lock:
                bar.update(-done)
            attempt += 1
            if attempt == ATTEMPTS or storage.is_local(src):
                raise
            time.sleep(0.5 * 2 ** (attempt - 1))


class _WriteFailed(StorageError):
    """An OS error writing the local copy (not the source's: never retried); it never leaves this module."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


class _Written:
    """The local copy, opened to write; its OS errors (opening, writing, ``fsync`` at the end) as
    `_WriteFailed`."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> _Written:
        try:
            self.f = open(self.path, "wb")
        except OSError as e:
            raise _WriteFailed(e) from e
        return self

    def write(self, data: bytes) -> None:
        try:
            self.f.write(data)
        except OSError as e:
            raise _WriteFailed(e) from e

    def __exit__(self, kind: type | None, *_: object) -> None:
        if kind is not None:  # the error already raised is the one to see
            with contextlib.suppress(OSError):
                self.f.close()
            return
        try:
            with self.f:
                self.f.flush()
                os.fsync(self.f.fileno())
        except OSError as e:
            raise _WriteFailed(e) from e


def stage_dataset(
    src: str,
    dest: str,
    *,
    verify: bool = False,
    overwrite: bool = False,
    workers: int = 4,
    storage_options: dict | None = None,
    dest_storage_options: dict | None = None,
    progress: bool = True,
    shard_roots: Sequence[str] = (),
) -> StageResult:
    """Copy the dataset at ``src`` (folder, URL or index file) to ``dest``; see the module docstring.

    ``workers`` shards are copied at a time (threads). The source's shard URLs must lie in its folder or under
    ``shard_roots`` (`trust`); the staged copy holds them all. ``storage_options`` are
    SRC's (and its shards'), ``dest_storage_options`` DEST's. A DEST holding another dataset is refused unless
    ``overwrite`` (`stage_dest`). The arguments are checked before DEST is touched (its lock included);
    the copy runs holding DEST's lock. Returns what was copied and kept."""
    src, dest = str(src), str(dest).rstrip("/") or "/"
    if int(workers) <= 0:
        raise ShardifyError("workers must be positive")
    raw, index = _read_index(src, storage_options, shard_roots)
    index.check_urls()
    _check_dest(src, dest, index, storage_options, dest_storage_options)
    job = _Job(src, dest, raw, index, verify, overwrite, int(workers), storage_options, dest_storage_options, progress)
    return _stage(job)


@dataclass(frozen=True)
class _Job:
    """One ``stage_dataset`` call, its arguments checked: the source index (its bytes, loaded) and the options."""

    src: str
    dest: str
    raw: bytes
    index: ShardIndex
    verify: bool
    overwrite: bool
    workers: int
    src_options: dict | None
    dest_options: dict | None
    progress: bool


@holds_lock(lambda a: (a.arguments["job"].dest, None, a.arguments["job"].dest_options), wait=True)
def _stage(job: _Job) -> StageResult:
    """Copy the shards DEST lacks, then write the index, holding DEST's lock (see `stage_dataset()`)."""
    dest, index, options = job.dest, job.index, job.dest_options
    names, rewrite = _dest_names(index)
    dsts = [storage.join_url(dest, *n.split("/")) for n in names]
    storage.makedirs(dest, options)
    recover(dest)
    state = survey(dest, job.raw, index, names, rewrite, job.overwrite, options)
    begin(dest, state, index, names, job.src, options)
    result = StageResult(dest=dest, index=index)
    keep = _Keep(trusted=state.trusted, rehash=job.verify)
    waiting = _copy_shards(index, dsts, names, result, keep, state, job, options)
    tables = set() if rewrite else _table_names(index)
    publish(dest, state, waiting, tables, lambda: _write_index(job, names if rewrite else None, state), options)
    finish(dest, state, names, options)
    result.index = ShardIndex.load(storage.join_url(dest, INDEX_NAME), options)
    return result


def _check_dest(src: str, dest: str, index: ShardIndex, src_options: dict | None, dest_options: dict | None) -> None:
    """Refuse a DEST that is a file or the dataset itself, and ``--storage-option`` given for a remote DEST where
    nothing of SRC takes it (it applies to SRC and its shards only: DEST's are ``--dest-storage-option``)."""
    path = storage.local_path(dest)
    if storage.is_local(dest) and os.path.exists(path) and not os.path.isdir(path):
        raise ShardifyError(f"{dest} exists and is not a folder")
    if _same_place(index.root or "", dest):
        raise ShardifyError(f"{dest} is the dataset itself")
    if src_options and dest_options is None and not storage.is_local(dest):
        if storage.is_local(src) and all(storage.is_local(u) for u in index.shard_urls()):
            raise ShardifyError(
                f"--storage-option applies to SRC and its shards ({src}: local); DEST {dest} takes its own: "
                "--dest-storage-option KEY=VALUE (Python: dest_storage_options=)"
            )


def _write_index(job: _Job, rewritten: list[str] | None, state: DestState) -> None:
    """Write DEST's index, last: the source's bytes (and its tables) as they are, or with ``rewritten`` (the
    shards' names in DEST, for an index whose URLs were absolute) a new index naming them."""
    dest_index = storage.join_url(job.dest, INDEX_NAME)
    index = job.index
    if rewritten is None:
        _copy_tables(index, job.dest, state.same, job.src_options, job.dest_options)
        storage.write_bytes_atomic(dest_index, job.raw, job.dest_options)
        return
    for info, name in zip(index.shards, rewritten):
        info.url = name
    staged = ShardIndex(
        shards=index.shards,
        unit=index.unit,
        sample_rate=index.sample_rate,
        root=job.dest,
        meta=dict(index.meta, staged_from=job.src),
    )
    staged.save(dest_index, job.dest_options, version=index.version)


def _copy_tables(index: ShardIndex, dest: str, keep: bool, src_options: dict | None, dest_options: dict | None) -> None:
    """A version 2 index's table files, copied byte for byte (each whole or not at all) before its header;
    with ``keep`` (DEST has this index already) a table there at its size is kept."""
    if index.version < 2:
        return
    reader = index.shards.reader  # type: ignore[attr-defined]
    for rel, nbytes in reader.table_files():
        src, dst = storage.join_url(index.root or "", *rel.split("/")), storage.join_url(dest, *rel.split("/"))
        if keep and _complete_size(dst, nbytes, dest_options):
            continue
        with atomic_file(dst, dest_options, prefix="shardify-stage-") as tmp:
            digest = _copy_with_retries(src, (tmp, dst), src_options, _NoBar(), threading.Lock())
            problem = size_problem(digest.bytes, nbytes)
            if problem:
                raise ShardifyError(f"{src}: {problem}")


def _table_names(index: ShardIndex) -> set[str]:
    """The table files (paths beside the index) a version 2 index copied byte for byte names."""
    if index.version < 2:
        return set()
    return {rel for rel, _ in index.shards.reader.table_files()}  # type: ignore[attr-defined]


def _complete_size(url: str, nbytes: int, options: dict | None) -> bool:
    try:
        return storage.size(url, options) == nbytes
    except (FileNotFoundError, OSError):
        return False


class _NoBar:
    """The progress bar of a copy nobody watches (index tables: small beside the shards)."""

    def update(self, n: int) -> None:
        pass


def _read_index(src: str, storage_options: dict | None, shard_roots: Sequence[str]) -> tuple[bytes, ShardIndex]:
    """The source index: its bytes (copied as they are unless urls are rewritten) and the loaded index."""
    index_url = _index_url(src)
    try:
        with storage.open_url(index_url, "rb", storage_options) as f:
            raw = f.read()
    except FileNotFoundError:
        raise ShardifyError(f"no dataset index at {index_url}") from None
    return raw, ShardIndex.load(index_url, storage_options, shard_roots)


def _dest_names(index: ShardIndex) -> tuple[list[str], bool]:
    """Where each shard goes under dest: its relative url (an absolute url: its file name, and ``True``:
    the staged index must be rewritten)."""
    rewrite = False
    names: list[str] = []
    for info in index.shards:
        if _is_absolute(info.url):
            rewrite = True
            names.append(posixpath.basename(info.url.rstrip("/")))
        else:
            if info.url.startswith("..") or "/../" in info.url:
                raise ShardifyError(f"shard url {info.url!r} leaves the dataset folder; cannot stage it")
            names.append(info.url)
    if len(set(names)) != len(names):
        raise ShardifyError("two shards of the index have the same file name; cannot stage them into one folder")
    return names, rewrite


def _copy_shards(
    index: ShardIndex,
    dsts: list[str],
    names: list[str],
    result: StageResult,
    keep: _Keep,
    state: DestState,
    job: _Job,
    dest_options: dict | None,
) -> list[str]:
    """Copy every shard not already complete at its ``dsts`` entry, ``job.workers`` at a time (threads); record
    what was copied and kept in ``result``. A shard that would replace a file of the dataset DEST holds is copied
    to its waiting place instead (`DestState.waits()`); returns the names of those waiting there."""
    src_options, workers, progress = job.src_options, job.workers, job.progress
    srcs = index.shard_urls()
    bar = tqdm(
        total=sum(info.bytes for info in index.shards),
        desc="staging",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=None if progress else True,
    )
    lock = threading.Lock()
    waiting: list[str] = []

    def one(i: int) -> tuple[int, int | None]:
        info, dst = index.shards[i], dsts[i]
        if state.waits(names[i]):
            there = _complete(dst, info, keep, dest_options)  # its bytes already under its name (sha256 checked)
            if there and state.local:  # the old index names the file there: it waits as a hard link too
                wait_in_place(dst, waiting_url(job.dest, names[i]))
            if state.local or not there:  # on an object store a shard already there needs no move
                with lock:
                    waiting.append(names[i])
            if there:
                with lock:
                    bar.update(info.bytes)
                return i, None
            dst = waiting_url(job.dest, names[i])
        if _complete(dst, info, keep, dest_options):
            with lock:
                bar.update(info.bytes)
            return i, None
        return i, _copy_one(srcs[i], dst, info, src_options, dest_options, bar, lock)

    try:
        with cf.ThreadPoolExecutor(max_workers=workers) as ex:
            futures = [ex.submit(one, i) for i in range(len(index.shards))]
            try:
                for fut in cf.as_completed(futures):
                    i, n = fut.result()
                    if n is None:
                        result.kept.append(names[i])
                    else:
                        result.copied.append(names[i])
                        result.bytes_copied += n
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise
    finally:
        bar.close()
    result.copied.sort()
    result.kept.sort()
    return sorted(waiting)


def _same_place(a: str, b: str) -> bool:
    def key(u: str) -> str:
        u = u.rstrip("/")
        return os.path.realpath(storage.local_path(u)) if storage.is_local(u) else u

    return bool(a) and key(a) == key(b)
