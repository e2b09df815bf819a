"""A pass whose iterator is dropped once it has yielded every batch of its epoch (Lightning's Trainer stops asking
after ``len(loader)`` batches; ``islice(loader, len(loader))`` does the same) has ended: the next pass is the next
epoch's, with all its batches, never an empty one."""

from __future__ import annotations

from itertools import islice

import pytest
from conftest import text_dataset

from streambatch import StreamBatchLoader


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("dropped"), 60, seed=2, max_count=10)


def keys(batches):
    return [list(b["keys"]) for b in batches]


@pytest.mark.parametrize("workers", [0, 2])
def test_each_pass_stopped_at_len_is_a_whole_epoch(data, workers):
    reference = StreamBatchLoader(data, 400, seed=3, num_workers=workers)
    expected = []
    for epoch in range(3):
        reference.set_epoch(epoch)
        expected.append(keys(reference))
    loader = StreamBatchLoader(data, 400, seed=3, num_workers=workers)
    got = []
    for _ in range(3):
        it = iter(loader)
        got.append(keys(islice(it, len(loader))))
        del it  # dropped after its last batch, never run to its end
    assert got == expected
    assert all(got) and got[0] != got[1]


def test_a_pass_cut_short_resumes_where_it_stopped(data):
    """Fewer than len() batches taken: the next pass goes on with the rest of the same epoch."""
    whole = keys(StreamBatchLoader(data, 400, seed=3))
    loader = StreamBatchLoader(data, 400, seed=3)
    first = keys(islice(iter(loader), 2))
    rest = keys(loader)
    assert first + rest == whole
