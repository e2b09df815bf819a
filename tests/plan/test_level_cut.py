"""A short stream's level cut (rule 5, streambatch/plan/mates.py ``LevelCut``): a stream of at most two windows
(a small dataset, whose worker streams the same samples into one window every epoch) is cut at level tops, a
level's samples in a seeded random order, so its batches change from epoch to epoch; every batch stays within
the budget at its true lengths, every sample leaves once, the online path forms the planned batches, and longer
streams are planned exactly as under rule 4."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batcher import any_stream, batch_cost

from streambatch.plan.batcher import BucketBatcher
from streambatch.plan.config import BatchingConfig, with_plan_version
from streambatch.plan.epoch import make_epoch_plan
from streambatch.plan.freshness import epoch_batches, pairs_kept
from streambatch.plan.layout import Layout
from streambatch.plan.mates import LEVEL_CUT_WINDOWS, LEVELS, level, level_top
from streambatch.synthetic import SAMPLE_RATE, librispeech_like

BUDGET = 200 * SAMPLE_RATE


def _plan(lengths, budget, opts, version, **extra):
    cfg = with_plan_version(BatchingConfig.make(budget, lengths, **{**opts, **extra}), version)
    return BucketBatcher(cfg).plan(lengths)


@settings(max_examples=300, deadline=None)
@given(any_stream)
def test_budget_exactly_once_and_online_equals_plan_under_the_level_cut(case):
    """Rule 5 on any stream: no batch over the budget at the samples' own lengths, the same samples skipped as
    under rule 4 (the cut never makes a sample unbatchable), every sample once, and one push at a time (told the
    stream's length) forms the planned batches."""
    lengths, budget, opts = case
    new = _plan(lengths, budget, opts, 5)
    old = _plan(lengths, budget, opts, 4)
    for b in new:
        assert batch_cost(lengths, b, opts) <= budget
        if opts["max_batch_size"]:
            assert len(b) <= opts["max_batch_size"]
    assert sorted(new.skipped) == sorted(old.skipped)
    seen = np.concatenate([*new, new.skipped, new.dropped]) if len(lengths) else np.zeros(0)
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    cfg = BatchingConfig.make(budget, lengths, **opts)
    online = BucketBatcher(cfg, stream_length=len(lengths))
    pushed = [b for i, n in enumerate(lengths.tolist()) for b in online.push(i, n)] + online.flush()
    assert [b.tolist() for b in pushed] == [b.tolist() for b in new]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(1e-3, 1e12), min_size=1, max_size=50), st.floats(0, 1, exclude_max=True))
def test_a_level_top_bounds_its_level_within_a_level_width(values, phase):
    """The top is at least the length and at most a level's width (1/LEVELS of the length) above it; one level's
    lengths share a top, and a longer length never has a lower one."""
    x = np.sort(np.array(values))
    top = level_top(x, phase)
    assert (top >= x).all() and (top <= x * (1 + 1 / LEVELS)).all()
    assert (np.diff(top) >= 0).all()
    lv = level(x, phase)
    for v in np.unique(lv):
        assert len(np.unique(top[lv == v])) == 1


def test_a_small_dataset_batches_differently_every_epoch_at_about_the_same_count():
    """2,000 lengths in two shards of 1,000 on 4 workers (each worker's stream fits its window): rule 4 keeps
    most of epoch 0's batch-mate pairs in epoch 1, rule 5 far fewer, with at most a level's more batches and
    every batch within the budget."""
    lengths = librispeech_like(2000, seed=0)
    shards = [lengths[:1000], lengths[1000:]]
    kept, counts = {}, {}
    for version in (4, 5):
        cfg = with_plan_version(BatchingConfig.make(BUDGET, lengths, seed=0), version)
        e0, e1 = (epoch_batches(make_epoch_plan(shards, cfg, e, Layout(1, 4))) for e in (0, 1))
        assert sorted(np.concatenate(e0).tolist()) == list(range(len(lengths)))
        assert all(len(b) * lengths[b].max() <= BUDGET for b in e0 + e1)
        kept[version], counts[version] = pairs_kept(e0, e1, len(lengths)), len(e0)
    assert kept[4] > 0.5 and kept[5] < 0.75 * kept[4]
    assert counts[5] <= counts[4] * (1 + 2 / LEVELS)


def test_a_stream_longer_than_two_windows_is_planned_as_under_rule_4():
    lengths = librispeech_like(3000, seed=1)
    window = 3000 // LEVEL_CUT_WINDOWS - 1  # the stream is just over two windows
    a, b = (_plan(lengths, BUDGET, {}, v, buffer_size=window, seed=4) for v in (4, 5))
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    c, d = (_plan(lengths, BUDGET, {}, v, buffer_size=window + 1, seed=4) for v in (4, 5))
    assert [x.tolist() for x in c] != [x.tolist() for x in d]  # two windows: the level cut


def test_the_level_cut_is_seeded():
    lengths = librispeech_like(800, seed=2)
    a, b, c = (_plan(lengths, BUDGET, {}, 5, seed=s) for s in (1, 1, 2))
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert pairs_kept(list(a), list(c), len(lengths)) < 0.75


def test_the_order_samples_arrive_in_does_not_change_a_short_streams_batches():
    """One window of distinct lengths pushed in two orders (other shards interleaved, say): the same batches of
    the same samples, as a plain sort gives."""
    lengths = np.unique(librispeech_like(1500, seed=5))[:900].astype(np.float64)
    perm = np.random.default_rng(0).permutation(len(lengths))
    a = _plan(lengths, BUDGET, {}, 5, seed=3)
    b = _plan(lengths[perm], BUDGET, {}, 5, seed=3)
    assert [x.tolist() for x in a] == [perm[x].tolist() for x in b]
