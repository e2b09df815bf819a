"""Fresh batch-mates (streambatch/plan/mates.py): batches trade members among near runs, so the batch-mates of one
epoch seldom meet again in the next, while every batch keeps its size, budget and bucket and every sample leaves
once; the pairs-kept measure (streambatch/plan/freshness.py); old checkpoints keep the rule they were planned by."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from test_batcher import any_stream, batch_cost

from streambatch.errors import OptionError
from streambatch.loader.state import LoaderState
from streambatch.plan.batcher import BucketBatcher, plan_batches
from streambatch.plan.config import PLAN_VERSION, BatchingConfig, with_plan_version
from streambatch.plan.epoch import make_epoch_plan
from streambatch.plan.freshness import epoch_batches, pairs_kept
from streambatch.plan.layout import Layout
from streambatch.synthetic import SAMPLE_RATE, librispeech_like


def _rule(lengths, budget, opts, version):
    cfg = with_plan_version(BatchingConfig.make(budget, lengths, **opts), version)
    return BucketBatcher(cfg).plan(lengths)


@settings(max_examples=300, deadline=None)
@given(any_stream)
def test_trading_keeps_sizes_budget_buckets_and_exactly_once(case):
    """Against rule 1 on the same stream: the same batch sizes in the same order, each batch within the budget
    and one bucket, the same samples left (every sample once), only the members of batches changed."""
    lengths, budget, opts = case
    new, old = _rule(lengths, budget, opts, 2), _rule(lengths, budget, opts, 1)
    assert new.sizes.tolist() == old.sizes.tolist()
    assert sorted(new.skipped) == sorted(old.skipped) and sorted(new.dropped) == sorted(old.dropped)
    assert sorted(np.concatenate([*new, np.zeros(0, dtype=np.int64)]).tolist()) == sorted(
        np.concatenate([*old, np.zeros(0, dtype=np.int64)]).tolist()
    )
    bounds = np.asarray(opts.get("bucket_boundaries") or [])
    for b in new:
        assert batch_cost(lengths, b, opts) <= budget
        if opts["max_batch_size"]:
            assert len(b) <= opts["max_batch_size"]
        if bounds.size and not opts.get("packed"):
            assert len(set(np.searchsorted(bounds, lengths[b], side="left").tolist())) == 1


def test_trading_is_seeded_and_online_equals_planned():
    lengths = librispeech_like(6000, seed=3)
    budget = 200 * SAMPLE_RATE
    a = plan_batches(lengths, budget, buffer_size=500, seed=1)
    b = plan_batches(lengths, budget, buffer_size=500, seed=1)
    c = plan_batches(lengths, budget, buffer_size=500, seed=2)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert pairs_kept(list(a), list(c), len(lengths)) < 0.5
    cfg = BatchingConfig.make(budget, lengths, buffer_size=500, seed=1)
    online = BucketBatcher(cfg, stream_length=len(lengths))
    pushed = [x for i, n in enumerate(lengths.tolist()) for x in online.push(i, n)] + online.flush()
    assert [x.tolist() for x in pushed] == [x.tolist() for x in a]


def test_batch_mates_meet_again_less_often_at_the_same_batch_count():
    """Two epochs of a sharded dataset on 4 workers: fewer pairs of epoch 0 meet again in epoch 1 than under
    rule 1, with exactly as many batches, every sample once and none over the budget."""
    lengths = librispeech_like(20_000, seed=0)
    shards = [lengths[i : i + 500] for i in range(0, len(lengths), 500)]
    budget = 200 * SAMPLE_RATE
    kept = {}
    for version in (1, 2, 3):
        cfg = with_plan_version(BatchingConfig.make(budget, lengths, seed=0), version)
        e0, e1 = (epoch_batches(make_epoch_plan(shards, cfg, e, Layout(1, 4))) for e in (0, 1))
        assert sorted(np.concatenate(e0).tolist()) == list(range(len(lengths)))
        assert all(len(b) * lengths[b].max() <= budget for b in e0)
        kept[version] = (pairs_kept(e0, e1, len(lengths)), len(e0))
    assert kept[2][1] == kept[1][1]
    assert kept[2][0] < 0.75 * kept[1][0]
    # rule 3 interleaves 8 shards per worker: other shards' samples share each window, at about the same count
    assert kept[3][0] < 0.9 * kept[2][0]
    assert kept[3][1] <= 1.002 * kept[2][1]


def _brute_kept(first, second):
    mates = {frozenset(p) for b in first for p in itertools.combinations(b.tolist(), 2)}
    again = {frozenset(p) for b in second for p in itertools.combinations(b.tolist(), 2)}
    return len(mates & again) / len(mates) if mates else 0.0


@pytest.mark.parametrize("seed", range(5))
def test_pairs_kept_counts_the_pairs_that_meet_again(seed):
    rng = np.random.default_rng(seed)
    n = 60
    cuts = lambda: np.split(rng.permutation(n), np.sort(rng.choice(np.arange(1, n), 9, replace=False)))  # noqa: E731
    first, second = cuts(), cuts()
    assert pairs_kept(first, second, n) == pytest.approx(_brute_kept(first, second))
    assert pairs_kept(first, first, n) == 1.0
    assert pairs_kept([np.array([i]) for i in range(n)], second, n) == 0.0  # no pairs at all


def test_an_old_checkpoint_keeps_rule_1_and_a_new_one_records_its_rule():
    cfg = BatchingConfig(budget=1000.0)
    assert cfg.plan_version == PLAN_VERSION == 7
    assert LoaderState.from_dict({"epoch": 3}).keep_plan_version(cfg).plan_version == 1
    for version in (2, 3, 4, 5, 6):
        assert (
            LoaderState.from_dict({"epoch": 3, "plan_version": version}).keep_plan_version(cfg).plan_version == version
        )
    assert LoaderState.current(epoch=0).to_dict()["plan_version"] == PLAN_VERSION
    with pytest.raises(OptionError, match="plan_version 8"):
        LoaderState.from_dict({"epoch": 3, "plan_version": 8}).keep_plan_version(cfg)


def _two_epochs(lengths, shards, **options):
    cfg = BatchingConfig.make(200 * SAMPLE_RATE, lengths, seed=0, **options)
    return [epoch_batches(make_epoch_plan(shards, cfg, e, Layout(1, 2))) for e in (0, 1)]


def test_a_wider_level_width_keeps_fewer_batch_mates_for_more_batches():
    """``level_width`` is the dial: off (the default), a width of a few hundredths of a second (about the
    default's batches), and one of 4 s (under half the pairs of epoch 0 meet again in epoch 1, at more batches);
    each epoch holds every sample once and no batch goes over the budget."""
    lengths = librispeech_like(8000, seed=1)
    shards = [lengths[i : i + 500] for i in range(0, len(lengths), 500)]
    kept = {}
    for width in (None, 0.02, 4.0):
        e0, e1 = _two_epochs(lengths, shards, level_width=None if width is None else width * SAMPLE_RATE)
        for epoch in (e0, e1):
            assert sorted(np.concatenate(epoch).tolist()) == list(range(len(lengths)))
            assert all(len(b) * lengths[b].max() <= 200 * SAMPLE_RATE for b in epoch)
        kept[width] = (pairs_kept(e0, e1, len(lengths)), len(e0))
    assert kept[4.0][0] < 0.5 * kept[None][0]
    assert kept[4.0][1] > kept[None][1]
    assert kept[0.02][1] <= 1.01 * kept[None][1]


def test_level_width_plans_as_the_online_batcher_cuts():
    lengths = librispeech_like(3000, seed=2)
    cfg = BatchingConfig.make(200 * SAMPLE_RATE, lengths, buffer_size=500, seed=1, level_width=SAMPLE_RATE)
    planned = BucketBatcher(cfg).plan(lengths)
    online = BucketBatcher(cfg, stream_length=len(lengths))
    pushed = [x for i, n in enumerate(lengths.tolist()) for x in online.push(i, n)] + online.flush()
    assert [x.tolist() for x in pushed] == [x.tolist() for x in planned]


@pytest.mark.parametrize(
    "options",
    [
        dict(level_width=0),
        dict(level_width=-1.0),
        dict(level_width="wide"),
        dict(level_width=1000.0, packed=True),
        dict(level_width=1000.0, num_buckets=4),
        dict(level_width=1000.0, shuffle=False),
    ],
)
def test_a_level_width_that_would_be_ignored_or_is_not_a_length_is_refused(options):
    with pytest.raises(OptionError, match="level_width"):
        BatchingConfig.make(200 * SAMPLE_RATE, librispeech_like(100, seed=0), **options)
