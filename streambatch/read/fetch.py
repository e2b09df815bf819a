"""Getting a shard's bytes to the tar parser, as one unbroken stream per piece of a worker's plan.

Three ways, picked per shard by `Fetcher`: a local file is read directly; with a cache directory a
remote shard is downloaded whole once per node (checked) and read from disk; otherwise it is read as range
requests (`ranges`) that resume where one broke, on demand or by a background read-ahead bounded by bytes.
Size is checked against the index before any byte is used, the sha256 once the shard was read in full.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, cast

from ..errors import ShardReadError, StreamBatchError
from ..io import objstore
from ..io.cache import ShardCache
from ..io.digest import Digest, HashingReader, sha256_problem
from ..io.node_files import object_version
from ..io.ranges import Count, RangeReader, check_size
from ..io.readahead import InOrder, Job, ReadAhead, job_chunks
from ..io.retry import call_with_retry
from ..io.storage import is_local, local_path, reading_filesystem
from ..io.verified import changed_since, fd_changed, object_key, recorded_sha256, remember, remember_sha256
from .faults import ChecksumMismatch, FaultLog, waiting_on_storage

log = logging.getLogger("streambatch")


class ChunkStream:
    """A read-only file object over a sequence of chunks, hashing what it delivers."""

    def __init__(
        self,
        next_chunk: Callable[[], bytes | None],
        sha: bool,
        close: Callable[[], None] | None = None,
        hashed: Digest | None = None,
    ):
        """``hashed``: the digest someone else feeds with the same bytes (the read-ahead's), used instead."""
        self._next = next_chunk
        self._buf = memoryview(b"")
        self._off = 0
        self._eof = False
        self.delivered = 0
        self.digest = hashed if hashed is not None else (Digest() if sha else None)
        self._hashing = hashed is None and sha
        self._close = close

    def readable(self) -> bool:
        return True

    def _fill(self) -> bool:
        if self._eof:
            return False
        data = self._next()
        if not data:
            self._eof = True
            return False
        if self._hashing and self.digest is not None:
            self.digest.update(data)
        self._buf, self._off = memoryview(data), 0
        return True

    def _read_all(self) -> bytes:
        out = [self._buf[self._off :]]
        self._buf, self._off = memoryview(b""), 0
        while self._fill():
            out.append(self._buf)
            self._buf = memoryview(b"")
        return b"".join(out)

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            data = self._read_all()
            self.delivered += len(data)
            return data
        off, buf = self._off, self._buf
        if off + n <= len(buf):  # within the chunk at hand: most tar headers and members
            self._off = off + n
            self.delivered += n
            return buf[off : off + n].tobytes()
        out = []
        want = n
        while want > 0:
            if self._off >= len(self._buf) and not self._fill():
                break
            take = min(want, len(self._buf) - self._off)
            out.append(self._buf[self._off : self._off + take])
            self._off += take
            want -= take
        data = out[0].tobytes() if len(out) == 1 else b"".join(out)
        self.delivered += len(data)
        return data

    def skip(self, n: int) -> int:
        """Pass over ``n`` bytes without copying them (a tar member's padding); how many there were."""
        done = 0
        while done < n:
            if self._off >= len(self._buf) and not self._fill():
                break
            take = min(n - done, len(self._buf) - self._off)
            self._off += take
            done += take
        self.delivered += done
        return done

    def drain(self) -> None:
        """Read to the end (for the checksum)."""
        self.delivered += len(self._buf) - self._off
        self._buf, self._off = memoryview(b""), 0
        while self._fill():
            self.delivered += len(self._buf)
            self._buf = memoryview(b"")

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


# ---- strategy 1: a local file ---------------------------------------------------------------------------
def _prepare_local(job: Job, verify: str) -> str:
    """A local shard: check it is there with the index's size, and read the file itself (its path, returned)."""
    p = local_path(job.url)
    try:
        job.stat = os.stat(p)
        size = job.stat.st_size
    except FileNotFoundError as e:
        raise ShardReadError(f"{job.url}: shard not found") from e
    except OSError as e:
        raise ShardReadError(f"{job.url}: cannot open shard ({e})") from e
    check_size(job.url, size, job.expected_size, verify)
    job.size, job.local = size, p
    return p


def _local_range(f: Any, lo: int, hi: int, chunk_size: int) -> Callable[[], bytes]:
    """Chunks of bytes ``[lo, hi)`` of an open local file."""
    f.seek(lo)
    left = [hi - lo]

    def next_chunk() -> bytes:
        data = f.read(min(chunk_size, left[0])) if left[0] > 0 else b""
        left[0] -= len(data)
        return data

    return next_chunk


# ---- strategy 2: the node-local cache -------------------------------------------------------------------
#: after the node cache failed to store a shard, how long only the shards it holds are read from it
CACHE_RETRY_SECONDS = 60.0
_WARNED: set[tuple[str, int | None]] = set()  # (cache_dir, errno) this process warned about


def os_reason(e: OSError) -> str:
    """An OS error as a message names it: ``ENOSPC: No space left on device: 'path'``."""
    code = errno.errorcode.get(e.errno or 0, "")
    where = f": {e.filename!r}" if e.filename else ""
    return f"{code + ': ' if code else ''}{e.strerror or e}{where}"


class _Cached:
    """Remote shards through the node-local cache (`streambatch.io.cache`): downloaded whole once per
    node, checked (size and sha256), then read from disk. A cache that cannot store a shard (its disk full or
    over quota, read-only, its folders unmakeable) is not the shard's fault: that shard is streamed as without a
    cache (warned), and for `CACHE_RETRY_SECONDS` only shards it already holds are read from it."""

    def __init__(
        self, opts: Any, ranges: RangeReader, pool: ThreadPoolExecutor | None, count: Count, bypassed: Callable[[], int]
    ):
        """``bypassed()``: how many shards the rank read around the cache this pass (for one warning per rank)."""
        self.opts = opts
        self.ranges = ranges
        self.pool = pool
        self.count = count
        self.bypassed = bypassed
        self._cache: ShardCache | None = None  # made at the first shard (the folders then, not at start)
        self._skip_until = 0.0  # until then (monotonic) nothing is downloaded into the cache

    def prepare(self, job: Job) -> bool:
        """Point ``job`` at the cached copy of its shard, opened (downloaded first if no process of this node has
        it yet); False where the cache cannot hold it: the caller streams the shard as without a cache."""
        try:
            got = self._open(job)
        except ShardReadError:  # the store's or the data's (every error of a request is one)
            raise
        except StreamBatchError as e:  # missing credentials, ...
            raise ShardReadError(f"{job.url}: could not cache the shard ({type(e).__name__}: {e})") from e
        except OSError as e:  # what is left is the cache's own disk: not the shard's fault
            self._unusable(job.url, e)
            return False
        if got is None:
            self.count("cache_bypassed")
            return False
        f, downloaded, job.local = got
        self.count("cache_downloads" if downloaded else "cache_hits")
        job.file, job.size, job.verified = f, os.fstat(f.fileno()).st_size, True
        return True

    def _open(self, job: Job) -> tuple[BinaryIO, bool, str] | None:
        """(the cached copy, opened; whether it was downloaded now; its path), or None: not cached, and the cache
        is resting after a failure."""
        if self._cache is None:
            self._cache = ShardCache(self.opts.cache_dir, self.opts.cache_size)
        if self._larger_than_cache(job):
            return None
        version = self._version(job)
        path = self._cache.path(job.url, version)
        if time.monotonic() < self._skip_until:
            f = self._cache.cached(job.url, job.expected_size, version)
            return None if f is None else (f, False, path)
        f, downloaded = self._cache.open(job.url, job.expected_size, lambda tmp: self._download(job, tmp), version)
        return f, downloaded, path

    def _version(self, job: Job) -> str:
        """What names the content of ``job``'s shard, the key of its cached copy: the index's sha256 of it, or
        where the index has none, the version the store names (ETag, version id, mtime: one request)."""
        if job.expected_sha:
            return "sha256:" + job.expected_sha
        store = objstore.store_for(job.url, self.ranges.storage_options, self.opts.timeout or None)
        if store is not None:
            ask = lambda: objstore.head(store[0], store[1], job.url)  # noqa: E731
        else:
            fs, path = reading_filesystem(job.url, self.ranges.storage_options, self.opts.timeout)
            ask = lambda: fs.info(path)  # noqa: E731
        try:
            info = call_with_retry(ask, self.opts.retry, job.url)
        except FileNotFoundError as e:
            raise ShardReadError(f"{job.url}: shard not found") from e
        except Exception as e:  # noqa: BLE001 - anything that leaves the shard unreadable
            raise ShardReadError(f"{job.url}: cannot open shard ({type(e).__name__}: {e})") from e
        if store is not None:
            size, version = info
            return "store:" + object_version({"size": size, "ETag": version})
        return "store:" + object_version(cast("dict[str, Any]", info))

    def _larger_than_cache(self, job: Job) -> bool:
        """A shard larger than the whole cache (``cache_size``) is streamed as without a cache (it would evict
        everything and still not fit); warned once per process and cache."""
        most = self._cache.max_bytes if self._cache is not None else None
        if most is None or job.expected_size is None or job.expected_size <= most:
            return False
        key = (str(self.opts.cache_dir), errno.EFBIG)
        if key not in _WARNED:
            _WARNED.add(key)
            log.warning(
                "streambatch: %s: %d bytes do not fit cache_size=%d: such shards are read from storage as without "
                "a cache, every epoch (nothing is lost); raise cache_size above the largest shard to cache them",
                job.url,
                job.expected_size,
                most,
            )
        return True

    def _unusable(self, url: str, e: OSError) -> None:
        """The cache could not store ``url``'s shard: count it, rest the cache (not when its folders were deleted:
        the next shard makes them again), and warn once per process, cache and error, and once per rank and pass."""
        rest = 0.0 if e.errno == errno.ENOENT else CACHE_RETRY_SECONDS
        self._skip_until = time.monotonic() + rest
        key = (str(self.opts.cache_dir), e.errno)
        first = key not in _WARNED and self.bypassed() == 0  # the rank's workers share the count
        _WARNED.add(key)
        self.count("cache_bypassed")
        if not first:
            log.info("streambatch: %s: read without the node cache (%s)", url, os_reason(e))
            return
        log.warning(
            "streambatch: the node cache in cache_dir=%r cannot store shards (%s, first for %s): reading such shards "
            "from storage as without a cache (nothing is lost); the cache is tried again %s",
            str(self.opts.cache_dir),
            os_reason(e),
            url,
            f"in {rest:.0f} s" if rest else "at the next shard",
        )

    def _download(self, job: Job, tmp: str) -> None:
        """Fetch a whole shard into ``tmp`` (for the cache), checking size and checksum."""
        size = self.ranges.size(job.url, job.expected_size)
        with open(tmp, "wb") as f:
            for data in self._pieces(job.url, size):
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if os.path.getsize(tmp) != size:
            raise ShardReadError(f"{job.url}: downloaded {os.path.getsize(tmp)} bytes, expected {size}")
        if self.opts.verify == "sha256" and job.expected_sha:
            with open(tmp, "rb") as f:
                problem = sha256_problem(HashingReader(f.read).drain(1 << 22).hexdigest(), job.expected_sha)
            if problem:
                raise ChecksumMismatch(f"{job.url}: {problem}")

    def _pieces(self, url: str, size: int) -> Iterator[bytes]:
        """The object's chunks in order; with a pool, ``read_concurrency`` at a time (and at most that many
        in memory: they are submitted in windows)."""
        cs = self.opts.chunk_size
        offsets = list(range(0, size, cs))
        if self.pool is None or len(offsets) <= 1:
            for o in offsets:
                yield self.ranges.fetch(url, o, min(o + cs, size))
            return
        w = self.opts.read_concurrency
        for i in range(0, len(offsets), w):
            futs = [self.pool.submit(self.ranges.fetch, url, o, min(o + cs, size)) for o in offsets[i : i + w]]
            for fut in futs:
                yield fut.result()


# ---- the fetcher: picks the strategy per shard ----------------------------------------------------------
class Fetcher:
    """Delivers the bytes of a worker's jobs (one per piece), in order; see the module doc."""

    def __init__(
        self, jobs: list[Job], storage_options: dict | None, opts: Any, faults: FaultLog | None, ramp: bool = True
    ):
        self.jobs = jobs
        self.opts = opts  # the reader's ReadOptions
        self.faults = faults
        self._stop = threading.Event()
        self.ranges = RangeReader(storage_options, opts.retry, opts.verify, self._count, self._stop)
        remote = [j for j in jobs if not is_local(j.url)]
        use_cache = bool(opts.cache_dir and remote)
        self.background = bool(remote) and (opts.read_ahead > 0)
        self._pool: ThreadPoolExecutor | None = None
        if self.background or (use_cache and opts.read_concurrency > 1):
            threads = max(opts.read_concurrency, opts.max_read_concurrency if self.background else 1)
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="streambatch-fetch")
        self.cache = _Cached(opts, self.ranges, self._pool, self._count, self._bypassed) if use_cache else None
        self.read_ahead: ReadAhead | None = None
        if self.background:
            assert self._pool is not None
            self.read_ahead = ReadAhead(
                jobs, self._prepare, self.ranges, self._pool, opts, use_cache, self._stop, self._wants_sha, ramp
            )

    def _count(self, name: str, n: int = 1) -> None:
        if self.faults is not None:
            self.faults.add(name, n)

    def _bypassed(self) -> int:
        return self.faults.total("cache_bypassed") if self.faults is not None else 0

    def _prepare(self, job: Job) -> None:
        """Size check, or the cached copy: whatever must happen before the job's first byte is read."""
        if is_local(job.url):
            _prepare_local(job, self.opts.verify)
            if self._wants_sha(job) and job.stat is not None:
                job.reused = recorded_sha256(job.local or "", job.stat, self.opts.cache_dir) == job.expected_sha
        elif self.cache is not None and self.cache.prepare(job):
            if self._stop.is_set():  # closed while it was prepared: nobody reads it
                _release(job)
        elif job.expected_size is not None:
            # no size request: every range answer carries the object's size, and the first one is checked
            # (with the index's size) before a byte of it reaches the parser
            job.size = job.expected_size
        else:
            job.size = self.ranges.size(job.url, job.expected_size)

    def open(self, job: Job) -> ChunkStream:
        """The byte stream of ``job`` (jobs are opened in order). The time spent waiting for the job to be
        prepared and for each of its chunks counts as waiting on storage; read-ahead done in time does not."""
        count = self._count if self.faults is not None else None
        waiting_on_storage(self._ready, count)(job)
        sha = self._wants_sha(job) and not job.reused
        next_chunk, close = self._chunk_source(job)
        hashed = job.digest if job.local is None and self.read_ahead is not None else None
        return ChunkStream(waiting_on_storage(next_chunk, count), sha, close, hashed if sha else None)

    def _wants_sha(self, job: Job) -> bool:
        """Whether the job's bytes must match the index's sha256 (a cached copy was checked when downloaded)."""
        return self.opts.verify == "sha256" and bool(job.expected_sha) and not job.verified and job.byte_range is None

    def _ready(self, job: Job) -> None:
        """Wait for the read-ahead to prepare ``job``, or prepare it here."""
        if self.read_ahead is not None:
            self.read_ahead.opened(job)
        else:
            self._prepare(job)

    def _chunk_source(self, job: Job) -> tuple[Callable[[], bytes | None], Callable[[], None] | None]:
        """The job's next-chunk function, and what closes its file (None: nothing to close)."""
        if job.local is not None:
            f = job.opened = _opened(job)
            cs = min(self.opts.chunk_size, 1 << 20)
            if job.byte_range is not None:
                return _local_range(f, *job.byte_range, cs), f.close
            return (lambda: f.read(cs)), f.close
        if self.read_ahead is not None:
            read_ahead = self.read_ahead
            return (lambda: read_ahead.take(job)), None
        return self._on_demand(job), None

    def _on_demand(self, job: Job) -> Callable[[], bytes | None]:
        """Strategy 3a: the job's chunks requested one at a time, as the parser asks for them."""
        chunks = job_chunks(job, self.opts.chunk_size)

        def next_chunk() -> bytes | None:
            o = next(chunks, None)
            return None if o is None else self.ranges.read(job.url, o[0], o[0] + o[1], job.expected_size)

        return next_chunk

    def check(self, job: Job, stream: ChunkStream) -> None:
        """After the whole shard (or the job's byte range) was read: its size and checksum (not for a range)."""
        want = job.byte_range[1] - job.byte_range[0] if job.byte_range is not None else job.size
        if want is not None and stream.delivered != want:
            raise ShardReadError(f"{job.url}: read {stream.delivered} bytes, expected {want}")
        order = job.in_order if job.local is None else None  # a remote shard hashed as it arrived, or not again
        hashed = stream.digest is not None and not (order is not None and order.reused)
        problem = sha256_problem(stream.digest.hexdigest(), job.expected_sha) if hashed and stream.digest else None
        if hashed:
            self._count("sha256_hashed")
        if job.stat is not None and job.local is not None and self._wants_sha(job):
            problem = problem or self._local_checked(job, stream)
        if order is not None:
            problem = problem or self._remote_checked(job, stream, order)
        if problem:
            raise ChecksumMismatch(f"{job.url}: {problem}")

    def _local_checked(self, job: Job, stream: ChunkStream) -> str | None:
        """A local file read whole: remember its hash for this version of the file, or (hash taken from the
        node record) make sure the file did not change while it was read."""
        assert job.stat is not None and job.local is not None
        if job.reused:
            self._count("sha256_reused")
            return "the file changed while it was read" if _changed(job) else None
        if stream.digest is not None:
            with contextlib.suppress(OSError):
                remember_sha256(job.local, job.stat, os.stat(job.local), stream.digest.hexdigest(), self.opts.cache_dir)
        return None

    def _remote_checked(self, job: Job, stream: ChunkStream, order: InOrder) -> str | None:
        """A remote shard read whole: remember its hash for the version its answers named, or (that version was
        hashed on this node before) make sure every answer named it."""
        if order.changed:
            return "the object changed while it was read (another version answered)"
        if order.reused:
            self._count("sha256_reused")
        elif stream.digest is not None and order.version is not None and job.size is not None:
            digest = stream.digest.hexdigest()
            if digest == job.expected_sha:
                remember(object_key(job.url, job.size, order.version), digest, self.opts.cache_dir)
        return None

    def finish(self, job: Job) -> None:
        """The parser is done with ``job``: drop whatever is still queued for it."""
        if self.read_ahead is not None:
            self.read_ahead.finish(job)
        else:
            job.cancelled = True
        _release(job)

    def close(self) -> None:
        """Stop: no new requests, queued ones dropped, the pool shut down without waiting."""
        self._stop.set()
        if self.read_ahead is not None:
            self.read_ahead.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for job in self.jobs:
            _release(job)


def _opened(job: Job) -> BinaryIO:
    """The job's file, now the reader's to close: the cached copy opened when it was prepared, or the local file."""
    f, job.file = job.file, None
    if f is not None:
        return f
    try:
        return open(job.local or "", "rb")
    except OSError as e:
        raise ShardReadError(f"{job.url}: cannot open shard ({e})") from e


def _changed(job: Job) -> bool:
    """Whether a local file read whole is no longer the version its stat at preparation describes. Asked of the
    open file where the reader still holds it, so a file deleted or renamed after it was opened (its bytes kept by
    the descriptor) is still that version (`fd_changed()`)."""
    assert job.local is not None and job.stat is not None
    f = job.opened
    if f is not None and not f.closed:
        return fd_changed(f.fileno(), job.stat, job.local)
    return changed_since(job.local, job.stat)


def _release(job: Job) -> None:
    """Close the cached copy a job holds open, if nobody took it (prepared, then never read)."""
    f, job.file = job.file, None
    if f is not None:
        f.close()
