"""Options whose size or combination used to be accepted and then hung, cost minutes, was silently ignored, or
failed only mid-epoch in a worker: each is now one line of ``OptionError`` where the loader is built, naming the
option (both options, for a combination) and saying what is allowed."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import audio_dataset, text_dataset

from streambatch import Layout, OptionError, StreamBatchLoader
from streambatch.cli import main
from streambatch.loader.options import MAX_PREFETCH_FACTOR, MAX_WORKERS, RunOptions, SampleOptions
from streambatch.plan.config import BatchingConfig
from streambatch.plan.layout import MAX_SLOTS, MAX_WORLD_SIZE
from streambatch.read.reader import MAX_READ_CONCURRENCY, ReadOptions

BUDGET = 1000  # tokens; the documents are 1 to 119 tokens long


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("combos"), 40, seed=7)


def refused(ds, *names: str, **options) -> str:
    """The one-line message of the OptionError building a loader with ``options``; it names every one of ``names``."""
    with pytest.raises(OptionError) as got:
        StreamBatchLoader(ds, options.pop("budget", BUDGET), **options)
    message = str(got.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message
    return message


# ---- 1. sizes that hung or took minutes: bounded where the options are built ------------------------------------
@pytest.mark.parametrize(
    ("name", "value", "extra"),
    [
        ("world_size", 10**9, {"rank": 0}),  # planning dealt the epoch over a billion slots: it never returned
        ("world_size", MAX_WORLD_SIZE + 1, {"rank": 0}),
        ("num_workers", 10**6, {}),  # a million slots planned at len(), then a million processes
        ("num_workers", MAX_WORKERS + 1, {}),
        ("prefetch_factor", 10**6, {"num_workers": 2}),  # 2e6 requests queued before the first batch
        ("prefetch_factor", MAX_PREFETCH_FACTOR + 1, {"num_workers": 2}),
        ("max_read_concurrency", 10**9, {}),  # a thread and a connection per request in flight
        ("max_read_concurrency", MAX_READ_CONCURRENCY + 1, {}),
        ("dp_size", 10**9, {"dp_rank": 0}),
    ],
)
def test_a_size_beyond_its_bound_is_refused_when_the_loader_is_built(ds, name, value, extra):
    message = refused(ds, name, **extra, **{name: value})
    assert str(value) in message


def test_the_bounds_themselves_are_accepted():
    RunOptions(rank=0, world_size=MAX_WORLD_SIZE)
    RunOptions(num_workers=MAX_WORKERS, prefetch_factor=MAX_PREFETCH_FACTOR)
    ReadOptions(read_concurrency=MAX_READ_CONCURRENCY, max_read_concurrency=MAX_READ_CONCURRENCY)


def test_ranks_times_workers_beyond_the_slot_bound_names_both(ds):
    workers = MAX_SLOTS // MAX_WORLD_SIZE
    RunOptions(rank=0, world_size=MAX_WORLD_SIZE, num_workers=workers)  # exactly the bound
    refused(ds, "world_size", "num_workers", rank=0, world_size=MAX_WORLD_SIZE, num_workers=workers + 1)


def test_a_detected_world_size_is_bounded_as_a_given_one(ds, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(10**9))
    refused(ds, "world_size")


def test_a_layout_holds_the_same_bounds_as_the_loader(ds, capsys):
    """A ``Layout`` built elsewhere (``shardify inspect --plan --world-size``, a saved state's) is bounded too."""
    with pytest.raises(OptionError, match="world_size=1000000000 ranks: at most 65,536"):
        Layout(10**9)
    with pytest.raises(OptionError, match="num_workers=8 makes 524,288"):
        Layout(MAX_WORLD_SIZE, 8)
    with pytest.raises(OptionError, match="num_workers must be at most 1,024"):
        Layout(1, 2000)
    assert main(["inspect", ds, "--plan", "--world-size", str(10**9), "--budget", str(BUDGET)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "world_size=1000000000" in err[0], err


# ---- 2. combinations that were accepted and one option silently ignored ------------------------------------------
@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"num_buckets": 4, "bucket_boundaries": [30]}, ("num_buckets", "bucket_boundaries")),
        ({"quadratic_factor": 0.5}, ("quadratic_factor", "cost")),
        ({"quadratic_factor": 0.5, "cost": "padded"}, ("quadratic_factor", "cost")),
        ({"cache_size": "1G"}, ("cache_size", "cache_dir")),
        ({"prefetch_factor": 4}, ("prefetch_factor", "num_workers")),
        ({"read_concurrency": 32, "max_read_concurrency": 4}, ("read_concurrency", "max_read_concurrency")),
        ({"persistent_workers": True}, ("persistent_workers", "num_workers")),
        ({"batch_size_multiple_of": 16, "max_batch_size": 8}, ("batch_size_multiple_of", "max_batch_size")),
        ({"batches_per_epoch": 5}, ("batches_per_epoch", "index")),
        ({"packed": True, "num_buckets": 4}, ("packed", "num_buckets")),
        ({"output_budget": 50}, ("output_budget", "--output-length")),  # this index has no output lengths
    ],
)
def test_an_option_the_other_would_make_ignored_is_refused_naming_both(ds, options, names):
    refused(ds, *names, **options)


def test_a_cache_dir_that_is_a_file_is_refused(ds, tmp_path):
    path = tmp_path / "cache"
    path.write_text("not a folder")
    refused(ds, "cache_dir", "is a file", cache_dir=str(path))


def test_a_batch_cap_that_is_not_a_number_is_named_before_it_sizes_the_window(ds):
    refused(ds, "max_batch_size", max_batch_size=float("nan"))


def test_raising_read_concurrency_alone_says_to_raise_its_bound_too(ds):
    message = refused(ds, "read_concurrency", "max_read_concurrency", read_concurrency=32)
    assert "raise max_read_concurrency to at least 32" in message
    assert len(StreamBatchLoader(ds, BUDGET, read_concurrency=32, max_read_concurrency=32)) > 0


def test_the_combinations_given_rightly_still_work(ds, tmp_path):
    good = [
        {"num_buckets": 4},
        {"bucket_boundaries": [30]},
        {"cost": "quadratic", "quadratic_factor": 500.0},
        {"cache_size": "1G", "cache_dir": str(tmp_path / "cache")},
        {"buffer_size": 100, "refill": 100},
        {"buffer_size": 100, "refill": 1000},  # a refill of the window or more cuts all of it
        {"refill": 10**6},
    ]
    for options in good:
        assert len(StreamBatchLoader(ds, BUDGET, **options)) > 0, options
    assert StreamBatchLoader(ds, BUDGET, prefetch_factor=4, num_workers=1).run.prefetch_factor == 4


def test_batching_config_make_refuses_the_same_combinations():
    lengths = np.arange(1, 100, dtype=np.float64)
    with pytest.raises(OptionError, match="num_buckets.*bucket_boundaries"):
        BatchingConfig.make(BUDGET, lengths, num_buckets=3, bucket_boundaries=[10, 50])
    with pytest.raises(OptionError, match="quadratic_factor.*cost='quadratic'"):
        BatchingConfig.make(BUDGET, lengths, quadratic_factor=100.0)


# ---- 3. a padding multiple beyond the budget is named as such --------------------------------------------------
@pytest.mark.parametrize("multiple", [2000, 10**12])
def test_a_padding_multiple_the_budget_cannot_hold_names_pad_to_multiple_of(ds, multiple):
    message = refused(ds, "pad_to_multiple_of", pad_to_multiple_of=multiple)
    assert str(multiple) in message and "shortest" not in message
    assert len(StreamBatchLoader(ds, BUDGET, pad_to_multiple_of=8)) > 0


# ---- 4. callables checked where they are given, not in a worker at the first batch --------------------------------
@pytest.mark.parametrize(
    ("name", "fn", "expected"),
    [
        ("transform", lambda s: s, "fn(sample, rng)"),
        ("transform", lambda s, rng, extra: s, "fn(sample, rng)"),
        ("decode", lambda: 0, "fn(sample)"),
        ("worker_init_fn", lambda: None, "fn(worker_id)"),
    ],
)
def test_a_callable_with_the_wrong_arguments_is_refused_at_build(ds, name, fn, expected):
    message = refused(ds, name, **{name: fn})
    assert expected in message


def test_a_features_callable_with_the_wrong_arguments_is_refused():
    with pytest.raises(OptionError, match=r"features=.*fn\(waveform, sample_rate\)"):
        SampleOptions(features=lambda wav: wav)


class TwoArguments:
    def __call__(self, sample, rng):
        return sample


@pytest.mark.parametrize(
    "fn",
    [
        lambda sample, rng: sample,
        lambda *args: args[0],
        lambda sample, rng=None, scale=1.0: sample,
        functools.partial(lambda scale, sample, rng: sample, 2.0),
        TwoArguments(),
        max,  # a builtin whose signature cannot be read: taken as it is
    ],
)
def test_callables_that_take_the_arguments_are_accepted(fn):
    assert SampleOptions(transform=fn).transform is fn


def test_decode_audio_on_a_text_dataset_names_decode_and_the_unit(ds):
    message = refused(ds, "decode", decode="audio")
    assert "tokens" in message
    assert len(StreamBatchLoader(ds, BUDGET, decode="text")) > 0


def test_decode_text_on_an_audio_dataset_names_decode_and_the_unit(tmp_path_factory):
    """An audio dataset's shards hold no token ids: decode='text' would give batches without a payload."""
    audio = audio_dataset(tmp_path_factory.mktemp("audio"), 6, corpus_seed=1)
    message = refused(audio, "decode", budget="20s", decode="text")
    assert "samples" in message
    assert len(StreamBatchLoader(audio, "20s", decode="none")) > 0
