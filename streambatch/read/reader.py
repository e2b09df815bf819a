"""Stream tar shards (local or any fsspec URL) into samples: one dict per key, members as raw bytes.

A sample is ``{"__key__", "__url__", "__shard__", "__index__" (position in its shard), "json": dict,
EXT: bytes, ...}`` with extensions split at the first dot of the member name, as webdataset does. Nothing is
decoded here but the small ``.json``, which carries the length.

Remote shards (``s3://``, ``gs://``, ``http(s)://`` ... anything fsspec opens) are read as a sequence of range
requests of ``chunk_size`` bytes. A request that fails with a transient error (connection reset, timeout,
HTTP 5xx, 503 SlowDown) is retried with exponential backoff and jitter and continues at the first byte not
yet received, so the tar parser sees one unbroken byte stream: the shard is never restarted and no sample
is emitted twice. With ``read_ahead`` > 0 a background thread walks ahead through the worker's shards and
keeps up to ``read_ahead`` bytes of chunks requested or waiting (``read_concurrency`` requests at a time),
so the latency of one request is hidden behind the parsing of the bytes before it.

A shard that stays unreadable, or is corrupt (size or sha256 unlike the index's, a broken tar, a bad
``.json``), raises :class:`ShardReadError`. :func:`read_pieces` given a :class:`FaultLog` logs it with its
URL, counts it, skips it and goes on while the rank has had at most ``max_bad_shards`` such shards in the
epoch; past that :class:`TooManyBadShards` stops the epoch.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from .retry import RetryPolicy, call_with_retry, is_transient
from ..dataset.tar import group_samples, iter_members
from ..errors import ShardReadError
from ..plan.shards import Piece
from ..dataset.storage import is_local, local_path, object_size, reading_filesystem, stream_range

log = logging.getLogger("streambatch")

VERIFY = ("sha256", "size", "none")


class ChecksumMismatch(ShardReadError):
    """The shard's sha256 differs from the index's (found once its last byte was read)."""


class TooManyBadShards(RuntimeError):
    """More bad shards in one epoch on one rank than ``max_bad_shards`` allows."""


@dataclass(frozen=True)
class ReadOptions:
    """How shards are read. Sizes are bytes.

    * ``chunk_size``: bytes per range request (remote shards).
    * ``read_ahead``: bytes each worker may hold in requested-but-unparsed chunks; 0 reads on demand.
    * ``read_concurrency``: range requests in flight at once per worker (with read-ahead).
    * ``retry``: retries, backoff and the per-request timeout (:class:`RetryPolicy`).
    * ``verify``: ``"sha256"`` (size before reading, checksum once the shard is read), ``"size"`` or ``"none"``.
    * ``max_bad_shards``: bad shards tolerated per rank and epoch (all its workers together).
    * ``cache_dir`` / ``cache_size``: node-local shard cache (:mod:`streambatch.cache`), ``None`` for none.
    * ``reservoir``: recent samples each worker keeps to re-draw samples lost with a bad shard.
    """

    chunk_size: int = 8 << 20
    read_ahead: int = 64 << 20
    read_concurrency: int = 4
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    verify: str = "sha256"
    max_bad_shards: int = 2
    cache_dir: str | None = None
    cache_size: int | None = None
    reservoir: int = 64

    def __post_init__(self):
        if self.verify not in VERIFY:
            raise ValueError(f"verify must be one of {VERIFY}, got {self.verify!r}")
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        if self.read_concurrency < 1:
            raise ValueError(f"read_concurrency must be at least 1, got {self.read_concurrency}")
        if self.max_bad_shards < 0:
            raise ValueError(f"max_bad_shards must be >= 0, got {self.max_bad_shards}")


# ---- counting faults ----------------------------------------------------------------------------------
FAULT_FIELDS = (
    "bad_shards", "lost_samples", "redrawn_samples", "shrunk_batches", "retries", "bytes_read",
    "cache_downloads", "cache_hits",
)


class FaultLog:
    """One worker's fault counters: a row of ``counts`` (a [workers, fields] array, shared memory in the
    loader, so the main process and the other workers see it), plus a flag per shard that went bad.
    The bad-shard budget is checked against the sum over all rows (the whole rank)."""

    def __init__(
        self,
        counts: np.ndarray | None = None,
        bad: np.ndarray | None = None,
        row: int = 0,
        max_bad_shards: int = 2,
        urls: Sequence[str] | None = None,
        rank: int = 0,
    ):
        self.counts = counts if counts is not None else np.zeros((1, len(FAULT_FIELDS)), dtype=np.int64)
        self.bad = bad
        self.row = row
        self.max_bad_shards = max_bad_shards
        self.urls = urls
        self.rank = rank
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[self.row, FAULT_FIELDS.index(name)] += n

    def total(self, name: str) -> int:
        return int(self.counts[:, FAULT_FIELDS.index(name)].sum())

    def bad_shard(self, shard: int, url: str, reason: str) -> None:
        """Count a bad shard (and log it); raise :class:`TooManyBadShards` past the budget. A shard already
        counted on this rank this pass (another fault of the same shard) is logged, not counted again."""
        if self.bad is not None and 0 <= shard < len(self.bad):
            if self.bad[shard]:
                log.info("streambatch: shard %s again: %s", url, reason)
                return
            self.bad[shard] = 1
        self.add("bad_shards")
        n = self.total("bad_shards")
        if n > self.max_bad_shards:
            listed = ""
            if self.bad is not None and self.urls is not None:
                bad = [self.urls[i] for i in np.flatnonzero(np.asarray(self.bad))[:10]]
                listed = "; bad shards: " + ", ".join(bad)
            raise TooManyBadShards(
                f"{n} bad shards on rank {self.rank} this epoch, more than max_bad_shards={self.max_bad_shards}. "
                f"Last: {reason}{listed}. Check the data with `shardify verify`, rewrite or restore those shards, "
                "or allow more with max_bad_shards=N"
            )
        log.warning(
            "streambatch: skipping bad shard %s: %s (%d of at most %d bad shards on rank %d this epoch)",
            url, reason, n, self.max_bad_shards, self.rank,
        )


@dataclass(frozen=True)
class ShardFault:
    """Marker in a :func:`read_pieces` stream (``markers=True``): piece number ``ordinal`` went bad after
    ``delivered`` of its samples. ``invalidate``: its checksum failed after all were delivered, so the ones
    delivered should not be used any more where that is still possible."""

    ordinal: int
    shard: int
    url: str
    reason: str
    delivered: int
    invalidate: bool = False


# ---- byte streams ---------------------------------------------------------------------------------
class _Job:
    """The byte stream of one piece's shard, as the fetcher prepares it."""

    def __init__(self, ordinal: int, url: str, shard: int, size: int | None, sha256: str | None):
        self.ordinal, self.url, self.shard = ordinal, url, shard
        self.expected_size, self.expected_sha = size, sha256
        self.size: int | None = None
        self.local: str | None = None  # read this local file (a local shard, or the cached copy)
        self.verified = False  # the cached copy was checked in full when it was downloaded
        self.error: BaseException | None = None
        self.ready = False
        self.chunks: collections.deque[tuple[Future, int]] = collections.deque()
        self.all_submitted = False
        self.cancelled = False


class _ChunkStream:
    """A read-only file object over a sequence of chunks, hashing what it delivers."""

    def __init__(self, next_chunk: Callable[[], bytes | None], sha: bool, close: Callable[[], None] | None = None):
        self._next = next_chunk
        self._buf = memoryview(b"")
        self._off = 0
        self._eof = False
        self.delivered = 0
        self.hasher = hashlib.sha256() if sha else None
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
        if self.hasher is not None:
            self.hasher.update(data)
        self._buf, self._off = memoryview(data), 0
        return True

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            out = [self._buf[self._off:]]
            self._buf, self._off = memoryview(b""), 0
            while self._fill():
                out.append(self._buf)
                self._buf = memoryview(b"")
            data = b"".join(out)
            self.delivered += len(data)
            return data
        out = []
        want = n
        while want > 0:
            if self._off >= len(self._buf) and not self._fill():
                break
            take = min(want, len(self._buf) - self._off)
            out.append(self._buf[self._off:self._off + take])
            self._off += take
            want -= take
        data = out[0].tobytes() if len(out) == 1 else b"".join(out)
        self.delivered += len(data)
        return data

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


class _Fetcher:
    """Delivers the bytes of a worker's jobs (one per piece), in order; see the module doc."""

    def __init__(
        self,
        jobs: list[_Job],
        storage_options: dict | None,
        opts: ReadOptions,
        faults: FaultLog | None,
    ):
        self.jobs = jobs
        self.storage_options = storage_options
        self.opts = opts
        self.faults = faults
        self.policy = opts.retry
        self.cache = None
        remote = [j for j in jobs if not is_local(j.url)]
        if opts.cache_dir and remote:
            from .cache import ShardCache

            self.cache = ShardCache(opts.cache_dir, opts.cache_size)
        self.background = bool(remote) and (opts.read_ahead > 0)
        self._cond = threading.Condition()
        self._outstanding = 0  # bytes of chunks requested and not yet taken by the parser
        self._consumer_at = 0
        self._stop = False
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        if self.background or (self.cache is not None and opts.read_concurrency > 1):
            self._pool = ThreadPoolExecutor(max_workers=opts.read_concurrency, thread_name_prefix="streambatch-fetch")
        if self.background:
            self._thread = threading.Thread(target=self._run, name="streambatch-read-ahead", daemon=True)
            self._thread.start()

    # ---- one request, with retries ------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        if self.faults is not None:
            self.faults.add(name, n)

    def _fs(self, url: str):
        return reading_filesystem(url, self.storage_options, self.policy.timeout)

    def _size(self, job: _Job) -> int:
        fs, path = self._fs(job.url)

        def on_retry(e: BaseException, attempt: int) -> None:
            self._count("retries")
            log.info("streambatch: %s: size request failed (%s: %s), retry %d/%d", job.url, type(e).__name__, e,
                     attempt + 1, self.policy.retries)

        try:
            size = call_with_retry(lambda: object_size(fs, path), self.policy, job.url, on_retry)
        except FileNotFoundError as e:
            raise ShardReadError(f"{job.url}: shard not found") from e
        except Exception as e:  # noqa: BLE001 - anything that leaves the shard unreadable
            raise ShardReadError(f"{job.url}: cannot open shard ({type(e).__name__}: {e})") from e
        if self.opts.verify != "none" and job.expected_size is not None and size != job.expected_size:
            raise ShardReadError(f"{job.url}: size is {size} bytes, the index says {job.expected_size}")
        return size

    def _fetch(self, url: str, start: int, end: int, expected_size: int | None = None) -> bytes:
        """Bytes ``[start, end)``; a broken request continues at the first byte not yet received. With
        ``expected_size`` (the index's), an answer that shows another object size is a bad shard."""
        fs, path = self._fs(url)
        parts: list[bytes] = []
        pos, attempt = start, 0
        timeout = 4 * self.policy.timeout if self.policy.timeout else None
        while pos < end:
            if self._stop:
                raise ShardReadError(f"{url}: reading stopped")
            err: BaseException | None = None
            sink: list[bytes] = []
            try:
                total = stream_range(fs, path, pos, end, sink, timeout)
            except Exception as e:  # noqa: BLE001 - classified below
                if not is_transient(e):
                    hint = ""
                    if expected_size is not None and "range" in str(e).lower():
                        hint = f" (the object is shorter than the {expected_size} bytes the index says)"
                    raise ShardReadError(f"{url}: bytes {pos}-{end - 1}: {type(e).__name__}: {e}{hint}") from e
                err, total = e, None
            if expected_size is not None and total is not None and total != expected_size:
                raise ShardReadError(f"{url}: size is {total} bytes, the index says {expected_size}")
            got = sum(len(x) for x in sink)
            if got:
                parts.extend(sink)
                pos += got
                self._count("bytes_read", got)
            if pos >= end:
                break
            if got and err is None:
                continue  # the object ended early? ask again for the rest (counts as no progress next time)
            if got:
                attempt = 0  # progress: this break is a new one
            if attempt >= self.policy.retries:
                why = f"{type(err).__name__}: {err}" if err is not None else "the object ended early"
                raise ShardReadError(f"{url}: bytes {pos}-{end - 1} failed {attempt + 1} times, last: {why}")
            self._count("retries")
            wait = self.policy.delay(attempt)
            log.info("streambatch: %s: read broke at byte %d (%s), retry %d/%d in %.2fs from there", url, pos,
                     f"{type(err).__name__}: {err}" if err is not None else "short read", attempt + 1,
                     self.policy.retries, wait)
            attempt += 1
            if wait > 0:
                time.sleep(wait)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # ---- preparing a job: size check, or the cached copy ------------------------------------------------
    def _prepare(self, job: _Job) -> None:
        if is_local(job.url):
            p = local_path(job.url)
            try:
                size = os.path.getsize(p)
            except FileNotFoundError as e:
                raise ShardReadError(f"{job.url}: shard not found") from e
            except OSError as e:
                raise ShardReadError(f"{job.url}: cannot open shard ({e})") from e
            if self.opts.verify != "none" and job.expected_size is not None and size != job.expected_size:
                raise ShardReadError(f"{job.url}: size is {size} bytes, the index says {job.expected_size}")
            job.size, job.local = size, p
            return
        if self.cache is not None:
            try:
                path, downloaded = self.cache.get(job.url, job.expected_size, lambda tmp: self._download(job, tmp))
            except ShardReadError:
                raise
            except Exception as e:  # noqa: BLE001 - disk full, cache misconfigured, ...
                raise ShardReadError(f"{job.url}: could not cache the shard ({type(e).__name__}: {e})") from e
            self._count("cache_downloads" if downloaded else "cache_hits")
            job.local, job.size, job.verified = path, os.path.getsize(path), True
            return
        if job.expected_size is not None:
            # no size request: every range answer carries the object's size, and the first one is checked
            # (with the index's size) before a byte of it reaches the parser
            job.size = job.expected_size
            return
        job.size = self._size(job)

    def _check_size(self, job: _Job) -> int | None:
        return job.expected_size if self.opts.verify != "none" else None

    def _download(self, job: _Job, tmp: str) -> None:
        """Fetch a whole shard into ``tmp`` (for the cache), checking size and checksum."""
        size = self._size(job)
        cs = self.opts.chunk_size
        offsets = list(range(0, size, cs))
        with open(tmp, "wb") as f:
            if self._pool is not None and len(offsets) > 1:
                # at most read_concurrency chunks in memory: submit in windows
                w = self.opts.read_concurrency
                for i in range(0, len(offsets), w):
                    futs = [self._pool.submit(self._fetch, job.url, o, min(o + cs, size)) for o in offsets[i:i + w]]
                    for fut in futs:
                        f.write(fut.result())
            else:
                for o in offsets:
                    f.write(self._fetch(job.url, o, min(o + cs, size)))
            f.flush()
            os.fsync(f.fileno())
        if os.path.getsize(tmp) != size:
            raise ShardReadError(f"{job.url}: downloaded {os.path.getsize(tmp)} bytes, expected {size}")
        if self.opts.verify == "sha256" and job.expected_sha:
            h = hashlib.sha256()
            with open(tmp, "rb") as f:
                while b := f.read(1 << 22):
                    h.update(b)
            if h.hexdigest() != job.expected_sha:
                raise ChecksumMismatch(
                    f"{job.url}: sha256 is {h.hexdigest()[:12]}..., the index says {job.expected_sha[:12]}..."
                )

    # ---- background read-ahead ----------------------------------------------------------------------
    def _run(self) -> None:
        cs, limit = self.opts.chunk_size, self.opts.read_ahead
        for job in self.jobs:
            with self._cond:
                # with a cache, download at most two shards ahead of the parser (disk, not memory); without,
                # the byte limit below is the bound
                while not self._stop and self.cache is not None and job.ordinal > self._consumer_at + 2:
                    self._cond.wait(0.5)
                if self._stop:
                    return
            try:
                self._prepare(job)
            except BaseException as e:  # noqa: BLE001 - handed to the parser, which decides
                job.error = e
            with self._cond:
                job.ready = True
                self._cond.notify_all()
            if job.error is None and job.local is None:
                assert job.size is not None
                for off, n in _chunks(job.size, cs, ramp=job.ordinal == 0):
                    with self._cond:
                        while (not self._stop and not job.cancelled and self._outstanding > 0
                               and self._outstanding + n > limit):
                            self._cond.wait(0.5)
                        if self._stop or job.cancelled:
                            break
                        self._outstanding += n
                        assert self._pool is not None
                        fut = self._pool.submit(self._fetch, job.url, off, off + n, self._check_size(job))
                        job.chunks.append((fut, n))
                        self._cond.notify_all()
            with self._cond:
                job.all_submitted = True
                self._cond.notify_all()

    def _wait(self, what: str, cond: Callable[[], bool], url: str) -> None:
        deadline = time.monotonic() + self.policy.worst_case
        while not cond():
            if self._stop:
                raise ShardReadError(f"{url}: reading stopped")
            if time.monotonic() > deadline:
                raise ShardReadError(f"{url}: no {what} after {self.policy.worst_case:.0f}s (read-ahead stalled)")
            self._cond.wait(0.5)

    def _take(self, job: _Job) -> bytes | None:
        with self._cond:
            self._wait("data", lambda: bool(job.chunks) or job.all_submitted or job.cancelled, job.url)
            if not job.chunks:
                return None
            fut, n = job.chunks.popleft()
        try:
            return fut.result(timeout=self.policy.worst_case)
        finally:
            with self._cond:
                self._outstanding -= n
                self._cond.notify_all()

    # ---- the parser's side --------------------------------------------------------------------------
    def open(self, job: _Job) -> _ChunkStream:
        """The byte stream of ``job`` (jobs are opened in order)."""
        if self.background:
            with self._cond:
                self._consumer_at = job.ordinal
                self._cond.notify_all()
                self._wait("answer", lambda: job.ready, job.url)
            if job.error is not None:
                if isinstance(job.error, ShardReadError):
                    raise job.error
                raise ShardReadError(f"{job.url}: {type(job.error).__name__}: {job.error}") from job.error
        else:
            self._prepare(job)
        sha = self.opts.verify == "sha256" and bool(job.expected_sha) and not job.verified
        if job.local is not None:
            f = open(job.local, "rb")
            cs = min(self.opts.chunk_size, 1 << 20)
            return _ChunkStream(lambda: f.read(cs), sha, f.close)
        if self.background:
            return _ChunkStream(lambda: self._take(job), sha)
        offsets = iter(range(0, job.size or 0, self.opts.chunk_size))
        size = job.size or 0

        def next_chunk() -> bytes | None:
            o = next(offsets, None)
            if o is None:
                return None
            return self._fetch(job.url, o, min(o + self.opts.chunk_size, size), self._check_size(job))

        return _ChunkStream(next_chunk, sha)

    def check(self, job: _Job, stream: _ChunkStream) -> None:
        """After the whole shard was read: its size and checksum."""
        if job.size is not None and stream.delivered != job.size:
            raise ShardReadError(f"{job.url}: read {stream.delivered} bytes, expected {job.size}")
        if stream.hasher is not None and job.expected_sha and stream.hasher.hexdigest() != job.expected_sha:
            raise ChecksumMismatch(
                f"{job.url}: sha256 is {stream.hasher.hexdigest()[:12]}..., the index says {job.expected_sha[:12]}..."
            )

    def finish(self, job: _Job) -> None:
        """The parser is done with ``job``: drop whatever is still queued for it."""
        with self._cond:
            job.cancelled = True
            for fut, n in job.chunks:
                fut.cancel()
                self._outstanding -= n
            job.chunks.clear()
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            for job in self.jobs:
                for fut, n in job.chunks:
                    fut.cancel()
                    self._outstanding -= n
                job.chunks.clear()
            self._cond.notify_all()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _chunks(size: int, chunk_size: int, ramp: bool = False) -> Iterator[tuple[int, int]]:
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


# ---- stages ---------------------------------------------------------------------------------------
def _piece_samples(fetcher: _Fetcher, job: _Job, piece: Piece) -> Iterator[dict[str, Any]]:
    stream = fetcher.open(job)
    try:
        for sample in group_samples(iter_members(stream, job.url), job.url, piece.shard):
            i = sample["__index__"]
            if i >= piece.stop:
                return
            if i >= piece.start:
                yield sample
        # the tar ended, so the whole shard was read: check it
        stream.drain()
        fetcher.check(job, stream)
    finally:
        stream.close()


def _jobs(urls: Sequence[str], pieces: Sequence[Piece], shards: Sequence[Any] | None) -> list[_Job]:
    jobs = []
    for j, p in enumerate(pieces):
        info = shards[p.shard] if shards is not None else None
        jobs.append(_Job(j, urls[p.shard], p.shard, getattr(info, "bytes", None), getattr(info, "sha256", None)))
    return jobs


def read_pieces(
    urls: Sequence[str],
    pieces: Iterable[Piece],
    storage_options: dict | None = None,
    options: ReadOptions | None = None,
    shards: Sequence[Any] | None = None,
    faults: FaultLog | None = None,
    markers: bool = False,
) -> Iterator[dict[str, Any]]:
    """Stage: the samples of each piece in turn (a slot's whole stream).

    ``shards``: the index's :class:`~streambatch.index.ShardInfo` list (expected bytes and sha256), if any.
    Without ``faults`` a bad shard raises :class:`ShardReadError`; with it, the shard is counted and skipped
    (and with ``markers`` a :class:`ShardFault` takes its place in the stream) within the budget.
    """
    opts = options or ReadOptions()
    pieces = list(pieces)
    jobs = _jobs(urls, pieces, shards)
    fetcher = _Fetcher(jobs, storage_options, opts, faults)
    try:
        for job, piece in zip(jobs, pieces):
            delivered = 0
            try:
                for sample in _piece_samples(fetcher, job, piece):
                    yield sample
                    delivered += 1
            except ShardReadError as e:
                if faults is None:
                    raise
                faults.bad_shard(piece.shard, job.url, str(e))
                if markers:
                    yield ShardFault(job.ordinal, piece.shard, job.url, str(e), delivered,
                                     invalidate=isinstance(e, ChecksumMismatch))
            finally:
                fetcher.finish(job)
    finally:
        fetcher.close()


def read_shard(
    url: str, shard: int = -1, start: int = 0, stop: int | None = None, storage_options: dict | None = None,
    options: ReadOptions | None = None,
) -> Iterator[dict[str, Any]]:
    """The samples ``[start, stop)`` of one shard, streamed; stops reading once ``stop`` is reached."""
    piece = Piece(max(shard, 0), start, (1 << 62) if stop is None else stop)
    for s in read_pieces({piece.shard: url}, [piece], storage_options, options):  # type: ignore[arg-type]
        s["__shard__"] = shard
        yield s
