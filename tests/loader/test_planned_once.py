"""A loader without workers plans each epoch once: its stream takes the slot plan its planner made for the
step count (``KeptSlots``) instead of batching the slot a second time, and yields exactly what it yielded when
it planned twice, also across epochs and a resume mid-epoch. A kept plan is handed to one pass (whose stream frees
it at its end): a second pass over an interrupted epoch plans its slot again, with the same batches."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import text_dataset

from streambatch import StreamBatchLoader

KW: dict[str, Any] = dict(budget=400, buffer_size=64, seed=3, num_workers=0)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    return text_dataset(tmp_path_factory.mktemp("once"), 300, seed=2, max_count=40)


def _keys(loader: StreamBatchLoader, epochs: int = 2) -> list[list[str]]:
    return [list(b["keys"]) for _ in range(epochs) for b in loader]


def test_the_stream_yields_the_planned_batches_as_a_worker_planning_its_own_would(shards):
    """Without workers the stream takes its planner's slot plan; one worker (the same single slot) plans its own in
    its process: the same batches, the planned ones, epoch after epoch."""
    once = _keys(StreamBatchLoader(shards, **KW))
    planner = StreamBatchLoader(shards, **KW)
    planned = []
    for e in range(2):
        planner.set_epoch(e)
        planned += [planner.step_samples(k).keys()[0] for k in range(len(planner))]
    own = _keys(StreamBatchLoader(shards, **dict(KW, num_workers=1)))
    assert once == planned == own and len(once) > 4


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_resume_mid_epoch_yields_the_rest_as_planned(shards, world_size):
    kw = dict(KW, rank=world_size - 1, world_size=world_size)
    whole = _keys(StreamBatchLoader(shards, **kw), epochs=1)
    first = StreamBatchLoader(shards, **kw)
    it = iter(first)
    head = [list(next(it)["keys"]) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    it.close()
    again = [list(b["keys"]) for b in first]  # a second pass over the interrupted epoch, from where it stopped
    resumed = StreamBatchLoader(shards, **kw)
    resumed.load_state_dict(state)
    rest = [list(b["keys"]) for b in resumed]
    assert head + rest == whole and head + again == whole
