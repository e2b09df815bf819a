"""The start of a worker's stream: the read-ahead cuts the first shard's first chunk into smaller requests (so
the parser can start before a whole chunk arrived), and those pieces stand for one chunk, so they take one
place of the in-flight target: the next shard's request starts at once too, not one round trip later. Never
beyond ``max_read_concurrency``. Requests are served from memory by a stub that holds every answer until the
test lets them go, so what is in flight at the start is seen exactly."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from streambatch.io.readahead import Job, ReadAhead, ramp_pieces
from streambatch.read.reader import ReadOptions

CHUNK = 8 << 10


class HeldRanges:
    """Range reads of in-memory objects that wait until ``release`` is set (10 s at most)."""

    def __init__(self, objects: dict[str, bytes]):
        self.objects = objects
        self.release = threading.Event()
        self.started: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def read(self, url: str, start: int, end: int, expected: int | None) -> bytes:
        with self.lock:
            self.started.append((url, start))
        self.release.wait(10)
        return self.objects[url][start:end]

    def read_versioned(self, url: str, start: int, end: int, expected: int | None) -> tuple[bytes, None]:
        return self.read(url, start, end, expected), None  # a store that names no version


def started_within(ranges: HeldRanges, want: int, seconds: float = 3.0) -> list[tuple[str, int]]:
    """The requests started once ``want`` of them did, or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with ranges.lock:
            if len(ranges.started) >= want:
                break
        time.sleep(0.01)
    time.sleep(0.1)  # a request too many would have started by now
    with ranges.lock:
        return list(ranges.started)


def read_through(concurrency: int, bound: int) -> tuple[list[tuple[str, int]], ReadAhead, list[bytes], dict]:
    """Two shards through a read-ahead (the first smaller than a chunk, as a 5 MB shard is beside 8 MB chunks):
    the requests in flight before any answered, the read-ahead, what the parser got per shard, and the objects."""
    objects = {"s3://b/shard-0.tar": bytes(range(256)) * (5 * CHUNK // 8 // 256), "s3://b/shard-1.tar": b"x" * CHUNK}
    jobs = [Job(i, url, i, len(data), None) for i, (url, data) in enumerate(objects.items())]
    ranges = HeldRanges(objects)
    opts = ReadOptions(chunk_size=CHUNK, read_ahead="1M", read_concurrency=concurrency, max_read_concurrency=bound)
    stop = threading.Event()

    def prepare(job: Job) -> None:
        job.size = job.expected_size

    with ThreadPoolExecutor(max_workers=8) as pool:
        ra = ReadAhead(jobs, prepare, ranges, pool, opts, False, stop)  # type: ignore[arg-type]
        try:
            early = started_within(ranges, ramp_pieces(CHUNK) + 1)
            ranges.release.set()
            got = []
            for job in jobs:
                ra.opened(job)
                got.append(b"".join(iter(lambda j=job: ra.take(j), None)))
                ra.finish(job)
        finally:
            stop.set()
            ranges.release.set()
            ra.close()
    return early, ra, got, objects


def test_the_start_ramp_takes_one_place_and_the_next_shard_starts_at_once():
    early, ra, got, objects = read_through(concurrency=2, bound=8)
    assert got == list(objects.values())
    assert ramp_pieces(CHUNK) == 3
    first = [s for u, s in early if u.endswith("0.tar")]
    assert first[:3] == [0, CHUNK // 8, CHUNK // 8 + CHUNK // 4], first  # the ramp: 1/8, 1/4, 1/2 of a chunk
    assert len(first) == 3, first  # the whole first shard: its three pieces
    assert ("s3://b/shard-1.tar", 0) in early, f"the next shard waited for the ramp's pieces: {early}"
    assert ra.peak_in_flight <= 8


def test_the_ramp_never_passes_max_read_concurrency():
    early, ra, got, objects = read_through(concurrency=2, bound=2)
    assert got == list(objects.values())
    assert len(early) == 2, early
    assert ra.peak_in_flight <= 2


def test_a_shut_pool_ends_the_read_ahead_quietly(monkeypatch):
    """When the request pool is already shut down (the fetcher closed, or the interpreter ends a program that left
    its epoch early and shuts every pool), the read-ahead thread stops reading: no exception escapes the thread
    (it would print a traceback as the program exits), and the parser is told reading stopped."""
    import pytest

    from streambatch.errors import ShardReadError

    escaped: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    objects = {"s3://b/shard-0.tar": b"x" * (4 * CHUNK)}
    jobs = [Job(0, "s3://b/shard-0.tar", 0, 4 * CHUNK, None)]
    ranges = HeldRanges(objects)
    ranges.release.set()
    pool = ThreadPoolExecutor(max_workers=2)
    pool.shutdown()

    def prepare(job: Job) -> None:
        job.size = job.expected_size

    opts = ReadOptions(chunk_size=CHUNK, read_ahead="1M")
    ra = ReadAhead(jobs, prepare, ranges, pool, opts, False, threading.Event(), ramp=False)  # type: ignore[arg-type]
    ra._thread.join(10)
    assert not ra._thread.is_alive() and escaped == []
    with pytest.raises(ShardReadError, match="reading stopped"):
        ra.opened(jobs[0])
        ra.take(jobs[0])
