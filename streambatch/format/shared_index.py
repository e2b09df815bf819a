"""Start-up in O(nodes) storage requests: a remote index's header and shard table read once per node, shared by the
node's ranks through the node cache folder (the loader's ``cache_dir``).

Without it, every rank of a job opens ``index.json`` and the shard table itself: on 1,024 ranks that is 1,024 × (a
HEAD, the header, the table) at the same second, the request storm object stores throttle. With a ``cache_dir``, the
ranks of one node take turns on one lock (``cache_dir/locks/index-NAME.lock``); the first asks the store for the index
file's size and ETag (or mtime), and only when no copy of that version is on the node fetches the header and the shard
table into ``cache_dir/index/NAME-VERSION/``. The others find the copy and make no request at all: the copy records
the job that checked it last (`job_key()`: the launcher process, e.g. torchrun's agent, and its restart count),
and the ranks of that job trust that check for `REUSE_SECONDS`. A new job checks again (one HEAD per node),
so a changed index (another size, ETag or mtime) is fetched again, into a folder of its own (old versions' folders
stay until the cache folder is cleared: a header and a shard table are small).

A node copy is read exactly as the original is: its header by the same parser, its shard table with the same checks
(size, checksums, the write id shared with the header, row counts), and its shard URLs resolved against the
*original* index's folder and the user's ``shard_roots`` (`trust`); a copy that fails a check is removed and
the error raised. Sample-table row groups are not copied: each rank reads its own shards' row groups from the store,
as without a cache. Only remote indexes are shared (a local path is read directly), as for the shard cache. A
``cache_dir`` that cannot be written is an `OptionError`; a disk too full for the copy
just now makes the process read the index from the store, as without a cache (warned). A copy deleted while a job
runs (the cache folder cleared) is not needed again: a process that reads a shard-table column later (a DataLoader
worker) opens the original beside the index in the store instead, with the same checks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Sequence

from .. import limits
from ..errors import NO_SPACE_ERRNOS, DatasetNotFound, IndexFormatError, os_problem
from ..io import storage
from ..io.node_files import cache_folder, cache_name, file_lock
from ..io.storage import is_local
from .columnar import beside_index
from .index import ShardIndex, _index_url

log = logging.getLogger("streambatch")

COPIES = "index"  # the folder under the cache folder that holds the node copies of indexes
SHARD_TABLE = "shards.parquet"  # the shard table's name in a node copy (never a name the index chose)
CHUNK = 16 << 20  # bytes per request when copying a table
#: how long a job's check of the index's version holds for its other ranks (they start within seconds of each
#: other; a loader made later in the job, or a process that only looks like a launched one, checks again)
REUSE_SECONDS = 600.0


def load_index(
    url: str, storage_options: dict | None = None, shard_roots: Sequence[str] = (), cache_dir: str | None = None
) -> ShardIndex:
    """The index at ``url``: through the node copy under ``cache_dir`` where there is one and the index is remote
    (`load_shared()`), else read directly (`ShardIndex.load()`)."""
    if cache_dir is None or is_local(_index_url(str(url))):
        return ShardIndex.load(str(url), storage_options, shard_roots)
    try:
        return load_shared(str(url), cache_dir, storage_options, shard_roots)
    except OSError as e:
        if e.errno not in NO_SPACE_ERRNOS:  # the store's errors (no index, access denied) are the user's to see
            raise
        log.warning(
            "streambatch: no room for the node copy of the index %s in cache_dir=%r (%s); this process reads it "
            "from the store",
            url,
            cache_dir,
            os_problem(e),
        )
        return ShardIndex.load(str(url), storage_options, shard_roots)


def load_shared(
    url: str,
    cache_dir: str,
    storage_options: dict | None = None,
    shard_roots: Sequence[str] = (),
    job: str | None = "auto",
) -> ShardIndex:
    """The index at ``url`` read from this node's copy under ``cache_dir``, fetched by the first rank of the node
    that needs it (see the module). ``job``: who may reuse a check without asking the store again (``"auto"``:
    `job_key()`; None: every call checks the index's version, one HEAD)."""
    url = _index_url(url)
    copies = NodeCopies(cache_dir)
    job = job_key() if job == "auto" else job
    index = None
    with file_lock(copies.lock(url)):
        version = copies.checked(url, job)
        if version is None:
            version = remote_version(url, storage_options)
            if not copies.has(url, version):
                copies.fetch(url, version, storage_options)
                index = copies.open(url, version, storage_options, shard_roots)  # checked before anyone uses it
            copies.stamp(url, version, job)
    return index if index is not None else copies.open(url, version, storage_options, shard_roots)


def job_key() -> str | None:
    """What the processes of one job on one node share: their launcher (torchrun's agent, SLURM's step daemon) by
    pid and start time, and its restart count; None outside a launcher (each process then checks the version)."""
    env = os.environ
    if "LOCAL_RANK" not in env and "SLURM_STEP_ID" not in env:
        return None
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # field 22: the start time, in clock ticks
    except (OSError, IndexError):
        return None
    restarts = env.get("TORCHELASTIC_RESTART_COUNT", "") + "/" + env.get("SLURM_RESTART_COUNT", "")
    return f"{socket.gethostname()}:{parent}:{started}:{restarts}"


def remote_version(url: str, storage_options: dict | None = None) -> str:
    """The index file's version as the store reports it (size and ETag, version id or mtime): one request."""
    try:
        return storage.version(url, storage_options)
    except FileNotFoundError as e:
        raise DatasetNotFound(f"no dataset index at {url}") from e


class NodeCopies:
    """The node copies of remote indexes under a cache folder: one folder per (index URL, version), and per URL a
    stamp naming the version last checked and the job that checked it."""

    def __init__(self, cache_dir: str) -> None:
        self.root = cache_folder(cache_dir, COPIES)  # a cache_dir that cannot be written: an OptionError
        self.locks = cache_folder(cache_dir, "locks")

    def lock(self, url: str) -> str:
        return os.path.join(self.locks, f"index-{cache_name(url)}.lock")

    def folder(self, url: str, version: str) -> str:
        return os.path.join(self.root, f"{cache_name(url)}-{hashlib.sha1(version.encode()).hexdigest()[:12]}")

    def _stamp_path(self, url: str) -> str:
        return os.path.join(self.root, cache_name(url) + ".json")

    def checked(self, url: str, job: str | None) -> str | None:
        """The version this job already checked ``url`` at (its copy on the node), or None: ask the store."""
        if job is None:
            return None
        try:
            with open(self._stamp_path(url), "rb") as f:
                stamp = limits.loads(f.read(1 << 16))  # a stamp is ~200 bytes; the cache folder may be shared
        except (OSError, ValueError):
            return None
        ok = isinstance(stamp, dict) and stamp.get("url") == url and stamp.get("job") == job
        age = time.time() - stamp.get("at", 0) if ok and isinstance(stamp.get("at"), (int, float)) else None
        version = stamp.get("version") if age is not None and 0 <= age < REUSE_SECONDS else None
        return version if isinstance(version, str) and self.has(url, version) else None

    def has(self, url: str, version: str) -> bool:
        return os.path.isfile(os.path.join(self.folder(url, version), "index.json"))

    def stamp(self, url: str, version: str, job: str | None) -> None:
        """Record the version of ``url`` this job checked (written whole: a reader sees the old stamp or this one)."""
        path = self._stamp_path(url)
        tmp = f"{path}.tmp-{os.getpid():x}-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            json.dump({"url": url, "version": version, "job": job, "at": time.time()}, f)
        os.replace(tmp, path)

    def fetch(self, url: str, version: str, storage_options: dict | None) -> None:
        """Copy the index file and its shard table from the store into the version's folder (written under a
        temporary name, renamed whole). The table's path is checked to lie beside the index before it is asked for."""
        final = self.folder(url, version)
        tmp = f"{final}.tmp-{os.getpid():x}-{uuid.uuid4().hex[:8]}"
        os.makedirs(tmp)
        try:
            with open(os.path.join(tmp, "index.json"), "wb") as out:
                out.write(storage.read_whole(url, storage_options))
            entry = _shard_table_entry(os.path.join(tmp, "index.json"))
            if entry is not None:
                rel, size = entry
                table = storage.join_url(storage.parent_url(url), rel)
                try:  # one byte more than the header says: a longer table shows when the copy is checked
                    copy_object(table, os.path.join(tmp, SHARD_TABLE), size + 1, storage_options)
                except FileNotFoundError as e:
                    raise IndexFormatError(f"{url}: its shard table {rel} is missing ({e})") from e
            shutil.rmtree(final, ignore_errors=True)  # a copy of this version that failed its checks
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("streambatch: fetched the index %s to this node's copy %s", url, final)

    def open(self, url: str, version: str, storage_options: dict | None, shard_roots: Sequence[str]) -> ShardIndex:
        """The index from the node copy, checked as the original would be; a copy that fails is removed."""
        folder = self.folder(url, version)
        try:
            with open(os.path.join(folder, "index.json"), "rb") as f:
                raw = f.read()
            rel = _shard_table_entry(os.path.join(folder, "index.json"))
            tables = {rel[0]: os.path.join(folder, SHARD_TABLE)} if rel is not None else None
            return ShardIndex.from_raw(raw, url, storage_options, shard_roots, tables)
        except Exception:
            with contextlib.suppress(OSError):
                os.remove(self._stamp_path(url))  # the next rank checks and fetches again
            shutil.rmtree(folder, ignore_errors=True)
            raise


def copy_object(url: str, dest: str, limit: int, storage_options: dict | None) -> None:
    """Write at most ``limit`` bytes of the object ``url`` to the local file ``dest``, in ranged reads of about
    `CHUNK` bytes (a small object is one request); ``limit`` is one byte more than the object should hold. A last
    read of one byte alone is joined to the one before it: a read starting at the object's end is refused."""
    at = 0
    with open(dest, "wb") as out:
        while at < limit:
            want = limit - at if limit - at <= CHUNK + 1 else CHUNK
            data = storage.read_range(url, at, at + want, storage_options)
            out.write(data)
            at += len(data)
            if len(data) < want:
                break


def _shard_table_entry(header_path: str) -> tuple[str, int] | None:
    """(path beside the index, bytes) of the shard table a version 2 header names; None for anything else (its own
    checks then name what is wrong when the copy is read)."""
    try:
        with open(header_path, "rb") as f:
            d = limits.loads(f.read())
        entry = d["tables"]["shards"]
        rel, size = entry["path"], int(entry["bytes"])
    except (ValueError, TypeError, KeyError):
        return None
    return (rel, size) if beside_index(rel) and size >= 0 and d.get("version") == 2 else None
