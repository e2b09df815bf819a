"""Workers forked after the loader planned an epoch take the lengths it planned on (``SharedEpochState.planned``)
instead of reading their shards' lengths from the index again (a round trip per worker and epoch on object
storage), and yield exactly the batches of workers that read their own; workers kept from an earlier epoch
(``persistent_workers``) read them, as before, while the loader holds none for them, and a loader whose workers do
not fork holds none."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from conftest import text_dataset

import streambatch.loader.core as planning
from streambatch import ShardIndex, StreamBatchLoader

KW: dict[str, Any] = dict(budget=400, buffer_size=64, seed=3, num_workers=2)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    return text_dataset(tmp_path_factory.mktemp("lengths"), 300, seed=2, max_count=40)


@pytest.fixture
def readers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[int]]:
    """The process (pid) of each read of per-sample lengths from an index since the test began."""
    log = tmp_path / "reads"
    original = ShardIndex.shard_lengths

    def logged(self: ShardIndex, shards: Any) -> Any:
        with open(log, "a") as f:  # forked workers inherit the patch and append their own pid
            f.write(f"{os.getpid()}\n")
        return original(self, shards)

    monkeypatch.setattr(ShardIndex, "shard_lengths", logged)
    return lambda: [int(x) for x in log.read_text().split()] if log.exists() else []


def _keys(loader: StreamBatchLoader, epochs: int = 2) -> list[list[str]]:
    out = []
    for e in range(epochs):
        loader.set_epoch(e)
        out += [list(b["keys"]) for b in loader]
    return out


def test_forked_workers_read_no_lengths_and_yield_the_same_batches(shards, readers, monkeypatch):
    held = _keys(StreamBatchLoader(shards, **KW))
    assert set(readers()) == {os.getpid()}, "a worker read lengths the loader had planned on"
    monkeypatch.setattr(planning, "KEEP_LENGTHS_MAX", -1)  # nothing held: every worker reads its own
    read = _keys(StreamBatchLoader(shards, **KW))
    assert len(set(readers()) - {os.getpid()}) == 4  # the two workers of each of that run's two epochs did read
    assert held == read and len(held) > 4


def test_the_loaders_own_stream_reads_no_lengths_either(shards, readers, monkeypatch):
    kw = dict(KW, num_workers=0)
    held = _keys(StreamBatchLoader(shards, **kw))
    reads = len(readers())  # the planning's, once per epoch
    monkeypatch.setattr(planning, "KEEP_LENGTHS_MAX", -1)
    assert held == _keys(StreamBatchLoader(shards, **kw))
    assert len(readers()) - reads == 2 * reads  # where nothing is held the stream reads them again


def test_persistent_workers_read_later_epochs_lengths_themselves(shards, readers, monkeypatch):
    def worker_reads() -> int:
        return sum(pid != os.getpid() for pid in readers())

    loader = StreamBatchLoader(shards, persistent_workers=True, **KW)
    held = _keys(loader, epochs=3)
    inherited = worker_reads()
    # the running workers cannot take what the loader plans on after they started: it holds nothing for them
    assert loader._state.planned is None and loader.schedule(2).lengths is None
    monkeypatch.setattr(planning, "KEEP_LENGTHS_MAX", -1)
    assert held == _keys(StreamBatchLoader(shards, persistent_workers=True, **KW), epochs=3)
    # epochs 1 and 2 read by the workers in both runs, epoch 0 only where nothing was held
    assert inherited > 0 and 2 * (worker_reads() - inherited) == 3 * inherited


def test_a_loader_whose_workers_do_not_fork_holds_no_lengths(shards):
    loader = StreamBatchLoader(shards, where="length > 3", **KW)  # a filter starts the workers by forkserver
    assert _keys(loader, epochs=1)  # the workers read their own lengths (not counted here: nothing patched there)
    assert loader.schedule(0).lengths is None and loader._state.planned is None  # nothing would take them
