"""A checkpoint resumes only the epoch it was saved in: a state of another dataset of the same size, of this one
sharded again, or saved mid-epoch (on any layout) with other batching or length options is refused, since its
consumed count would point into other batches and samples would be lost or repeated silently (found by a probe
of DDP resumption, 2026-11-27). The same shards indexed again or copied elsewhere resume exactly."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
from conftest import audio_dataset, text_dataset

from streambatch import StateError, StreamBatchLoader
from streambatch.format.index import upgrade

BUDGET = 1000


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """The same 60 documents written three ways (v1 index; shuffled into shards) and 60 other documents."""
    root = tmp_path_factory.mktemp("belongs")
    out = {}
    for name, seed, write in (("a", 1, {"index_version": 1}), ("shuffled", 1, {"shuffle": True}), ("b", 2, {})):
        (root / name).mkdir()
        out[name] = text_dataset(root / name, 60, seed=seed, max_count=7, **write)
    return out


def keys(loader, n=None):
    it = iter(loader)
    return [k for _, b in zip(range(n if n is not None else 10**9), it) for k in b["keys"]]


def saved_after(src, n, budget=BUDGET, **kw):
    loader = StreamBatchLoader(src, budget, **kw)
    return keys(loader, n), loader.state_dict()


@pytest.mark.parametrize("other", ["b", "shuffled"])
def test_a_state_of_another_dataset_of_the_same_size_is_refused(texts, other):
    _, state = saved_after(texts["a"], 2)
    loader = StreamBatchLoader(texts[other], BUDGET)
    with pytest.raises(StateError, match="another dataset of as many samples, or for this one before it was sharded"):
        loader.load_state_dict(state)
    assert Counter(keys(loader)) == Counter(f"s{i}" for i in range(60))  # the loader is as it was


def test_the_same_shards_indexed_again_or_copied_resume_exactly(texts, tmp_path):
    whole = keys(StreamBatchLoader(texts["a"], BUDGET))
    seen, state = saved_after(texts["a"], 2)
    copy = shutil.copytree(texts["a"], tmp_path / "copy")
    upgrade(str(copy), progress=False)  # index version 1 -> 2, another id
    rest = StreamBatchLoader(str(copy), BUDGET)
    rest.load_state_dict(state)
    assert seen + keys(rest) == whole


def test_options_are_checked_after_a_resume_on_another_layout_even_before_a_batch(texts):
    """2 ranks save mid-epoch; 1 rank resumes and saves again before its first batch (batches_consumed 0): that
    state is still mid-epoch, so another budget is refused, and the same budget gives every sample once."""
    seen, states = [], []
    for rank in range(2):
        s, state = saved_after(texts["a"], 2, rank=rank, world_size=2)
        seen += s
        states.append(state)
    one = StreamBatchLoader(texts["a"], BUDGET, rank=0, world_size=1)
    one.load_state_dict(states[0])
    chained = one.state_dict()
    assert chained["batches_consumed"] == 0 and chained["earlier_layouts"]
    with pytest.raises(StateError, match=r"other batching options: budget=1000\.0 \(now 700\.0\)"):
        StreamBatchLoader(texts["a"], 700, rank=0, world_size=1).load_state_dict(chained)
    again = StreamBatchLoader(texts["a"], BUDGET, rank=0, world_size=1)
    again.load_state_dict(chained)
    assert Counter(seen + keys(again)) == Counter(f"s{i}" for i in range(60))


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    return audio_dataset(tmp_path_factory.mktemp("speed"), 24, corpus_seed=3, max_count=5)


@pytest.mark.parametrize("now", [{"speed_perturb": None}, {"speed_perturb": [0.8, 1.2]}, {"features": "fbank"}])
def test_other_speed_factors_or_features_mid_epoch_are_refused(audio, now):
    """The speed factors and the frames ``features`` counts change the planned lengths, hence the batches."""
    kw = {"decode": "audio", "speed_perturb": [0.9, 1.0, 1.1]}
    loader = StreamBatchLoader(audio, "4s", **kw)
    next(iter(loader))
    state = loader.state_dict()
    again = StreamBatchLoader(audio, "4s", **kw)
    again.load_state_dict(state)  # the same options resume
    with pytest.raises(StateError, match=r"other batching options: .*(speed_perturb|features_frames)="):
        StreamBatchLoader(audio, "4s", **{**kw, **now}).load_state_dict(state)
