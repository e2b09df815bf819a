"""Balanced steps under plan rule 7: a span of a few rounds (audio's) slides, a batch moving at most ``rounds - 1``
rounds from where it forms, so a worker holds no more samples than a group of the same span held; it evens the
steps of speech lengths more than rule 6's groups did, and a rule-6 checkpoint's epoch keeps its groups."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from streambatch.plan.balance import BAND_ROUNDS, StepBalance, StepTime, rank_step_times, step_balance
from streambatch.plan.config import BatchingConfig, with_plan_version
from streambatch.plan.epoch import make_epoch_plan
from streambatch.plan.layout import Layout
from streambatch.synthetic import SAMPLE_RATE, librispeech_like

#: an attention-dominated step, Σ(L² + 50·L) with L in frames of 25 a second (lengths are in samples at 16 kHz)
PER = SAMPLE_RATE / 25
MODEL = StepTime(c=50.0 / PER, d=1.0 / PER**2)


def _speech(world: int, windows: float = 3.2, buffer: int = 2_000):
    lengths = librispeech_like(int(world * 2 * buffer * windows), 0)
    return lengths, [lengths[i : i + 500] for i in range(0, len(lengths), 500)]


def _moves(plan) -> list[int]:
    """For every batch of every slot: how many rounds its position's round lies from the round it formed in."""
    out = []
    for s in plan.slots:
        formed = np.asarray(s.rounds)
        out += np.abs(formed - np.sort(formed)).tolist()
    return out


@pytest.mark.parametrize("span", [2, 3, 5, BAND_ROUNDS])
def test_a_sliding_span_moves_a_batch_at_most_rounds_minus_one_rounds(span):
    lengths, shards = _speech(2, windows=2.0, buffer=400)
    cfg = BatchingConfig.make(
        200 * SAMPLE_RATE, lengths, seed=3, buffer_size=400, step_balance=StepBalance(MODEL, span)
    )
    plan = make_epoch_plan(shards, cfg, 0, Layout(2, 2))
    plain = make_epoch_plan(shards, cfg.replace(step_balance=None), 0, Layout(2, 2))
    moves = _moves(plan)
    assert max(moves) <= span - 1
    assert max(moves) >= 1  # the span is used: batches do cross rounds
    for s, p in zip(plan.slots, plain.slots):  # the same batches
        assert Counter(tuple(s.gids[b].tolist()) for b in s.batches) == Counter(
            tuple(p.gids[b].tolist()) for b in p.batches
        )


def test_a_rule_6_checkpoint_keeps_each_batch_in_its_group_of_rounds():
    lengths, shards = _speech(2, windows=2.0, buffer=400)
    cfg = BatchingConfig.make(200 * SAMPLE_RATE, lengths, seed=3, buffer_size=400, step_balance=StepBalance(MODEL, 2))
    old = make_epoch_plan(shards, with_plan_version(cfg.replace(), 6), 0, Layout(2, 2))
    new = make_epoch_plan(shards, cfg, 0, Layout(2, 2))
    for s in old.slots:
        formed = np.asarray(s.rounds)
        assert np.array_equal(formed // 2, np.sort(formed) // 2)  # rule 6: within its group of two rounds
    assert any(  # rule 7 slides across the groups' edges
        not np.array_equal(np.asarray(s.rounds) // 2, np.sort(np.asarray(s.rounds)) // 2) for s in new.slots
    )


def test_sliding_evens_speech_steps_more_than_groups_of_the_same_span():
    """8 ranks of LibriSpeech-like lengths, two rounds' span (what the loader picks for 16-bit audio at this
    window): the slowest rank's step over the mean rank's, lhotse's sync_buckets reaching about 1.03 here."""
    lengths, shards = _speech(8)
    cfg = BatchingConfig.make(200 * SAMPLE_RATE, lengths, seed=0, buffer_size=2_000, step_balance=StepBalance(MODEL, 2))
    got = {}
    for version in (6, 7):
        plan = make_epoch_plan(shards, with_plan_version(cfg.replace(), version), 0, Layout(8, 2))
        got[version] = step_balance(rank_step_times(plan, lengths, MODEL))["max_mean"]
    assert got[7] <= 1.03 < got[6], got


def _batches(loader, n=None):
    it = iter(loader)
    return [tuple(b["keys"]) for _, b in zip(range(n if n is not None else 10**9), it)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_resumed_mid_epoch_yields_the_rest_of_the_sliding_order(tmp_path, workers):
    from conftest import text_dataset

    from streambatch import StreamBatchLoader

    ds = text_dataset(tmp_path, 600, seed=2, max_count=50)
    opts = dict(seed=5, buffer_size=24, num_workers=workers, step_balance=StepBalance(StepTime(c=50.0, d=1.0), 3))
    whole = _batches(StreamBatchLoader(ds, 1000, **opts))
    plain = _batches(StreamBatchLoader(ds, 1000, **{**opts, "step_balance": None}))
    assert Counter(whole) == Counter(plain) and whole != plain  # the same batches, in the balanced order
    for k in (1, len(whole) // 3, len(whole) - 2):
        first = StreamBatchLoader(ds, 1000, **opts)
        head = _batches(first, k)
        again = StreamBatchLoader(ds, 1000, **opts)
        again.load_state_dict(first.state_dict())
        assert head + _batches(again) == whole


@pytest.mark.parametrize("span", [2, 4])
def test_a_checkpoints_equalisation_marks_exactly_the_batches_yielded_before_it(span):
    """Resuming on another layout marks what the old ranks yielded from the checkpoint's equalisation alone: the
    sliding order of the old slots' first batches is found again from the rounds that formed them and the rounds
    their order read ahead, at any step."""
    from streambatch.plan.epoch import consumed_ids
    from streambatch.plan.lengths import Lengths
    from streambatch.plan.resume import Consumed, EarlierRun

    lengths, shards = _speech(2, windows=2.0, buffer=400)
    cfg = BatchingConfig.make(
        200 * SAMPLE_RATE, lengths, seed=3, buffer_size=400, step_balance=StepBalance(MODEL, span)
    )
    layout = Layout(2, 2)
    plan = make_epoch_plan(shards, cfg, 1, layout)
    known = Lengths.of(shards)
    everything = np.arange(len(lengths))
    for k in range(1, plan.steps, max(1, plan.steps // 23)):
        oracle = np.zeros(len(lengths), dtype=bool)
        oracle[consumed_ids(plan, k)] = True
        fast = Consumed(known, cfg, 1, EarlierRun(layout, plan.steps, k, tuple(plan.equalised)))
        assert np.array_equal(fast[everything], oracle), k
