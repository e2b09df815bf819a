"""The read-ahead of range requests: a background thread that keeps a worker's next chunks requested, so the
latency of one request hides behind the parsing of the bytes before it (`ReadAhead`), and the
`Job` (one piece's shard) that `fetch` and the parser share."""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

from ..errors import ShardReadError
from .digest import Digest
from .objstore import same_bytes as _same
from .ranges import RangeReader
from .retry import RetryPolicy
from .verified import hashed_on_node


class Job:
    """The byte stream of one piece's shard, as the fetcher prepares it."""

    def __init__(self, ordinal: int, url: str, shard: int, size: int | None, sha256: str | None):
        self.ordinal, self.url, self.shard = ordinal, url, shard
        self.expected_size, self.expected_sha = size, sha256
        self.byte_range: tuple[int, int] | None = None  # read only these bytes of the shard (read/skip.py)
        self.size: int | None = None
        self.local: str | None = None  # read this local file (a local shard, or the cached copy)
        self.file: BinaryIO | None = None  # the cached copy, opened when prepared (eviction cannot take it)
        self.verified = False  # the cached copy was checked in full when it was downloaded
        self.stat: os.stat_result | None = None  # a local file's stat when it was prepared (io/verified.py)
        self.opened: BinaryIO | None = None  # the local file the reader streams, open until the job's end
        self.reused = False  # a local file whose sha256 this node already computed for this version of it
        self.error: BaseException | None = None
        self.ready = False
        self.chunks: collections.deque[tuple[Future, int]] = collections.deque()
        self.all_submitted = False
        self.cancelled = False
        self.digest: Digest | None = None  # the read-ahead hashes the chunks as they arrive (see InOrder)
        self.in_order: InOrder | None = None


class InOrder:
    """Feeds a job's chunks to its `Digest` in order, in the request threads as each chunk arrives, so the
    parser's thread does not hash (sha256 lets go of the GIL: on another core it costs the parser nothing). A
    chunk that arrives early waits here for the ones before it; each request returns only after this, so once
    the parser has taken every chunk, every chunk was hashed."""

    def __init__(self, digest: Digest, hashed_before: Callable[[str], bool] | None = None):
        """``hashed_before(version)``: whether this node already hashed that version of the object to the index's
        sha256 (`object_key()`); then nothing is hashed (`reused`)."""
        self.digest = digest
        self._hashed_before = hashed_before
        self._next = 0  # the number of the next chunk to hash
        self._early: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self._first = True
        self.version: str | None = None  # the version the first answer named
        self.reused = False  # that version was hashed on this node before: its bytes are not hashed again
        self.changed = False  # a later answer named other bytes (or, reused, none to vouch for them)

    def arrived(self, number: int, data: bytes, version: str | None = None) -> None:
        """Chunk ``number`` arrived (an answer naming ``version``): hash it, and the early ones it was holding up."""
        with self._lock:
            if self._first:
                self._first, self.version = False, version
                self.reused = version is not None and self._hashed_before is not None and self._hashed_before(version)
            elif (self.reused or None not in (version, self.version)) and not _same(self.version, version):
                self.changed = True
            if self.reused:
                return
            self._early[number] = data
            while self._next in self._early:
                self.digest.update(self._early.pop(self._next))
                self._next += 1


def job_chunks(job: Job, chunk_size: int, ramp: bool = False) -> Iterator[tuple[int, int]]:
    """(offset, length) of the range requests for the job: its shard, or its byte range of it."""
    lo, hi = job.byte_range if job.byte_range is not None else (0, job.size or 0)
    for off, n in chunk_ranges(hi - lo, chunk_size, ramp):
        yield lo + off, n


def chunk_ranges(size: int, chunk_size: int, ramp: bool = False) -> Iterator[tuple[int, int]]:
    """(offset, length) of the range requests for an object of ``size`` bytes. With ``ramp`` the first
    requests are smaller (1/8, 1/4, 1/2 of ``chunk_size``), so the parser can start before a whole chunk has
    arrived (the start of a worker's stream, where nothing was read ahead yet)."""
    off = 0
    n = max(1, chunk_size // 8) if ramp else chunk_size
    while off < size:
        take = min(n, size - off)
        yield off, take
        off += take
        n = min(chunk_size, n * 2)


def ramp_pieces(chunk_size: int) -> int:
    """How many of `chunk_ranges()`'s first requests the ramp cuts smaller than ``chunk_size``."""
    n, k = max(1, chunk_size // 8), 0
    while n < chunk_size:
        n, k = n * 2, k + 1
    return k


class ReadAhead:
    """A background thread that walks ahead through a worker's jobs, prepares each and keeps up to
    ``read_ahead`` bytes of its chunks requested or waiting, so the latency of one request hides behind the
    parsing of the bytes before it, with at most ``max_read_concurrency`` requests in flight at once (obstore's
    requests wait outside the interpreter lock: a waiting request costs a thread, not CPU)."""

    def __init__(
        self,
        jobs: list[Job],
        prepare: Callable[[Job], None],
        ranges: RangeReader,
        pool: ThreadPoolExecutor,
        opts: Any,
        cached: bool,
        stop: threading.Event,
        hashes: Callable[[Job], bool] = lambda job: False,
        ramp: bool = True,
    ):
        self.jobs = jobs
        self.hashes = hashes  # whether a prepared job's bytes are hashed (then here, as they arrive)
        self.ramp = ramp  # the first job's first chunk requested in smaller pieces (not for a lane: read/lanes.py)
        self.prepare = prepare
        self.ranges = ranges
        self.pool = pool
        self.chunk_size, self.limit = opts.chunk_size, opts.read_ahead
        self.policy: RetryPolicy = opts.retry
        self.cached = cached
        self.cache_dir: str | None = getattr(opts, "cache_dir", None)  # where the node record of hashes lives
        self.stop = stop
        self._cond = threading.Condition()
        self._outstanding = 0  # bytes of chunks requested and not yet taken by the parser
        self.peak_outstanding = 0
        self.bound = max(1, opts.max_read_concurrency)  # requests in flight at most
        self.in_flight = 0  # requests submitted and not finished
        self.peak_in_flight = 0
        self._consumer_at = 0
        self._thread = threading.Thread(target=self._run, name="streambatch-read-ahead", daemon=True)
        self._thread.start()

    # ---- the background thread --------------------------------------------------------------------------
    def _run(self) -> None:
        for job in self.jobs:
            if not self._wait_turn(job):
                return
            try:
                self.prepare(job)
            except BaseException as e:  # noqa: BLE001 - handed to the parser, which decides
                job.error = e
            with self._cond:
                job.ready = True
                self._cond.notify_all()
            if job.error is None and job.local is None:
                if self.hashes(job):
                    job.digest = Digest()
                    hashed_before = functools.partial(
                        hashed_on_node, job.url, job.size, job.expected_sha, self.cache_dir
                    )
                    job.in_order = InOrder(job.digest, hashed_before)
                self._request_chunks(job)
            with self._cond:
                job.all_submitted = True
                self._cond.notify_all()

    def _wait_turn(self, job: Job) -> bool:
        """With a cache, download at most two shards ahead of the parser (disk, not memory); without, the
        byte limit of `_request_chunks()` is the bound. False once reading stopped."""
        with self._cond:
            while not self.stop.is_set() and self.cached and job.ordinal > self._consumer_at + 2:
                self._cond.wait(0.5)
            return not self.stop.is_set()

    def _request_chunks(self, job: Job) -> None:
        """Submit the job's range requests, waiting while ``read_ahead`` bytes are outstanding or the in-flight
        bound is reached."""
        assert job.size is not None
        first = self.ramp and job.ordinal == 0
        for i, (off, n) in enumerate(job_chunks(job, self.chunk_size, ramp=first)):
            with self._cond:
                while (
                    not self.stop.is_set()
                    and not job.cancelled
                    and ((self._outstanding > 0 and self._outstanding + n > self.limit) or self.in_flight >= self.bound)
                ):
                    self._cond.wait(0.5)
                if self.stop.is_set() or job.cancelled:
                    break
                self._submit(job, i, off, n)

    def _submit(self, job: Job, number: int, off: int, n: int) -> None:
        """Request ``number`` of the job to the pool (called holding the condition)."""
        try:
            fut = self.pool.submit(self._timed_read, job, number, off, n)
        except RuntimeError:  # the pool is shut down (the fetcher closed, or the interpreter exits): reading is over
            self.stop.set()
            return
        self._outstanding += n
        self.peak_outstanding = max(self.peak_outstanding, self._outstanding)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        fut.add_done_callback(self._ended)
        job.chunks.append((fut, n))
        self._cond.notify_all()

    def _timed_read(self, job: Job, number: int, off: int, n: int) -> bytes:
        """One chunk's range request (in a pool thread), hashed in order where the job is hashed."""
        data, version = self.ranges.read_versioned(job.url, off, off + n, job.expected_size)
        if job.in_order is not None:
            job.in_order.arrived(number, data, version)
        return data

    def _ended(self, _fut: Future) -> None:
        """A request finished, failed or was cancelled: room for the next."""
        with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()

    # ---- the parser's side ------------------------------------------------------------------------------
    def _wait(self, what: str, cond: Callable[[], bool], url: str) -> None:
        deadline = time.monotonic() + self.policy.worst_case
        while not cond():
            if self.stop.is_set():
                raise ShardReadError(f"{url}: reading stopped")
            if time.monotonic() > deadline:
                raise ShardReadError(f"{url}: no {what} after {self.policy.worst_case:.0f}s (read-ahead stalled)")
            self._cond.wait(0.5)

    def opened(self, job: Job) -> None:
        """The parser starts on ``job``: wait until it is prepared; raise what preparing it raised."""
        with self._cond:
            self._consumer_at = job.ordinal
            self._cond.notify_all()
            self._wait("answer", lambda: job.ready, job.url)
        if isinstance(job.error, ShardReadError):
            raise job.error
        if job.error is not None:
            raise read_error(job.url, job.error) from job.error

    def take(self, job: Job) -> bytes | None:
        """The job's next chunk (None at its end)."""
        with self._cond:
            self._wait("data", lambda: bool(job.chunks) or job.all_submitted or job.cancelled, job.url)
            if not job.chunks:
                if self.stop.is_set() and not job.cancelled:  # cut short, not ended: never a shard's clean end
                    raise ShardReadError(f"{job.url}: reading stopped")
                return None
            fut, n = job.chunks.popleft()
        try:
            return fut.result(timeout=self.policy.worst_case)
        except TimeoutError:  # the request outlived every retry's bound: a fetch error like the others
            raise ShardReadError(
                f"{job.url}: no data after {self.policy.worst_case:.0f}s (read-ahead stalled)"
            ) from None
        except ShardReadError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the request raised is this shard's read error
            raise read_error(job.url, e) from e
        finally:
            with self._cond:
                self._outstanding -= n
                self._cond.notify_all()

    def _drop(self, job: Job) -> None:
        for fut, n in job.chunks:
            fut.cancel()
            self._outstanding -= n
        job.chunks.clear()

    def finish(self, job: Job) -> None:
        """The parser is done with ``job``: drop whatever is still queued for it."""
        with self._cond:
            job.cancelled = True
            self._drop(job)
            self._cond.notify_all()

    def close(self) -> None:
        """Reading stopped (``stop`` is set): drop every queued chunk and wake the waiters."""
        with self._cond:
            for job in self.jobs:
                self._drop(job)
            self._cond.notify_all()


def read_error(url: str, e: BaseException) -> ShardReadError:
    """What went wrong fetching ``url``, as the `ShardReadError` the reader counts as a bad shard (a
    timeout or any other error of a background request must not escape that accounting)."""
    return ShardReadError(f"{url}: {type(e).__name__}: {e}")
