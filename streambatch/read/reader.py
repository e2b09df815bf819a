"""The read stage: the samples of a worker's shard pieces, one dict per key, members as raw bytes.

A sample is ``{"__key__", "__url__", "__shard__", "__index__" (position in its shard), "json": dict,
EXT: bytes, ...}``; nothing is decoded but the small ``.json``, which carries the length. The bytes come
from :mod:`.fetch`, the tar parsing from :mod:`streambatch.dataset.tar`; a bad shard raises
:class:`ShardReadError`, or with a :class:`~.faults.FaultLog` is counted and skipped within the budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..dataset.members import PLAIN, ShardMembers
from ..dataset.tar import group_samples, iter_members
from ..errors import ShardReadError
from ..plan.shards import Piece
from .faults import ChecksumMismatch, FaultLog, ShardFault
from .fetch import Fetcher, Job
from .retry import RetryPolicy

VERIFY = ("sha256", "size", "none")


@dataclass(frozen=True)
class ReadOptions:
    """How shards are read. Sizes are bytes.

    * ``chunk_size``: bytes per range request (remote shards).
    * ``read_ahead``: bytes each worker may hold in requested-but-unparsed chunks; 0 reads on demand.
    * ``read_concurrency``: range requests in flight at once per worker (with read-ahead).
    * ``retry``: retries, backoff and the per-request timeout (:class:`RetryPolicy`).
    * ``verify``: ``"sha256"`` (size before reading, checksum once the shard is read), ``"size"`` or ``"none"``.
    * ``max_bad_shards``: bad shards tolerated per rank and epoch (all its workers together).
    * ``cache_dir`` / ``cache_size``: node-local shard cache (:mod:`streambatch.read.cache`), ``None`` for none.
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
        if getattr(p, "end_byte", 0) > 0:  # a read/skip.py Span: only its bytes
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
    index: Any = None,
) -> Iterator[dict[str, Any]]:
    """Stage: the samples of each piece in turn (a slot's whole stream).

    ``shards``: the index's :class:`~streambatch.dataset.index.ShardInfo` list (expected bytes and sha256), if any;
    ``index``: the index, which says how each shard's members map to samples (:meth:`ShardIndex.shard_members
    <streambatch.dataset.index.ShardIndex.shard_members>`: keys with dots, segments), if any.
    Without ``faults`` a bad shard raises :class:`ShardReadError`; with it, the shard is counted and skipped
    (and with ``markers`` a :class:`ShardFault` takes its place in the stream) within the budget.
    """
    opts = options or ReadOptions()
    pieces = list(pieces)
    jobs = _jobs(urls, pieces, shards)
    fetcher = Fetcher(jobs, storage_options, opts, faults)
    try:
        for job, piece in zip(jobs, pieces):
            delivered = 0
            try:
                members = index.shard_members(piece.shard) if index is not None else PLAIN
                for sample in _piece_samples(fetcher, job, piece, members):
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
    finally:
        fetcher.close()


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
