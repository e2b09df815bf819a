"""Interleaved shards (``interleave``): a worker streams several of its shards at once, in lanes, merged in the
planned order. Streamed or read by position, the loader yields the same batches; a resume mid-epoch and a bad
shard in one lane keep the plan's promises; the lanes share the worker's read-ahead."""

from __future__ import annotations

import os

import pytest
from conftest import text_dataset

from streambatch import StreamBatchLoader
from streambatch.read.lanes import lane_options
from streambatch.read.reader import ReadOptions, read_shard

BUDGET = 600


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """240 token documents in 12 shards of 20."""
    return text_dataset(tmp_path_factory.mktemp("lanes"), 240, 5, max_count=20)


#: every shard through the tar parser, in lanes
STREAMED = dict(read_by_position=False)


def _keys(loader: StreamBatchLoader) -> list[list[str]]:
    return [list(b["keys"]) for b in loader]


@pytest.mark.parametrize("interleave,num_workers", [(2, 0), (8, 0), (3, 2)])
def test_lanes_give_the_batches_read_by_position(ds, interleave, num_workers):
    """Lanes (several groups of shards per worker at interleave 2 and 3) yield exactly what positioned reads give,
    every sample once; and interleaving changes the batches against one shard at a time."""
    kw = dict(budget=BUDGET, seed=4, interleave=interleave, num_workers=num_workers)
    direct = _keys(StreamBatchLoader(ds, **kw))
    lanes = _keys(StreamBatchLoader(ds, **kw, **STREAMED))
    assert lanes == direct
    assert sorted(k for b in lanes for k in b) == sorted(f"s{i}" for i in range(240))
    assert _keys(StreamBatchLoader(ds, **{**kw, "interleave": 1})) != direct


def test_a_resume_mid_epoch_streams_the_remaining_batches(ds):
    kw = dict(budget=BUDGET, seed=4, interleave=4, **STREAMED)
    full = _keys(StreamBatchLoader(ds, **kw))
    loader = StreamBatchLoader(ds, **kw)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    again = StreamBatchLoader(ds, **kw)
    again.load_state_dict(state)
    assert _keys(again) == full[5:]


def test_a_resume_on_two_workers_from_one_streams_the_rest_once(ds):
    """Another layout: the new plan interleaves what the old one left, and every sample comes exactly once."""
    kw = dict(budget=BUDGET, seed=4, interleave=4, **STREAMED)
    loader = StreamBatchLoader(ds, **kw)
    it = iter(loader)
    first = [list(next(it)["keys"]) for _ in range(6)]
    again = StreamBatchLoader(ds, **kw, num_workers=2)
    again.load_state_dict(loader.state_dict())
    rest = _keys(again)
    assert sorted(k for b in first + rest for k in b) == sorted(f"s{i}" for i in range(240))


def test_a_bad_shard_in_one_lane_costs_that_shard_only(ds, tmp_path):
    import shutil

    copy = str(tmp_path / "ds")
    shutil.copytree(ds, copy)
    path = os.path.join(copy, "shard-000003.tar")
    lost = {s["__key__"] for s in read_shard(path)}
    with open(path, "r+b") as f:  # cut inside the shard: its tail is gone
        f.truncate(os.path.getsize(path) // 2)
    loader = StreamBatchLoader(copy, budget=BUDGET, seed=4, interleave=4, max_bad_shards=2, **STREAMED)
    batches = [list(b["keys"]) for b in loader]
    assert len(batches) == len(loader)  # equal steps, fault or not
    stats = loader.fault_stats()
    assert stats["bad_shard_urls"] == [path]
    seen = {k for b in batches for k in b}
    assert {f"s{i}" for i in range(240)} - lost <= seen  # every other shard's samples came


@pytest.mark.parametrize("lanes", [1, 2, 8, 64])
def test_lanes_share_the_workers_read_ahead_and_requests(lanes):
    """The lanes of one worker together hold at most its read-ahead, start with at most its starting requests in
    flight and keep at most its requests in flight (one each at least), each with chunks its share holds two of."""
    opts = ReadOptions(read_ahead="64M", chunk_size="8M", read_concurrency=4, max_read_concurrency=16)
    one = lane_options(opts, lanes)
    assert one.read_ahead * lanes <= opts.read_ahead
    assert one.max_read_concurrency == max(1, 16 // lanes) and one.read_concurrency <= one.max_read_concurrency
    assert one.read_concurrency * lanes <= max(opts.read_concurrency, lanes)
    assert one.chunk_size <= opts.chunk_size
    if lanes > 1:
        assert one.chunk_size <= max(one.read_ahead // 2, 1 << 20)
