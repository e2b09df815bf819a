"""batch_order (random / ascending / descending) and bucket_spacing (quantile / exponential): in plan_batches
and, taken by name, in StreamBatchLoader over real shards."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import audio_dataset

from streambatch import BatchingConfig, ShardIndex, StreamBatchLoader, plan_batches
from streambatch.plan.buckets import estimate_boundaries
from streambatch.synthetic import DISTRIBUTIONS

SR = 8000
BUDGET = 12 * SR


@pytest.fixture(scope="module")
def audio_ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("order_ds")
    return audio_dataset(root, 120, 7, SR, max_count=20, shuffle=True, seed=2)


@pytest.mark.parametrize("name", ["librispeech", "text"])
def test_sorted_orders_are_the_random_plans_batches_sorted_by_longest_sample(name):
    gen, budget, _ = DISTRIBUTIONS[name]
    lengths = gen(30_000, seed=4)
    plans = {
        o: plan_batches(lengths, budget, buffer_size=2000, seed=9, batch_order=o)
        for o in ("random", "ascending", "descending")
    }
    longest = {o: np.array([lengths[b].max() for b in p]) for o, p in plans.items()}
    assert np.all(np.diff(longest["ascending"]) >= 0)
    assert np.all(np.diff(longest["descending"]) <= 0)
    assert not np.all(np.diff(longest["random"]) >= 0)
    as_set = {o: sorted(tuple(sorted(b.tolist())) for b in p) for o, p in plans.items()}
    assert as_set["ascending"] == as_set["random"] == as_set["descending"]  # same batches, only reordered
    # ties keep the planned order, so the sorted order is a stable sort of the random one
    stable = np.argsort(longest["random"], kind="stable")
    assert [plans["ascending"][i].tolist() for i in range(len(stable))] == [plans["random"][i].tolist() for i in stable]


def test_exponential_spacing_has_a_constant_ratio():
    gen, budget, _ = DISTRIBUTIONS["librispeech"]
    lengths = gen(20_000, seed=1)
    edges = estimate_boundaries(lengths, budget, 6, spacing="exponential")
    assert len(edges) == 5 and lengths.min() < edges[0] and edges[-1] < lengths.max()
    full = np.concatenate([[lengths.min()], edges, [lengths.max()]])
    ratios = full[1:] / full[:-1]
    np.testing.assert_allclose(ratios, ratios[0], rtol=1e-5)
    quantile = BatchingConfig.make(budget, lengths, num_buckets=6).bucket_boundaries
    exponential = BatchingConfig.make(budget, lengths, num_buckets=6, bucket_spacing="exponential").bucket_boundaries
    assert np.array_equal(exponential, edges) and not np.array_equal(quantile, exponential)
    plan = plan_batches(lengths, budget, num_buckets=6, bucket_spacing="exponential")
    for b in plan:  # no batch straddles an exponential boundary
        assert len(set(np.searchsorted(edges, lengths[b], side="left").tolist())) == 1


def test_bad_values_are_one_clear_line():
    with pytest.raises(
        ValueError, match="batch_order must be one of 'random', 'ascending', 'descending', got 'sorted'"
    ):
        BatchingConfig(100.0, batch_order="sorted")
    with pytest.raises(ValueError, match="bucket_spacing must be one of"):
        BatchingConfig.make(100.0, np.arange(1, 50), num_buckets=4, bucket_spacing="linear")
    with pytest.raises(ValueError, match="give num_buckets"):
        BatchingConfig.make(100.0, np.arange(1, 50), bucket_spacing="exponential")


def test_loader_takes_both_by_name_and_sorts_each_workers_batches(audio_ds):
    index = ShardIndex.load(audio_ds)
    loader = StreamBatchLoader(
        audio_ds,
        budget=BUDGET,
        buffer_size=30,
        seed=1,
        batch_order="ascending",
        num_buckets=4,
        bucket_spacing="exponential",
    )
    edges = loader.config.bucket_boundaries
    assert loader.config.batch_order == "ascending" and len(edges) == 3
    assert np.allclose(edges[1:] / edges[:-1], edges[1] / edges[0], rtol=1e-5)
    steps = len(loader)
    batches = list(loader)
    assert len(batches) == steps
    longest = [int(b["lengths"].max()) for b in batches]
    assert longest == sorted(longest)  # one rank, one worker: its whole stream shortest first
    keys = [k for b in batches for k in b["keys"]]
    assert len(keys) == len(set(keys)) == index.num_samples
    # two workers: each worker's stream is sorted; the DataLoader takes them in turn
    two = list(
        StreamBatchLoader(audio_ds, budget=BUDGET, buffer_size=30, seed=1, num_workers=2, batch_order="descending")
    )
    for w in (0, 1):
        mine = [int(b["lengths"].max()) for b in two[w::2]]
        assert mine == sorted(mine, reverse=True)
    assert sorted(k for b in two for k in b["keys"]) == sorted(keys)


def test_sorted_order_needs_an_index(audio_ds):
    urls = sorted(os.path.join(audio_ds, f) for f in os.listdir(audio_ds) if f.endswith(".tar"))
    with pytest.raises(ValueError, match="needs an index"):
        StreamBatchLoader(urls, budget=BUDGET, batch_order="ascending")
