"""A shard that cannot be read ends the pass by default, in one line naming it, its cause and the option that
tolerates it (also from DataLoader workers); ``max_bad_shards=N`` opts in to skipping, and then every lost and
re-drawn sample is counted in ``metrics()`` and summed up in one WARNING at the end of the pass. A shard deleted or
renamed after it was opened and read whole is not bad."""

from __future__ import annotations

import collections
import logging
import os

import pytest
from conftest import audio_dataset, copy_with_own_record, error_of

from streambatch import ShardIndex, ShardReadError, StreamBatchLoader
from streambatch.plan.shards import Piece
from streambatch.read.reader import ReadOptions, read_pieces, read_shard

SR = 8000
BUDGET = 6 * SR


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return audio_dataset(tmp_path_factory.mktemp("lost_shards"), 40, 4, SR, max_count=10, seed=4)


@pytest.fixture
def ds(source, tmp_path, monkeypatch):
    """A fresh copy of the 4-shard dataset, with a node record of its own."""
    yield from copy_with_own_record(source, tmp_path, monkeypatch)


def shards_of(ds):
    return sorted(os.path.join(ds, f) for f in os.listdir(ds) if f.endswith(".tar"))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_missing_shard_ends_the_pass_in_one_line(ds, num_workers):
    gone = shards_of(ds)[1]
    os.remove(gone)
    loader = StreamBatchLoader(ds, budget=BUDGET, seed=1, num_workers=num_workers)
    kind, message = error_of(lambda: list(loader))
    assert kind is not None and issubclass(kind, ShardReadError)
    assert "\n" not in message and "Traceback" not in message and "worker process" not in message
    assert message.startswith(f"{gone}: ") and "not found" in message and "max_bad_shards=N" in message


def test_tolerated_bad_shards_are_counted_and_summed_up_once(ds, caplog):
    paths = shards_of(ds)
    lost = [paths[0], paths[2]]
    planned = {k for b in StreamBatchLoader(ds, budget=BUDGET, seed=1) for k in b["keys"]}  # before the loss
    lost_keys = planned & {s["__key__"] for p in lost for s in read_shard(p)}
    for p in lost:
        os.remove(p)
    loader = StreamBatchLoader(ds, budget=BUDGET, seed=1, max_bad_shards=2)
    with caplog.at_level(logging.INFO, logger="streambatch"):
        batches = list(loader)
    assert len(batches) == len(loader)  # equal steps: the planned count
    keys = [k for b in batches for k in b["keys"]]
    repeats = sum(n - 1 for n in collections.Counter(keys).values())
    faults = loader.metrics()["faults"]
    assert faults["bad_shards"] == 2 and sorted(faults["bad_shard_urls"]) == lost
    assert faults["lost_samples"] == len(lost_keys) > 0  # both shards' planned samples, none of them read
    assert set(keys) == planned - lost_keys and faults["redrawn_samples"] == repeats > 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "streambatch" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1  # one summary for the pass, not a line per shard
    assert all(p in warnings[0] for p in lost) and f"lost {len(lost_keys)} planned samples" in warnings[0]


@pytest.mark.parametrize("how", ["deleted", "renamed"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shard_removed_after_it_was_read_whole_is_not_bad(ds, num_workers, how):
    """Once every sample of a shard is out, the shard goes away (deleted, or renamed) while the pass goes on."""
    planned = {k for b in StreamBatchLoader(ds, budget=BUDGET, seed=1) for k in b["keys"]}
    keys = {p: planned & {s["__key__"] for s in read_shard(p)} for p in shards_of(ds)}  # each shard's planned ones
    loader = StreamBatchLoader(ds, budget=BUDGET, seed=1, num_workers=num_workers)
    seen, gone = [], None
    for batch in loader:  # the default: a bad shard would end the pass
        seen += batch["keys"]
        whole = [p for p in keys if keys[p] <= set(seen)]
        if gone is None and whole and len(seen) < len(planned):  # batches still to come
            gone = whole[0]
            os.remove(gone) if how == "deleted" else os.rename(gone, gone + ".old")
    assert gone is not None
    assert sorted(seen) == sorted(planned)  # every planned sample once
    assert loader.fault_stats()["bad_shards"] == 0



@pytest.mark.parametrize("how", ["deleted", "renamed"])
def test_a_streamed_shard_whose_hash_this_node_knows_is_not_bad_once_removed_after_its_last_sample(ds, how):
    """A shard streamed through the tar reader a second time: its sha256 comes from the node's record, so the reader
    checks that the file is still the version the record vouches for. Removed after its last sample was read, but
    before the reader reached the end of the tar, it still is (the open file kept its bytes)."""
    ix = ShardIndex.load(ds)
    urls = [s.url if os.path.isabs(s.url) else os.path.join(ds, s.url) for s in ix.shards]
    pieces = [Piece(i, 0, s.count) for i, s in enumerate(ix.shards)]
    first = [s["__key__"] for s in read_pieces(urls, pieces, None, ReadOptions(), ix.shards)]  # hashes recorded
    gone = urls[1]
    samples = read_pieces(urls, pieces[1:2], None, ReadOptions(), ix.shards)
    got = [next(samples)["__key__"] for _ in range(ix.shards[1].count)]  # every sample, the tar's end not reached
    os.remove(gone) if how == "deleted" else os.rename(gone, gone + ".old")
    got += [s["__key__"] for s in samples]  # the reader reaches the end and checks the shard
    assert got == first[ix.shards[0].count : ix.shards[0].count + ix.shards[1].count]
