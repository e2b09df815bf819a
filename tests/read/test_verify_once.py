"""verify="sha256" hashes a local shard once per node: later epochs, worker processes and loaders take the hash
this node already computed for the same version of the file; a file changed in place is hashed again."""

from __future__ import annotations

import os

import pytest
from conftest import audio_dataset, copy_with_own_record

from streambatch import StreamBatchLoader
from streambatch.io import verified

SR = 8000
BUDGET = 13 * SR


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return audio_dataset(tmp_path_factory.mktemp("verify_once"), 60, 5, SR, max_count=12, seed=2)


@pytest.fixture
def ds(source, tmp_path, monkeypatch):
    """A fresh copy of the dataset, and a node record of this test's own."""
    yield from copy_with_own_record(source, tmp_path, monkeypatch)


def _pass(loader):
    keys = sorted(k for b in loader for k in b["keys"])
    stats = loader.fault_stats()
    return keys, stats["sha256_hashed"], stats["sha256_reused"], stats["bad_shard_urls"]


def _flip_a_byte(path: str) -> None:
    with open(path, "r+b") as f:  # a payload byte: same size, another sha256, every header intact
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x55]))


#: every shard through the tar parser
STREAMED = {"read_by_position": False}


@pytest.fixture(params=["by position", "streamed"])
def read_mode(request):
    """The loader's reading options: local shards read by position, or streamed."""
    return STREAMED if request.param == "streamed" else {}


def test_each_shard_is_hashed_once_per_node(ds, read_mode):
    loader = StreamBatchLoader(ds, budget=BUDGET, seed=3, **read_mode)
    n = len(loader.index.shards)
    # every shard is checked in the pass that read it (a stream reads its last shards to the end once its last
    # batch is out), each hashed once
    keys, hashed, reused, bad = _pass(loader)
    assert (hashed, reused, bad, len(keys)) == (n, 0, [], 60)
    again, hashed2, reused, bad = _pass(loader)  # epoch 2 of the same process
    assert (hashed2, reused, bad, again) == (0, n, [], keys)
    verified.forget_in_process()  # worker processes (and another loader) see only the node record
    other = StreamBatchLoader(ds, budget=BUDGET, seed=3, num_workers=2, **read_mode)
    got, hashed3, reused, bad = _pass(other)
    assert (hashed3, reused, bad, got) == (0, n, [], keys)
    assert os.listdir(os.path.join(os.path.dirname(ds), "record"))


def test_a_shard_changed_in_place_is_hashed_again_and_counted_bad(ds, read_mode):
    loader = StreamBatchLoader(ds, budget=BUDGET, seed=3, max_bad_shards=2, **read_mode)
    _pass(loader)
    _pass(loader)  # (streamed: by now every shard has been hashed whole once)
    path = os.path.join(ds, "shard-000001.tar")
    st = os.stat(path)
    _flip_a_byte(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its mtime put back (its ctime moved)
    _, hashed, _, bad = _pass(loader)
    assert bad == [path] and hashed >= 1
    verified.forget_in_process()
    _, hashed, _, bad = _pass(
        StreamBatchLoader(ds, budget=BUDGET, seed=3, num_workers=2, max_bad_shards=2, **read_mode)
    )
    assert bad == [path]  # a wrong hash never vouches for the file
    # (read by position, the hash is known before a sample is used; a stream of interleaved shards may reach the
    # changed sample, which no longer decodes, before the shard's end, where its hash is known)
    assert hashed >= 1 or read_mode == STREAMED


def _recorded(path, st):
    verified.forget_in_process()  # what another process of the node finds
    return verified.recorded_sha256(path, st)


def test_a_record_not_ours_or_not_for_this_file_is_not_trusted(ds, tmp_path):
    path = os.path.join(ds, "shard-000000.tar")
    st = os.stat(path)
    digest = verified.hash_file(path)
    record = str(tmp_path / "record")
    entry = os.path.join(record, os.listdir(record)[0])
    assert _recorded(path, st) == digest
    with open(entry) as f:
        good = f.read()
    nested = "[" * 2000 + "]" * 2000  # small enough to be read, too deep for json.loads: not a crash
    for text in ("{not json", "[1, 2]", good.replace(str(st.st_ino), str(st.st_ino + 1)), "x" * 5000, nested):
        with open(entry, "w") as f:
            f.write(text)
        assert _recorded(path, st) is None
    with open(entry, "w") as f:
        f.write(good)
    os.chmod(record, 0o770)  # a folder others can write into vouches for nothing
    assert _recorded(path, st) is None
    os.chmod(record, 0o700)
    assert _recorded(path, st) == digest
    os.remove(entry)
    os.symlink(str(tmp_path / "elsewhere.json"), entry)  # an entry that is a link is not read
    with open(tmp_path / "elsewhere.json", "w") as f:
        f.write(good)
    assert _recorded(path, st) is None


def test_the_node_record_can_be_turned_off(ds, monkeypatch):
    monkeypatch.setenv(verified.RECORD_ENV, "off")
    loader = StreamBatchLoader(ds, budget=BUDGET, seed=3, num_workers=2)
    n = len(loader.index.shards)
    assert _pass(loader)[1:3] == (n, 0)
    assert _pass(loader)[1:3] == (n, 0)  # worker processes of each pass start without a record
    assert not os.path.exists(os.path.join(os.path.dirname(ds), "record"))
