"""The planner's public helpers check what they are given where it comes in: lengths that are not a 1-D array of
finite lengths from 0 are an OptionError naming ``lengths`` (was a numpy error, or a budget of NaN)."""

from __future__ import annotations

import numpy as np
import pytest

from streambatch import BatchingConfig, BucketBatcher, OptionError, estimate_boundaries, suggest_budget
from streambatch.stats import LengthStats

BAD = [
    ("abc", "lengths must be a 1-D array"),
    (np.ones((3, 3)), "lengths must be a 1-D array"),
    (np.array([1.0, np.nan]), "finite numbers from 0, got nan"),
    (np.array([-5.0, 3.0]), "finite numbers from 0, got -5.0"),
    ([1.0, np.inf], "finite numbers from 0, got inf"),
]


@pytest.mark.parametrize("lengths, said", BAD)
def test_suggest_budget_names_bad_lengths(lengths, said):
    with pytest.raises(OptionError, match=said):
        suggest_budget(lengths)


@pytest.mark.parametrize("lengths, said", BAD)
def test_estimate_boundaries_names_bad_lengths(lengths, said):
    with pytest.raises(OptionError, match=said):
        estimate_boundaries(lengths, 1000.0, 4)


def test_suggest_budget_takes_a_sample_rate_from_1():
    with pytest.raises(OptionError, match="sample_rate must be at least 1"):
        suggest_budget(np.array([16000.0, 32000.0]), sample_rate=-1)


def test_good_lengths_and_statistics_still_pass():
    lengths = np.array([100.0, 200.0, 300.0])
    assert suggest_budget(lengths) == suggest_budget(LengthStats.of(lengths)) == 6400.0
    assert suggest_budget([]) == 0.0
    as_list = [10, 20, 30, 40]  # whole numbers in a list are lengths too
    assert list(estimate_boundaries(as_list, 100.0, 2)) == list(estimate_boundaries(np.array(as_list, float), 100.0, 2))


@pytest.mark.parametrize(
    "args, said",
    [
        (("config",), "config must be a BatchingConfig"),
        ((BatchingConfig(budget=100), "abc"), "seed must be a whole number"),
        ((BatchingConfig(budget=100), -1), "seed must be at least 0"),
        ((BatchingConfig(budget=100), 0, -5), "stream_length must be at least 0"),
    ],
)
def test_a_bucket_batcher_checks_what_it_is_built_with(args, said):
    with pytest.raises(OptionError, match=said):
        BucketBatcher(*args)


def test_a_batching_config_built_directly_takes_a_cost_model():
    """``cost="quadratic"`` is make()'s spelling; built directly, a name is refused instead of failing mid-plan."""
    with pytest.raises(OptionError, match="cost must be a cost model here, got 'x'.*BatchingConfig.make"):
        BatchingConfig(budget=100, cost="x")
    assert BatchingConfig.make(100, cost="quadratic", quadratic_factor=50.0).cost.name == "quadratic"


def test_a_seed_past_32_bits_is_refused_not_folded_onto_a_smaller_one():
    """Every random stream is keyed by the seed's low 32 bits: 2**32 would plan exactly as 0 does."""
    with pytest.raises(OptionError, match="seed must be at most 4,294,967,295"):
        BatchingConfig.make(100, seed=2**32)
    assert BatchingConfig.make(100, seed=2**32 - 1).epoch_seed == 2**32 - 1


@pytest.mark.parametrize(
    "options, said",
    [
        ({"cost": "quadratic", "quadratic_factor": 50.0}, "cost='quadratic' would be ignored"),
        ({"cost": lambda n, m: n * m}, "would be ignored"),
        ({"num_buckets": 4}, "num_buckets and bucket_boundaries would be ignored"),
        ({"bucket_boundaries": [10.0]}, "num_buckets and bucket_boundaries would be ignored"),
    ],
)
def test_options_packed_batches_would_ignore_are_refused(options, said):
    """Packed batches are cut by the sum of their lengths, in no bucket: a cost model or buckets beside
    ``packed=True`` did nothing."""
    lengths = np.arange(1.0, 50.0)
    with pytest.raises(OptionError, match=said):
        BatchingConfig.make(100, lengths, packed=True, **options)
    assert BatchingConfig.make(100, lengths, packed=True, cost="padded").cost.packed


def test_make_names_a_mean_length_that_is_not_a_number():
    with pytest.raises(OptionError, match="mean_length must be"):
        BatchingConfig.make(1000, mean_length="x")


def test_make_takes_a_list_of_lengths_and_names_what_is_not_a_number():
    """A list (as plan_batches takes lengths) was an AttributeError with num_buckets; sample_bytes='x' a TypeError;
    a cost function's result beyond a float an OverflowError."""
    listed = BatchingConfig.make(1000, [100, 200, 300, 400], num_buckets=2)
    array = BatchingConfig.make(1000, np.array([100.0, 200, 300, 400]), num_buckets=2)
    assert list(listed.bucket_boundaries) == list(array.bucket_boundaries) and listed.buffer_size == array.buffer_size
    with pytest.raises(OptionError, match="sample_bytes must be a number of at least 0 .*, got 'x'"):
        BatchingConfig.make(1000, np.array([1.0, 2.0]), sample_bytes="x")
    with pytest.raises(OptionError, match=r"cost must return a finite number .* returned 1000"):
        BatchingConfig.make(1000, np.array([1.0, 2.0]), cost=lambda n, m: 10**400)
    with pytest.raises(OptionError, match="max_batch_size must be at most 2,147,483,647"):
        BatchingConfig.make(1000, np.array([1.0, 2.0]), max_batch_size=2**63)
