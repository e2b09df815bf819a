"""Workers forked after the loader planned an epoch take the lengths it planned on (``SharedEpochState.planned``)
instead of reading their shards' lengths from the index again (a round trip per worker and epoch on object
storage), and yield exactly the batches of workers that read their own; workers kept from an earlier epoch
(``persistent_workers``) read them, as before, while the loader holds none for them, and a loader whose workers do
not fork holds none. Either way the batches are the planned ones (`step_samples`)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import pytest
from conftest import text_dataset

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


def _planned(loader: StreamBatchLoader, epochs: int = 2) -> list[list[str]]:
    """Every step's keys as the plan names them (`step_samples`), without reading a shard."""
    out = []
    for e in range(epochs):
        loader.set_epoch(e)
        out += [loader.step_samples(k).keys()[0] for k in range(len(loader))]
    return out


def test_forked_workers_read_no_lengths_and_yield_the_planned_batches(shards, readers):
    loader = StreamBatchLoader(shards, **KW)
    held = _keys(loader)
    assert set(readers()) == {os.getpid()}, "a worker read lengths the loader had planned on"
    assert held == _planned(StreamBatchLoader(shards, **KW)) and len(held) > 4


def test_the_loaders_own_stream_reads_no_lengths_either(shards, readers):
    loader = StreamBatchLoader(shards, **dict(KW, num_workers=0))
    held = []
    for e in range(2):
        loader.set_epoch(e)
        len(loader)  # the epoch is planned: its lengths read once
        reads = len(readers())
        held += [list(b["keys"]) for b in loader]
        assert len(readers()) == reads, "the stream read the lengths its epoch was planned on again"
    assert held == _planned(StreamBatchLoader(shards, **dict(KW, num_workers=0)))


def test_persistent_workers_read_later_epochs_lengths_themselves(shards, readers):
    loader = StreamBatchLoader(shards, persistent_workers=True, **KW)
    held = _keys(loader, epochs=3)
    # the running workers cannot take what the loader plans on after they started: they read epochs 1 and 2
    assert any(pid != os.getpid() for pid in readers()) and loader.schedule(2).lengths is None
    assert held == _planned(StreamBatchLoader(shards, **KW), epochs=3)


@pytest.fixture
def spawned() -> Any:
    """Workers start by spawn for the test (then as before)."""
    before = multiprocessing.get_start_method()
    multiprocessing.set_start_method("spawn", force=True)
    yield
    multiprocessing.set_start_method(before, force=True)


def test_a_loader_whose_workers_do_not_fork_holds_no_lengths(shards, spawned):
    loader = StreamBatchLoader(shards, **KW)
    assert _keys(loader, epochs=1)  # the workers read their own lengths (not counted here: nothing patched there)
    assert loader.schedule(0).lengths is None  # nothing would take them


def test_a_filtered_loaders_workers_fork_and_take_its_lengths(shards, readers):
    loader = StreamBatchLoader(shards, where="length > 3", **KW)
    held = _keys(loader)
    assert loader.schedule(1).lengths is not None  # held for the workers forked after planning
    assert set(readers()) == {os.getpid()}, "a worker of a filtered loader read lengths the loader had planned on"
    assert held == _planned(StreamBatchLoader(shards, where="length > 3", **KW)) and len(held) > 4
