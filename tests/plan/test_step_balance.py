"""Balanced steps (``step_balance``): each rank's batches ordered so that step k takes about the same time on every
rank, keeping every promise of the plan: the same batches, equal steps, rank-local planning, exact resume at any
step on the same or another layout; older checkpoints' epochs keep their order; the time model fits timed steps."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streambatch.errors import OptionError
from streambatch.fit.calibrate import fit_step_time
from streambatch.plan.balance import STRATA, StepBalance, StepTime, rank_step_times, step_balance, targets
from streambatch.plan.config import BatchingConfig, with_plan_version
from streambatch.plan.epoch import (
    RankSchedule,
    RankSummary,
    consumed_ids,
    make_epoch_plan,
    plan_rank_local,
    rank_raw_slots,
)
from streambatch.plan.layout import Layout
from streambatch.plan.lengths import Lengths
from streambatch.plan.resume import Consumed, EarlierRun
from streambatch.plan.shards import plan_slots
from streambatch.plan.slot import apply_adjust, plan_slot
from streambatch.synthetic import text_like


@st.composite
def cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    shard_lengths = [rng.integers(1, 400, int(rng.integers(0, 160))) for _ in range(draw(st.integers(1, 8)))]
    config = BatchingConfig(
        budget=float(draw(st.sampled_from([400, 1_000, 3_000]))),
        buffer_size=draw(st.integers(1, 60)),
        seed=draw(st.integers(0, 3)),
        max_batch_size=draw(st.sampled_from([None, 3, 16])),
        step_balance=StepBalance(
            StepTime(c=draw(st.sampled_from([0.0, 50.0])), d=1.0), draw(st.sampled_from([1, 2, 3, 6, 8, 9]))
        ),
    )
    layout = Layout(
        draw(st.integers(1, 4)),
        draw(st.integers(1, 3)),
        draw(st.sampled_from(["split", "drop", "pad"])),
        draw(st.booleans()),
    )
    return shard_lengths, config, layout, draw(st.floats(0, 1))


def _gids(plan, s):
    sp = plan.slots[s]
    return [tuple(sp.gids[b].tolist()) for b in sp.batches]


@settings(max_examples=60, deadline=None)
@given(cases(), st.integers(1, 3), st.integers(1, 2))
def test_the_balanced_order_keeps_every_promise_of_the_plan(case, world, workers):
    shard_lengths, config, layout, fraction = case
    n = sum(len(x) for x in shard_lengths)
    try:
        plan = make_epoch_plan(shard_lengths, config, 1, layout)
        plain = make_epoch_plan(shard_lengths, config.replace(step_balance=None), 1, layout)
    except ValueError:
        return  # a rank with no data to pad with: both refuse
    # the same batches, repeats and adjustments in every slot, the same steps on every rank
    assert (plan.steps, plan.adjust, plan.first_worker) == (plain.steps, plain.adjust, plain.first_worker)
    for s in range(len(plan.slots)):
        assert Counter(_gids(plan, s)) == Counter(_gids(plain, s))
        assert sum(plan.slots[s].repeat) == sum(plain.slots[s].repeat)
    for r in range(layout.world_size):
        assert len(plan.rank_order(r)) == plan.steps
        if layout.hardest_first and plan.steps:  # the hardest batch still comes first
            w, b = plan.rank_order(r)[0]
            assert plain.rank_order(r)[0] == (w, b)
            assert _gids(plan, r * layout.num_workers + w)[0] == _gids(plain, r * layout.num_workers + w)[0]
    # rank-local planning and each worker's own slot give the global plan's order
    lengths = Lengths.of(shard_lengths)

    def gather(mine):
        rows = []
        for r in range(layout.world_size):
            s = RankSummary.of(rank_raw_slots(lengths, config, 1, r, layout))
            rows.append([s.batches, s.spare])
        return rows

    for rank in range(layout.world_size):
        local = plan_rank_local(lengths, config, 1, rank, layout, gather)
        want = RankSchedule.of(plan, rank)
        assert (local.steps, local.start, local.adjust) == (want.steps, want.start, want.adjust)
        for w, s in enumerate(plan.rank_slots(rank)):
            own = plan_slots(lengths, plan.num_workers * plan.world_size, config.seed, 1, True, slots=range(s, s + 1))
            raw = plan_slot(own[s], lengths, lengths.offsets, config, 1, s)
            got = apply_adjust(raw, local.adjust[w], config.seed, 1, s, lengths[raw.gids], config.cost, config.balance)
            assert [tuple(raw.gids[b].tolist()) for b in got.batches] == _gids(plan, s)
    # a resume at any step marks exactly what the ranks yielded: from the checkpoint's equalisation or re-planned
    k = int(plan.steps * fraction)
    oracle = np.zeros(n, dtype=bool)
    oracle[consumed_ids(plan, k)] = True
    fast = Consumed(lengths, config, 1, EarlierRun(layout, plan.steps, k, tuple(plan.equalised)))
    slow = Consumed(Lengths.of(shard_lengths), config, 1, EarlierRun(layout, plan.steps, k))
    assert np.array_equal(fast[np.arange(n)], oracle)
    assert np.array_equal(slow[np.arange(n)], oracle)
    # elastic: on another layout the rest of the epoch is planned around what was consumed, and a second resume
    # marks both layouts' batches exactly
    second = Layout(world, workers, layout.even_batches, layout.hardest_first)
    try:
        two = make_epoch_plan(shard_lengths, config, 1, second, oracle.copy())
    except ValueError:
        return
    again = two.steps // 2
    for s in range(len(two.slots)):
        for b in two.slots[s].batches:
            assert not oracle[two.slots[s].gids[b]].any()  # nothing consumed is planned again
    mask = oracle.copy()
    mask[consumed_ids(two, again)] = True
    lazy = Consumed(
        Lengths.of(shard_lengths), config, 1, EarlierRun(second, two.steps, again, tuple(two.equalised)), fast
    )
    assert np.array_equal(lazy[np.arange(n)], mask)


def test_balanced_steps_wait_less_for_the_slowest_rank():
    """On text lengths (an attention model's time Σ(L² + 50·L)), the balanced order leaves ranks idle for a
    fraction of what the random order does."""
    lengths = text_like(8 * 2 * 4_000 * 3, 0)
    shards = [lengths[i : i + 500] for i in range(0, len(lengths), 500)]
    model = StepTime(c=50.0, d=1.0)
    idle = {}
    for name, balance in (("random", None), ("balanced", StepBalance(model, 4))):
        cfg = BatchingConfig.make(16384, lengths, seed=0, buffer_size=4_000, step_balance=balance)
        plan = make_epoch_plan(shards, cfg, 0, Layout(8, 2))
        idle[name] = step_balance(rank_step_times(plan, lengths, model))["idle"]
    assert idle["balanced"] < 0.4 * idle["random"], idle


def test_an_older_rule_keeps_the_random_order():
    """A checkpoint of rule 5 resumes its epoch in the order it ran: no balance under an older plan_version."""
    rng = np.random.default_rng(0)
    shard_lengths = [rng.integers(1, 400, 120) for _ in range(6)]
    cfg = BatchingConfig(budget=1_000.0, buffer_size=30, seed=1)
    assert cfg.balance is not None
    old = with_plan_version(cfg.replace(), 5)
    assert old.balance is None
    got = make_epoch_plan(shard_lengths, old, 0, Layout(2, 2))
    want = make_epoch_plan(shard_lengths, cfg.replace(step_balance=None), 0, Layout(2, 2))
    assert [_gids(got, s) for s in range(4)] == [_gids(want, s) for s in range(4)]
    balanced = make_epoch_plan(shard_lengths, cfg, 0, Layout(2, 2))
    assert [_gids(balanced, s) for s in range(4)] != [_gids(want, s) for s in range(4)]


def test_targets_hold_one_value_in_each_stratum_and_are_the_same_from_any_start():
    t = targets(3, 1, 0, 5 * STRATA)
    for blk in range(5):
        strata = np.floor(t[blk * STRATA : (blk + 1) * STRATA] * STRATA).astype(int)
        assert sorted(strata.tolist()) == list(range(STRATA))
    assert np.array_equal(targets(3, 1, 7, 40), t[7:47])
    assert not np.array_equal(targets(3, 2, 0, STRATA), t[:STRATA])  # the epoch reshuffles them


def test_a_step_time_fits_timed_steps():
    true = StepTime(a=0.01, b=1e-4, e=2e-6, f=3e-9)
    rng = np.random.default_rng(0)
    timed = []
    for t in (16, 64, 256, 1024):
        for n in (1, 4, 32):
            lengths = rng.integers(t // 2, t + 1, n).astype(float)
            lengths[0] = t
            x = lengths
            timed.append((lengths, float(true.of(n, x.sum(), (x * x).sum(), x.max()))))
    fit = fit_step_time(timed, ("a", "b", "e", "f"))
    for name in ("a", "b", "e", "f"):
        assert getattr(fit, name) == pytest.approx(getattr(true, name), rel=1e-4)


@pytest.mark.parametrize(
    "value, match",
    [
        ("flash", "step_balance='flash'"),
        ({"a": 1, "z": 2}, "unknown StepTime"),
        ({"a": -1.0}, "StepTime.a must be"),
        ({}, "every coefficient 0"),
        ({"f": 1, "rounds": 0}, "rounds must be"),
        (3, "step_balance must be"),
    ],
)
def test_a_step_balance_that_is_not_a_time_model_is_refused(value, match):
    with pytest.raises(OptionError, match=match):
        BatchingConfig(budget=100.0, step_balance=value)


def test_the_default_spans_rounds_by_the_samples_bytes():
    lengths = text_like(10_000, 0)
    small = BatchingConfig.make(16384, lengths, sample_bytes=2_000)
    large = BatchingConfig.make(16384, lengths, sample_bytes=5_000_000)
    unknown = BatchingConfig.make(16384, lengths)
    assert small.balance.rounds > 1
    assert large.balance.rounds == 1 and unknown.balance.rounds == 1
    assert BatchingConfig.make(16384, lengths, step_balance=None).balance is None
    assert BatchingConfig.make(16384, lengths, shuffle=False).balance is None


def test_step_balance_is_the_slowest_rank_over_the_mean_and_the_idle_share():
    # two ranks, two steps: the slowest take 3 and 2, the mean ranks 2 and 2
    got = step_balance(np.array([[1.0, 2.0], [3.0, 2.0]]))
    assert got["max_mean"] == pytest.approx(5 / 4)
    assert got["idle"] == pytest.approx(1 - 4 / 5)
    assert step_balance(np.ones((3, 4))) == {"max_mean": 1.0, "idle": 0.0}
