"""A sample over a limit in the loader (issue 25, item 4): a ``.json`` nested 200,000 deep or a member over the
size limit is a bad sample, counted (``lost_samples``) and re-drawn like a sample lost with a bad shard; the
epoch goes on with its planned steps, and no other sample is lost."""

from __future__ import annotations

import collections
import json
import tarfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from fuzz_inputs import write_tar

from streambatch import StreamBatchLoader
from streambatch.errors import ShardReadError
from streambatch.plan.shards import Piece
from streambatch.read.direct import _Shard
from streambatch.read.faults import FaultLog
from streambatch.read.fetch import Job
from streambatch.read.reader import read_pieces
from streambatch.write.adopt.index import index_tars

DEEP = 200_000
SIZE = 2 * DEEP  # the bytes of the deep .json, and of the ordinary one it replaces


def padded_json(meta: dict, size: int) -> bytes:
    raw = json.dumps(meta).encode()
    return raw[:-1] + b" " * (size - len(raw)) + b"}"


def dataset(src: Path, bad_json: bytes | None = None, bad_txt: bytes | None = None) -> list[str]:
    """Three text tars of five samples (``.txt`` and a ``.json`` of SIZE bytes); sample ``doc07`` gets
    ``bad_json`` / ``bad_txt`` as members instead. Returns every key."""
    src.mkdir(parents=True, exist_ok=True)
    keys = []
    for t in range(3):
        members = []
        for i in range(5):
            key = f"doc{t * 5 + i:02d}"
            keys.append(key)
            txt = " ".join(["w"] * (2 + (t * 5 + i) % 4)).encode()
            meta = padded_json({"lang": "de"}, SIZE)
            if key == "doc07":
                txt, meta = bad_txt or txt, bad_json or meta
            members += [(f"{key}.txt", txt), (f"{key}.json", meta)]
        write_tar(src / f"text-{t}.tar", members)
    return keys


def epoch(source, **kw) -> tuple[collections.Counter, dict, int, int]:
    """Keys yielded in one epoch (counted), the fault stats, the steps taken, and ``len(loader)`` (or -1)."""
    loader = StreamBatchLoader(source, budget=12, seed=1, buffer_size=8, **kw)
    try:
        planned = len(loader)
    except TypeError:
        planned = -1
    seen: collections.Counter = collections.Counter()
    steps = 0
    for batch in loader:
        seen.update(batch["keys"])
        steps += 1
    return seen, loader.fault_stats(), steps, planned


#: a .json the loader cannot take a sample's metadata from, of SIZE bytes: nested too deep, or valid JSON that is
#: not an object
BAD_JSONS = {"deep": b"[" * DEEP + b"]" * DEEP, "array": b"[" + b" " * (SIZE - 2) + b"]"}


@pytest.mark.parametrize("bad", sorted(BAD_JSONS))
@pytest.mark.parametrize("num_workers", [0, 2])
def test_deep_json_in_an_indexed_shard_is_a_bad_sample(tmp_path, num_workers, bad):
    """The index was made while the sample was fine; its .json is then replaced by one nested 200,000 deep (or by
    an array), of the same size (so the index's byte offsets still hold): the loader counts one bad sample and
    goes on."""
    src = tmp_path / "ds"
    keys = dataset(src)
    index_tars(str(src), progress=False)
    dataset(src, bad_json=BAD_JSONS[bad])
    seen, faults, steps, planned = epoch(str(src), verify="size", num_workers=num_workers)
    assert steps == planned  # the epoch ends where planned, not early
    assert faults["lost_samples"] == 1 and faults["bad_shards"] == 0
    assert "doc07" not in seen and set(seen) == set(keys) - {"doc07"}
    assert sum(seen.values()) - len(seen) == faults["redrawn_samples"]  # re-draws are the only repeats


@pytest.mark.parametrize("bad", sorted(BAD_JSONS))
def test_deep_json_without_an_index_is_a_bad_sample(tmp_path, bad):
    src = tmp_path / "ds"
    keys = dataset(src, bad_json=BAD_JSONS[bad])
    for p in src.glob("*.tar"):  # without an index, lengths come from each .json
        members = []
        with tarfile.open(p) as tar:
            for m in tar.getmembers():
                data = tar.extractfile(m).read()  # type: ignore[union-attr]
                if m.name.endswith(".json") and not m.name.startswith("doc07"):
                    data = json.dumps({"length": 3}).encode()
                members.append((m.name, data))
        write_tar(p, members)
    seen, faults, _, _ = epoch(sorted(str(p) for p in src.glob("*.tar")))
    assert faults["lost_samples"] == 1
    assert set(seen) == set(keys) - {"doc07"}


def test_member_over_the_size_limit_is_a_bad_sample(tmp_path, monkeypatch):
    """doc07's .txt is three words in 1 MB of spaces; under a limit between its size and the others' it is a bad
    sample, read past without being held; with the limit raised again it is an ordinary sample."""
    src = tmp_path / "ds"
    keys = dataset(src, bad_txt=b"w w w" + b" " * (1 << 20))
    index_tars(str(src), progress=False)
    monkeypatch.setenv("STREAMBATCH_MAX_MEMBER_BYTES", str(2 * SIZE))
    seen, faults, steps, planned = epoch(str(src))
    assert steps == planned and faults["lost_samples"] == 1 and faults["bad_shards"] == 0
    assert set(seen) == set(keys) - {"doc07"}
    monkeypatch.setenv("STREAMBATCH_MAX_MEMBER_BYTES", "1G")
    seen, faults, steps, planned = epoch(str(src))
    assert faults["lost_samples"] == 0 and set(seen) == set(keys)


def test_read_pieces_counts_a_bad_sample_or_names_it(tmp_path):
    src = tmp_path / "ds"
    dataset(src, bad_json=b"[" * DEEP + b"]" * DEEP)
    url = str(src / "text-1.tar")
    faults = FaultLog()
    got = [s["__key__"] for s in read_pieces([url], [Piece(0, 0, 5)], faults=faults)]
    assert got == ["doc05", "doc06", "doc08", "doc09"] and faults.total("lost_samples") == 1
    marked = [s for s in read_pieces([url], [Piece(0, 0, 5)], faults=FaultLog(), markers=True)]
    assert [s["__key__"] for s in marked if "__bad__" in s] == ["doc07"]  # the executor counts it in place
    with pytest.raises(Exception, match="doc07.json: JSON nested more than") as e:
        list(read_pieces([url], [Piece(0, 0, 5)]))
    assert type(e.value).__name__ == "ShardReadError"


def test_an_index_span_past_the_end_of_the_file_is_never_allocated(tmp_path):
    """A local shard is read where the index says each sample lies: a span the index claims past the end of the
    file (100 GB) is a bad shard, checked against the file's real size before a byte is allocated."""
    src = tmp_path / "ds"
    dataset(src)
    url = str(src / "text-0.tar")
    offsets, sizes = np.array([0, 1024], dtype=np.int64), np.array([1024, 100 << 30], dtype=np.int64)
    shard = _Shard(Job(0, url, 0, None, None), (offsets, sizes), "none")
    try:
        tracemalloc.start()
        with pytest.raises(ShardReadError, match="past the end of the"):
            shard.read(1)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
        shard.close()
