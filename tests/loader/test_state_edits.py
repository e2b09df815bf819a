"""A checkpoint edited by hand so that every field stays in range is still refused where its fields disagree: a
lower ``plan_version`` than the state was planned by (the resumed epoch would be batched by another rule: samples
repeated and missed) and a state saved with an index whose dataset digest was removed (the dataset would go
unchecked). Unedited states, and the stored ones of earlier versions (test_checkpoint_compat.py), resume."""

from __future__ import annotations

import pytest
from conftest import text_dataset

from streambatch import StateError, StreamBatchLoader

BUDGET = 1000


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("edits"), 60, seed=1, max_count=7)


def keys(loader, n=None):
    it = iter(loader)
    return [k for _, b in zip(range(n if n is not None else 10**9), it) for k in b["keys"]]


def saved(ds, n=2):
    loader = StreamBatchLoader(ds, BUDGET, seed=3)
    return keys(loader, n), loader.state_dict()


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_a_plan_version_downgrade_is_refused(ds, version):
    _, state = saved(ds)
    assert state["plan_version"] > version
    loader = StreamBatchLoader(ds, BUDGET, seed=3)
    with pytest.raises(StateError, match="plan_version"):
        loader.load_state_dict({**state, "plan_version": version})


def test_a_state_without_its_plan_version_is_refused(ds):
    _, state = saved(ds)
    edited = {k: v for k, v in state.items() if k != "plan_version"}
    with pytest.raises(StateError, match="plan_version"):
        StreamBatchLoader(ds, BUDGET, seed=3).load_state_dict(edited)


@pytest.mark.parametrize("how", ["removed", "none"])
def test_a_state_without_its_dataset_digest_is_refused(ds, how):
    _, state = saved(ds)
    edited = {k: v for k, v in state.items() if k != "dataset"} if how == "removed" else {**state, "dataset": None}
    with pytest.raises(StateError, match="dataset digest"):
        StreamBatchLoader(ds, BUDGET, seed=3).load_state_dict(edited)


def test_an_unedited_state_resumes_exactly(ds):
    whole = keys(StreamBatchLoader(ds, BUDGET, seed=3))
    seen, state = saved(ds)
    rest = StreamBatchLoader(ds, BUDGET, seed=3)
    rest.load_state_dict(state)
    assert seen + keys(rest) == whole
    again = StreamBatchLoader(ds, BUDGET, seed=3)  # a state saved after that pass loads too: the next epoch
    again.load_state_dict(rest.state_dict())
    assert sorted(keys(again)) == sorted(whole)
