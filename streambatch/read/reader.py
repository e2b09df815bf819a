"""The read stage: the samples of a worker's shard pieces, one dict per key, members as raw bytes.

A sample is ``{"__key__", "__url__", "__shard__", "__index__" (position in its shard), "json": dict,
EXT: bytes, ...}``; nothing is decoded but the small ``.json``, which carries the length. The bytes come
from `fetch`, the tar parsing from `streambatch.format.tar`; a bad shard raises
`ShardReadError`, or with a `FaultLog` is counted and skipped within the budget.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import OptionError, ShardReadError, bool_option, choice_option, int_option, number_option
from ..format.members import PLAIN, ShardMembers
from ..format.tar import group_samples, iter_members
from ..format.trust import shard_roots_option
from ..io.retry import RetryPolicy
from ..plan.shards import Piece
from ..units import parse_bytes
from .faults import ChecksumMismatch, FaultLog, ShardFault, bad_sample
from .fetch import Fetcher, Job
from .skip import Span

if TYPE_CHECKING:
    from ..select.mixture import AnyIndex


VERIFY = ("sha256", "size", "none")
#: the most range requests a worker keeps in flight (``max_read_concurrency``): each a thread and a connection
MAX_READ_CONCURRENCY = 256
#: the most retries of one request, and the longest ``timeout`` (a day): beyond them a stalled read's watchdog
#: (`worst_case`) would outlast what a clock wait can hold
MAX_RETRIES, MAX_TIMEOUT = 100, 86_400.0


@dataclass(frozen=True)
class ReadOptions:
    """How shards are read: the loader's read options (each checked once, here). Sizes are bytes; a size may
    be given as text like ``"8M"`` or ``"500G"`` (K, M, G, T are powers of 1024)."""

    chunk_size: int = 8 << 20
    """Bytes per range request (remote shards)."""
    read_ahead: int = 64 << 20
    """Bytes each worker may hold in requested-but-unparsed chunks (one chunk is always let through, so a
    read-ahead below ``chunk_size`` holds one ``chunk_size``); 0 reads on demand."""
    read_concurrency: int = 4
    """Range requests in flight at once per worker while a shard downloads into the node cache. At most
    ``max_read_concurrency``: raising it above 16 means raising that too."""
    max_read_concurrency: int = 16
    """The most range requests one worker's read-ahead keeps in flight (each waits for its answer outside the
    interpreter lock); a node has at most this many per worker process of each rank on it.
    The bytes they hold stay within ``read_ahead``. At most `MAX_READ_CONCURRENCY` (256): each request in
    flight is a thread of the worker's fetch pool and a connection to the store."""
    retries: int = 8
    """Retries per request after the first try (`RetryPolicy`); at most 100."""
    backoff: float = 0.25
    """The first wait before a retry, in seconds; it doubles each try, capped, with full jitter."""
    timeout: float = 60.0
    """Seconds a request may take to connect or go without data before it counts as failed; at most a day."""
    verify: str = "sha256"
    """What is checked against the index (`VERIFY`): ``"sha256"`` (size before reading, checksum once the
    shard is read; a local file's checksum once per node and file version, `verified`),
    ``"size"`` or ``"none"``."""
    max_bad_shards: int = 0
    """Bad shards (shards that cannot be read after the retries: missing, truncated, corrupt, a checksum that
    differs) a rank may skip per epoch, all its workers together. 0, the default: the first one ends the pass with
    a `ShardReadError` naming the shard and its cause, since skipping it silently changes
    what the epoch trains on. N > 0 opts in: each bad shard's unread samples are lost and re-drawn from samples
    already emitted (the steps stay equal, ``len()`` exact), counted in ``metrics()["faults"]`` and summed up in
    one WARNING line at the end of the pass; the (N + 1)-th raises `TooManyBadShards`."""
    cache_dir: str | None = None
    """A node-local shard cache (`streambatch.io.cache`): each shard downloaded once per node, kept under its
    content (the index's sha256 of it, or the store's ETag or version), so a dataset rewritten in place is fetched
    again; None: none."""
    cache_size: int | None = None
    """The cache folder's limit in bytes at rest (its shards and the node copies of indexes), least recently used
    shards evicted first; None: no limit. Only with
    ``cache_dir`` (without a cache there is nothing to limit). A shard larger than the limit is read from storage
    as without a cache (warned once)."""
    shard_roots: Sequence[str] = ()
    """Folders or URL prefixes (``"/data/tars"``, ``"s3://bucket/raw/"``) that an index's shard URLs (and a mixture
    file's datasets) may point into besides the dataset's own folder or prefix. An index is data: by default a URL
    it names outside its dataset (``..``, an absolute path or ``file://`` elsewhere, another scheme or host) is
    refused before it is opened (`streambatch.format.trust`). Give the roots a dataset made by
    ``shardify index --out`` reports."""
    read_by_position: bool = True
    """Read local shards by position where the index records each sample's byte span (only the samples a batch
    needs, no tar parsing); False streams every shard through the tar parser, as remote shards are (to check one
    way of reading against the other)."""

    #: recent samples each worker keeps to re-draw samples lost with a bad shard
    reservoir: ClassVar[int] = 64

    def __post_init__(self) -> None:
        for name in ("chunk_size", "read_ahead", "cache_size"):
            value = getattr(self, name)
            if value is None and name != "cache_size":  # None is "no limit" for the cache only
                raise OptionError(f"{name} must be a number of bytes or a size like 64M, got None")
            try:
                object.__setattr__(self, name, parse_bytes(value, name))
            except ValueError as e:
                raise OptionError(str(e)) from None
        if self.chunk_size <= 0:
            raise OptionError(f"chunk_size must be positive, got {self.chunk_size}")
        _check_concurrency(self.read_concurrency, self.max_read_concurrency)
        int_option("retries", self.retries, 0, MAX_RETRIES)
        number_option("backoff", self.backoff, 0)
        number_option("timeout", self.timeout, positive=True, maximum=MAX_TIMEOUT)
        choice_option("verify", self.verify, VERIFY)
        int_option("max_bad_shards", self.max_bad_shards, 0)
        bool_option("read_by_position", self.read_by_position)
        object.__setattr__(self, "shard_roots", shard_roots_option(self.shard_roots))
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise OptionError(f"cache_dir must be a folder or None, got {self.cache_dir!r}")
        if self.cache_dir is not None and os.path.isfile(self.cache_dir):
            raise OptionError(f"cache_dir={self.cache_dir!r} is a file, not a folder for the shard cache")
        if self.cache_size is not None and self.cache_dir is None:
            raise OptionError(
                f"cache_size={self.cache_size} limits the shard cache in cache_dir, and cache_dir=None makes none: "
                "give cache_dir too, or leave cache_size=None"
            )

    @property
    def retry(self) -> RetryPolicy:
        """How each request is retried."""
        return RetryPolicy(retries=self.retries, backoff=self.backoff, timeout=self.timeout)


def _check_concurrency(start: Any, most: Any) -> None:
    """``read_concurrency`` and ``max_read_concurrency``: whole numbers from 1, the bound at most
    `MAX_READ_CONCURRENCY`, the start within the bound (the read-ahead would silently start at the bound)."""
    int_option("read_concurrency", start, 1, MAX_READ_CONCURRENCY)
    int_option("max_read_concurrency", most, 1, MAX_READ_CONCURRENCY)
    if start > most:
        raise OptionError(
            f"read_concurrency={start} is above max_read_concurrency={most}, the most requests a worker keeps in "
            f"flight: raise max_read_concurrency to at least {start} too"
        )


def _piece_samples(fetcher: Fetcher, job: Job, piece: Piece, members: ShardMembers = PLAIN) -> Iterator[dict[str, Any]]:
    """The samples ``[piece.start, piece.stop)`` of the job's shard; a shard read to its end is checked.
    ``members``: the shard's key rule, and its rows where a member group holds several samples (segments)."""
    stream = fetcher.open(job)
    rows = members.rows
    first = piece.start if job.byte_range is not None else 0  # a byte range starts at the piece's first sample
    if rows is not None and job.byte_range is not None:
        first = rows.first_group(piece.start)  # ... whose member group it is, with segments
    try:
        for sample in group_samples(iter_members(stream, job.url), job.url, piece.shard, members.suffixes):
            i = sample["__index__"] = sample["__index__"] + first
            if rows is not None:  # member group i holds rows of its own
                if rows.first_row(i) >= piece.stop:
                    return
                yield from rows.expand(sample, i, piece.start, piece.stop)
                continue
            if i >= piece.stop:
                return
            if i >= piece.start:
                yield sample
        # the tar ended, so the whole shard was read: check it
        stream.drain()
        fetcher.check(job, stream)
    finally:
        stream.close()


def _jobs(urls: Sequence[str], pieces: Sequence[Piece], shards: Sequence[Any] | None) -> list[Job]:
    """One fetch job per piece, with the index's size and sha256 of its shard where known."""
    jobs = []
    for j, p in enumerate(pieces):
        info = shards[p.shard] if shards is not None else None
        jobs.append(Job(j, urls[p.shard], p.shard, getattr(info, "bytes", None), getattr(info, "sha256", None)))
        if isinstance(p, Span) and p.end_byte > 0:  # only its bytes
            jobs[-1].byte_range = (p.first_byte, p.end_byte)
    return jobs


def read_pieces(
    urls: Sequence[str],
    pieces: Iterable[Piece],
    storage_options: dict | None = None,
    options: ReadOptions | None = None,
    shards: Sequence[Any] | None = None,
    faults: FaultLog | None = None,
    markers: bool = False,
    index: AnyIndex | None = None,
) -> Iterator[Any]:
    """Stage: the samples of each piece in turn (a slot's whole stream): dicts, and with ``markers`` the
    `ShardFault` markers among them.

    ``shards``: the index's `ShardInfo` list (expected bytes and sha256), if any;
    ``index``: the index, which says how each shard's members map to samples (:meth:`ShardIndex.shard_members
    <streambatch.format.index.ShardIndex.shard_members>`: keys with dots, segments), if any.
    Without ``faults`` a bad shard raises `ShardReadError`; with it, the shard is counted and skipped
    (and with ``markers`` a `ShardFault` takes its place in the stream) within the budget. A bad sample
    (``__bad__``: over a limit of `streambatch.limits`) is counted lost and left out, or with
    ``markers`` left in the stream, where its planned position is.
    """
    opened = OpenedPieces(urls, pieces, storage_options, options, shards, faults, markers, index)
    try:
        yield from opened
    finally:
        opened.close()


class OpenedPieces:
    """`read_pieces()`'s stream with its fetcher started at once: its read-ahead requests the first chunks
    before the first sample is asked for (several streams of one worker then wait for their first bytes together,
    not one after another). `close()` stops the fetcher, whether or not a sample was taken. ``ramp``: the first
    chunk requested in smaller pieces, so parsing starts sooner (a lane's chunks are small already)."""

    def __init__(
        self,
        urls: Sequence[str],
        pieces: Iterable[Piece],
        storage_options: dict | None = None,
        options: ReadOptions | None = None,
        shards: Sequence[Any] | None = None,
        faults: FaultLog | None = None,
        markers: bool = False,
        index: AnyIndex | None = None,
        ramp: bool = True,
    ):
        pieces = list(pieces)
        jobs = _jobs(urls, pieces, shards)
        self.fetcher = Fetcher(jobs, storage_options, options or ReadOptions(), faults, ramp)
        self._samples = _samples(self.fetcher, jobs, pieces, faults, markers, index)

    def __iter__(self) -> OpenedPieces:
        return self

    def __next__(self) -> Any:
        return next(self._samples)

    def close(self) -> None:
        self._samples.close()
        self.fetcher.close()


def _samples(
    fetcher: Fetcher,
    jobs: list[Job],
    pieces: list[Piece],
    faults: FaultLog | None,
    markers: bool,
    index: AnyIndex | None,
) -> Generator[Any, None, None]:
    """The samples of each job's piece in turn, through ``fetcher``; bad shards as `read_pieces()` says."""
    for job, piece in zip(jobs, pieces):
        delivered = 0
        try:
            members = index.shard_members(piece.shard) if index is not None else PLAIN
            for sample in _piece_samples(fetcher, job, piece, members):
                if "__bad__" in sample and not markers:  # with markers, the plan's executor counts it
                    bad_sample(faults, sample)
                    continue
                yield sample
                delivered += 1
        except ShardReadError as e:
            if faults is None:
                raise
            faults.bad_shard(piece.shard, job.url, str(e))
            if markers:
                yield ShardFault(
                    job.ordinal, piece.shard, job.url, str(e), delivered, invalidate=isinstance(e, ChecksumMismatch)
                )
        finally:
            fetcher.finish(job)


def read_shard(
    url: str,
    shard: int = -1,
    start: int = 0,
    stop: int | None = None,
    storage_options: dict | None = None,
    options: ReadOptions | None = None,
) -> Iterator[dict[str, Any]]:
    """The samples ``[start, stop)`` of one shard, streamed; stops reading once ``stop`` is reached."""
    piece = Piece(max(shard, 0), start, (1 << 62) if stop is None else stop)
    for s in read_pieces({piece.shard: url}, [piece], storage_options, options):  # type: ignore[arg-type]
        s["__shard__"] = shard
        yield s
