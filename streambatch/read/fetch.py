"""Getting a shard's bytes to the tar parser, as one unbroken stream per piece of a worker's plan.

Three ways, picked per shard by :class:`Fetcher`: a local file is read directly; with a cache directory a
remote shard is downloaded whole once per node (checked) and read from disk; otherwise it is read as range
requests (:mod:`.ranges`) that resume where one broke, on demand or by a background read-ahead bounded by bytes.
Size is checked against the index before any byte is used, the sha256 once the shard was read in full.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..dataset.format import Digest, HashingReader, sha256_problem
from ..dataset.storage import is_local, local_path
from ..errors import ShardReadError
from .faults import ChecksumMismatch, FaultLog, waiting_on_storage
from .ranges import Count, RangeReader, check_size
from .readahead import InOrder, Job, ReadAhead, job_chunks
from .verified import changed_since, object_key, recorded_sha256, remember, remember_sha256


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
class _Cached:
    """Remote shards through the node-local cache (:mod:`streambatch.read.cache`): downloaded whole once per
    node, checked (size and sha256), then read from disk."""

    def __init__(self, opts: Any, ranges: RangeReader, pool: ThreadPoolExecutor | None, count: Count):
        from .cache import ShardCache

        self.cache = ShardCache(opts.cache_dir, opts.cache_size)
        self.opts = opts
        self.ranges = ranges
        self.pool = pool
        self.count = count

    def prepare(self, job: Job) -> None:
        """The cached copy of the job's shard (downloaded first if no process of this node has it yet)."""
        try:
            path, downloaded = self.cache.get(job.url, job.expected_size, lambda tmp: self._download(job, tmp))
        except ShardReadError:
            raise
        except Exception as e:  # noqa: BLE001 - disk full, cache misconfigured, ...
            raise ShardReadError(f"{job.url}: could not cache the shard ({type(e).__name__}: {e})") from e
        self.count("cache_downloads" if downloaded else "cache_hits")
        job.local, job.size, job.verified = path, os.path.getsize(path), True

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
        self.cache = _Cached(opts, self.ranges, self._pool, self._count) if use_cache else None
        self.read_ahead: ReadAhead | None = None
        if self.background:
            assert self._pool is not None
            self.read_ahead = ReadAhead(
                jobs, self._prepare, self.ranges, self._pool, opts, use_cache, self._stop, self._wants_sha, ramp
            )

    def _count(self, name: str, n: int = 1) -> None:
        if self.faults is not None:
            self.faults.add(name, n)

    def _prepare(self, job: Job) -> None:
        """Size check, or the cached copy: whatever must happen before the job's first byte is read."""
        if is_local(job.url):
            _prepare_local(job, self.opts.verify)
            if self._wants_sha(job) and job.stat is not None:
                job.reused = recorded_sha256(job.local or "", job.stat, self.opts.cache_dir) == job.expected_sha
        elif self.cache is not None:
            self.cache.prepare(job)
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
            f = open(job.local, "rb")
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
            return "the file changed while it was read" if changed_since(job.local, job.stat) else None
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

    def close(self) -> None:
        """Stop: no new requests, queued ones dropped, the pool shut down without waiting."""
        self._stop.set()
        if self.read_ahead is not None:
            self.read_ahead.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
