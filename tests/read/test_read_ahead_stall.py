"""A background range request that never answers: the read-ahead's watchdog gives up on it, and that is a
fetch error like any other (a bad shard, counted and skipped within the budget; without a fault log, a
:class:`ShardReadError`), never a bare ``TimeoutError`` that ends the epoch.

Made deterministic by the request itself: the stalled shard's range reads wait until the watchdog gave up on
that shard (or the reader closed), so the watchdog must fire, however loaded the machine is; then they fail as
a real request does once its own time limit passes, freeing their threads for the next shard.
"""

from __future__ import annotations

import os
import threading

import pytest
from conftest import text_dataset

from streambatch import ShardIndex
from streambatch.errors import ShardReadError
from streambatch.io.ranges import RangeReader
from streambatch.plan.shards import Piece
from streambatch.read.faults import FaultLog
from streambatch.read.reader import ReadOptions, read_pieces

REMOTE = "http://127.0.0.1:9"  # never contacted: the range reads below are served from the local files
STALLED = 1
OPTS = ReadOptions(retries=0, backoff=0, timeout=0.5, chunk_size="4K", read_ahead="64K", read_concurrency=2)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = text_dataset(tmp_path_factory.mktemp("stall"), 60, seed=3, max_count=20)
    ix = ShardIndex.load(folder)
    assert len(ix.shards) >= 3
    return folder, ix


class Faults(FaultLog):
    """A fault log that says when a shard was counted bad."""

    counted = threading.Event()

    def bad_shard(self, shard: int, url: str, reason: str) -> None:
        super().bad_shard(shard, url, reason)
        self.counted.set()


@pytest.fixture
def stalled_remote(shards, monkeypatch):
    """Remote URLs for the shards, read from the local files, except that every read of shard ``STALLED``
    hangs until the shard was counted bad or reading stopped (and then fails)."""
    folder, ix = shards
    urls = [f"{REMOTE}/{os.path.basename(s.url)}" for s in ix.shards]
    local = {u: os.path.join(folder, os.path.basename(u)) for u in urls}
    Faults.counted.clear()

    def read(self: RangeReader, url: str, start: int, end: int, expected: int | None) -> bytes:
        if url == urls[STALLED]:
            while not (Faults.counted.wait(0.05) or self.stop.is_set()):
                pass
            raise ShardReadError(f"{url}: bytes {start}-{end - 1}: timed out")
        with open(local[url], "rb") as f:
            f.seek(start)
            return f.read(end - start)

    monkeypatch.setattr(RangeReader, "read", read)
    monkeypatch.setattr(RangeReader, "read_versioned", lambda self, *a: (read(self, *a), None))  # (no version)
    return urls, ix


def _pieces(ix: ShardIndex) -> list[Piece]:
    return [Piece(i, 0, s.count) for i, s in enumerate(ix.shards)]


def test_stalled_read_ahead_counts_the_shard_bad(stalled_remote, shards):
    urls, ix = stalled_remote
    faults = Faults(max_bad_shards=1, urls=urls)
    got = [s["__key__"] for s in read_pieces(urls, _pieces(ix), None, OPTS, ix.shards, faults)]
    folder = shards[0]
    want = [
        s["__key__"]
        for i in range(len(ix.shards))
        if i != STALLED
        for s in read_pieces([os.path.join(folder, os.path.basename(u)) for u in urls], [_pieces(ix)[i]])
    ]
    assert got == want  # every other shard whole, in order; nothing of the stalled one
    assert faults.total("bad_shards") == 1


def test_stalled_read_ahead_without_a_fault_log_is_a_shard_read_error(stalled_remote):
    urls, ix = stalled_remote
    with pytest.raises(ShardReadError, match=r"shard-0+1\.tar: .*read-ahead stalled"):
        for _ in read_pieces(urls, _pieces(ix), None, OPTS, ix.shards):
            pass
