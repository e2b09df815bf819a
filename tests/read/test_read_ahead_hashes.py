"""With read-ahead, a remote shard's sha256 is computed in the request threads as its chunks arrive, in order,
not in the parser's thread (sha256 lets go of the GIL, so on another core it costs the parser nothing); the
check still holds: the same samples as from local disk, and one changed byte is still a checksum failure.

The range requests are served from the local files (``RangeReader.read`` and ``read_versioned`` patched), so no
server is needed."""

from __future__ import annotations

import os
import threading

import pytest
from conftest import text_dataset

from streambatch import ShardIndex
from streambatch.errors import ShardReadError
from streambatch.io import digest as fmt
from streambatch.io.ranges import RangeReader
from streambatch.plan.shards import Piece
from streambatch.read.faults import FaultLog
from streambatch.read.reader import ReadOptions, read_pieces

REMOTE = "http://127.0.0.1:9"  # never contacted
OPTS = ReadOptions(retries=0, backoff=0, chunk_size="4K", read_ahead="64K", read_concurrency=3)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = text_dataset(tmp_path_factory.mktemp("hashes"), 60, seed=5, max_count=20)
    ix = ShardIndex.load(folder)
    assert len(ix.shards) >= 3 and all(s.sha256 for s in ix.shards)
    return folder, ix


@pytest.fixture
def remote(shards, monkeypatch):
    """Remote URLs served from the local files (``flip``: a shard whose byte 700 reads changed), and the names
    of the threads that fed a sha256 digest."""
    folder, ix = shards
    urls = [f"{REMOTE}/{os.path.basename(s.url)}" for s in ix.shards]
    flip: set[str] = set()
    hashed_in: set[str] = set()

    def read(self: RangeReader, url: str, start: int, end: int, expected: int | None) -> bytes:
        with open(os.path.join(folder, os.path.basename(url)), "rb") as f:
            f.seek(start)
            data = bytearray(f.read(end - start))
        if url in flip and start <= 700 < end:
            data[700 - start] ^= 1
        return bytes(data)

    update = fmt.Digest.update

    def watched(self: fmt.Digest, data: bytes) -> bytes:
        hashed_in.add(threading.current_thread().name)
        return update(self, data)

    monkeypatch.setattr(RangeReader, "read", read)
    monkeypatch.setattr(RangeReader, "read_versioned", lambda self, *a: (read(self, *a), None))  # (no version)
    monkeypatch.setattr(fmt.Digest, "update", watched)
    return urls, ix, flip, hashed_in


def _pieces(ix: ShardIndex) -> list[Piece]:
    return [Piece(i, 0, s.count) for i, s in enumerate(ix.shards)]


def test_the_parser_does_not_hash_and_the_samples_are_the_local_ones(remote, shards):
    urls, ix, _, hashed_in = remote
    got = [(s["__key__"], s.get("json")) for s in read_pieces(urls, _pieces(ix), None, OPTS, ix.shards)]
    local = [os.path.join(shards[0], os.path.basename(u)) for u in urls]
    want = [(s["__key__"], s.get("json")) for s in read_pieces(local, _pieces(ix), None, ReadOptions(verify="none"))]
    assert got == want
    assert hashed_in, "nothing was hashed"
    assert threading.current_thread().name not in hashed_in, f"the parser's thread hashed: {hashed_in}"


def test_a_changed_byte_is_still_a_checksum_failure(remote):
    urls, ix, flip, _ = remote
    flip.add(urls[1])
    with pytest.raises(ShardReadError, match=r"shard-0+1\.tar: .*sha256"):
        for _ in read_pieces(urls, _pieces(ix), None, OPTS, ix.shards):
            pass
    faults = FaultLog(max_bad_shards=1, urls=urls)
    list(read_pieces(urls, _pieces(ix), None, OPTS, ix.shards, faults))
    assert faults.total("bad_shards") == 1
