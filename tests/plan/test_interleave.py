"""Interleaved shards in the plan (``interleave``, plan rule 3): a slot's pieces stream a group at a time, each
group's samples merged in a seeded order; batches stay within the budget, every sample once, the counted plan
of a rank's main process equal to its workers' plans, and the order changes with the epoch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streambatch.errors import OptionError
from streambatch.plan.config import BatchingConfig, with_plan_version
from streambatch.plan.epoch import make_epoch_plan
from streambatch.plan.freshness import epoch_batches
from streambatch.plan.layout import Layout
from streambatch.plan.shards import Piece
from streambatch.plan.slot import arrival_order, plan_slot, slot_order
from streambatch.synthetic import SAMPLE_RATE, librispeech_like


@settings(max_examples=200, deadline=None)
@given(
    kept=st.lists(st.integers(0, 40), min_size=1, max_size=20), streams=st.integers(1, 9), seed=st.integers(0, 2**16)
)
def test_arrival_is_a_merge_of_each_group_keeping_tar_order(kept, streams, seed):
    kept = np.asarray(kept, dtype=np.int64)
    order = arrival_order(kept, streams, np.random.default_rng(seed)).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(kept)])
    assert sorted(order.tolist()) == list(range(int(starts[-1])))  # every position once
    piece = np.searchsorted(starts, order, side="right") - 1
    for p in range(len(kept)):  # each piece's samples in tar order
        assert np.all(np.diff(order[piece == p]) > 0)
    group = piece // streams  # group after group: arrival never goes back to an earlier group
    assert np.all(np.diff(group) >= 0)


def test_the_merge_changes_with_the_epoch_and_slot_and_is_off_where_asked():
    pieces = [Piece(s, 0, 50) for s in range(6)]
    offsets = np.arange(0, 350, 50)
    cfg = BatchingConfig(budget=1000.0, interleave=3)
    a, b, c = (slot_order(pieces, offsets, None, cfg, e, s) for e, s in ((0, 0), (1, 0), (0, 1)))
    assert a is not None and not np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.array_equal(a, slot_order(pieces, offsets, None, cfg, 0, 0))  # seeded
    assert slot_order(pieces, offsets, None, cfg.replace(interleave=1), 0, 0) is None
    assert slot_order(pieces, offsets, None, cfg.replace(shuffle=False), 0, 0) is None
    assert slot_order(pieces, offsets, None, with_plan_version(cfg.replace(), 2), 0, 0) is None
    assert slot_order(pieces[:1], offsets, None, cfg, 0, 0) is None


@pytest.mark.parametrize("interleave", [1, 2, 8])
def test_interleaved_epochs_keep_the_budget_and_every_sample_once(interleave):
    lengths = librispeech_like(6000, seed=1)
    shards = [lengths[i : i + 300] for i in range(0, len(lengths), 300)]
    budget = 200 * SAMPLE_RATE
    cfg = BatchingConfig.make(budget, lengths, seed=3, interleave=interleave)
    for epoch in (0, 1):
        plan = make_epoch_plan(shards, cfg, epoch, Layout(2, 2))
        batches = epoch_batches(plan)
        assert all(len(b) * lengths[b].max() <= budget for b in batches)
        ids = np.concatenate(batches)
        assert len(ids) == len(set(ids.tolist()))  # once at most, and every sample not left out is there
        left = plan.surplus_samples + plan.skipped_samples + plan.dropped_samples
        assert len(ids) + left == len(lengths)


def test_a_counted_plan_has_the_sizes_of_the_full_one():
    """What a rank's main process counts (sizes only) equals what its worker plans, sample for sample."""
    lengths = librispeech_like(3000, seed=2)
    offsets = np.arange(0, 3001, 250)
    pieces = [Piece(s, 0, 250) for s in (3, 7, 1, 10, 5)]
    cfg = BatchingConfig.make(200 * SAMPLE_RATE, lengths, seed=5, interleave=4)
    full = plan_slot(pieces, lengths, offsets, cfg, 2, 1)
    counted = plan_slot(pieces, lengths, offsets, cfg, 2, 1, counted=True)
    assert full.order is not None
    assert [len(b) for b in full.batches] == [len(b) for b in counted.batches]
    assert sorted(np.concatenate(full.batches).tolist()) == list(range(len(full.gids)))


@pytest.mark.parametrize("bad", [0, 65, True, 2.0])
def test_interleave_is_checked_where_the_config_is_built(bad):
    with pytest.raises(OptionError, match="interleave"):
        BatchingConfig(budget=1000.0, interleave=bad)
