"""What a careless caller hands the loader after it is built: an epoch, a ``state_dict``, the planner's public
functions. Each bad value is one line of the package's own error naming it (found by a probe of the API,
2026-11-27), raised before anything is planned or read."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import text_dataset

from streambatch import OptionError, StateError, StreamBatchLoader, estimate_boundaries


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("state"), 40, seed=5)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("other"), 30, seed=6)


@pytest.mark.parametrize("epoch", [-1, "3", 1.5, None, float("nan")])
def test_a_bad_epoch_is_named(ds, epoch):
    loader = StreamBatchLoader(ds, 1000)
    with pytest.raises(OptionError, match="epoch"):
        loader.set_epoch(epoch)
    assert loader.epoch == 0


@pytest.mark.parametrize(
    "state,said",
    [
        (None, "not a loader state_dict"),
        ([1, 2], "not a loader state_dict"),
        ("hello", "not a loader state_dict"),
        ({"batches_consumed": 3}, "not a loader state_dict"),
        ({"epoch": -1}, "epoch must be at least 0"),
        ({"epoch": 0, "batches_consumed": -5}, "batches_consumed must be at least 0"),
        ({"epoch": 0, "batches_consumed": float("nan")}, "batches_consumed must be a whole number"),
    ],
)
def test_a_state_that_is_not_one_is_refused(ds, state, said):
    loader = StreamBatchLoader(ds, 1000)
    with pytest.raises(StateError, match=said) as got:
        loader.load_state_dict(state)
    assert "\n" not in str(got.value)
    assert isinstance(got.value, ValueError)  # what callers caught before the error had its own class
    assert len(list(loader)) == len(loader)  # the loader is as it was


def test_a_state_of_another_dataset_is_a_state_error(ds, other):
    saved = StreamBatchLoader(other, 1000)
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    with pytest.raises(StateError, match="state was saved for a dataset of 30 samples, this one has 40"):
        StreamBatchLoader(ds, 1000).load_state_dict(state)


@pytest.mark.parametrize(
    "kw,named",
    [
        ({"num_buckets": 10**9}, "num_buckets must be at most 4,096"),
        ({"num_buckets": 0}, "num_buckets must be at least 1"),
        ({"budget": -5}, "budget must be positive"),
        ({"spacing": "linear"}, "spacing"),
    ],
)
def test_estimate_boundaries_checks_its_arguments(kw, named):
    args = {"lengths": np.array([1, 2, 3, 100]), "budget": 1000, "num_buckets": 2, **kw}
    with pytest.raises(OptionError, match=named):
        estimate_boundaries(**args)


def test_a_launcher_variable_that_is_not_a_number_is_named(ds, monkeypatch):
    """Read as unset, it would make every rank rank 0 of 1: each would take the whole dataset."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "abc")
    with pytest.raises(OptionError, match="WORLD_SIZE='abc' is not a whole number"):
        StreamBatchLoader(ds, 1000)
