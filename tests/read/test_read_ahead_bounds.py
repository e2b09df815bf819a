"""The read-ahead keeps several requests in flight: against the loopback S3 server behind a proxy that answers
every request late, a worker's requests overlap (counted where the requests are made), never more than
``max_read_concurrency`` nor more bytes than ``read_ahead`` allows, and it reads the same samples as from local
disk."""

from __future__ import annotations

import threading

import pytest
from faultproxy import Rule

from streambatch import ShardIndex
from streambatch.io import objstore, readahead
from streambatch.plan.shards import Piece
from streambatch.read.reader import ReadOptions, read_pieces

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

CHUNK = 16 << 10


class Overlap:
    """Range requests in progress at once, counted around the function that makes them."""

    def __init__(self, request):
        self.request, self.now, self.peak, self.lock = request, 0, 0, threading.Lock()

    def around(self, request):
        """``request`` counted in the same count (the other path's function that makes requests)."""
        return lambda *args, **kw: self._count(request, *args, **kw)

    def __call__(self, *args, **kw):
        return self._count(self.request, *args, **kw)

    def _count(self, request, *args, **kw):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            return request(*args, **kw)
        finally:
            with self.lock:
                self.now -= 1


@pytest.fixture
def counted(monkeypatch):
    """The overlap counter, and every read-ahead the test makes (for its own peaks)."""
    overlap = Overlap(objstore.read_range)
    monkeypatch.setattr(objstore, "read_range", overlap)
    made: list[readahead.ReadAhead] = []
    init = readahead.ReadAhead.__init__

    def keep(self, *args, **kw):
        init(self, *args, **kw)
        made.append(self)

    monkeypatch.setattr(readahead.ReadAhead, "__init__", keep)
    return overlap, made


def read_all(s3_data, opts: ReadOptions, shards: int = 3) -> list[tuple[str, bytes]]:
    ix = ShardIndex.load(s3_data.url, storage_options=s3_data.options)
    urls = {i: ix.shard_url(i) for i in range(shards)}
    pieces = [Piece(i, 0, ix.shards[i].count) for i in range(shards)]
    samples = read_pieces(urls, pieces, s3_data.proxied, opts, shards=ix.shards)
    return [(s["__key__"], s.get("flac", b"")) for s in samples]


def local_samples(s3_data, shards: int = 3) -> list[tuple[str, bytes]]:
    ix = ShardIndex.load(s3_data.local)
    urls = {i: ix.shard_url(i) for i in range(shards)}
    pieces = [Piece(i, 0, ix.shards[i].count) for i in range(shards)]
    return [(s["__key__"], s.get("flac", b"")) for s in read_pieces(urls, pieces, None, ReadOptions())]


def test_requests_in_flight_overlap_within_the_bounds(s3_data, proxy, counted):
    overlap, made = counted
    proxy.reset(Rule("latency", seconds=0.1, methods=("GET", "HEAD")))
    read_ahead = 4 * CHUNK  # room for 4 chunks (more of the start's smaller pieces): bytes bound the requests too
    opts = ReadOptions(chunk_size=CHUNK, read_ahead=read_ahead, read_concurrency=1, max_read_concurrency=6)
    got = read_all(s3_data, opts)
    assert got == local_samples(s3_data)
    (ra,) = made
    assert overlap.peak > 1, "requests never overlapped"
    assert ra.peak_in_flight == overlap.peak
    assert overlap.peak <= 6  # max_read_concurrency
    assert ra.peak_outstanding <= read_ahead


def test_max_read_concurrency_bounds_the_requests(s3_data, proxy, counted):
    overlap, made = counted
    proxy.reset(Rule("latency", seconds=0.05, methods=("GET", "HEAD")))
    opts = ReadOptions(chunk_size=CHUNK, read_ahead="1M", read_concurrency=1, max_read_concurrency=2)
    assert read_all(s3_data, opts) == local_samples(s3_data)
    (ra,) = made
    assert overlap.peak <= 2 and ra.peak_in_flight <= 2
