"""A resume that knows the old ranks' equalisation (a checkpoint of this version) batches each old slot only
as far as the batches it yielded: the samples it marks consumed must be exactly those of the full re-plan (the
older states' path) and of the global plan's oracle, on random layouts, options and resumes."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from streambatch.plan.config import BatchingConfig
from streambatch.plan.epoch import RankEqualised, consumed_ids, make_epoch_plan, split_rule
from streambatch.plan.layout import Layout
from streambatch.plan.lengths import Lengths
from streambatch.plan.resume import Consumed, EarlierRun
from streambatch.plan.slot import cut_largest, halve_largest


@st.composite
def cases(draw):
    num_shards = draw(st.integers(1, 10))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    shard_lengths = [rng.integers(1, 400, int(rng.integers(0, 80))) for _ in range(num_shards)]
    config = BatchingConfig(
        budget=float(draw(st.sampled_from([400, 1_000, 3_000]))),
        buffer_size=draw(st.integers(1, 80)),
        seed=draw(st.integers(0, 3)),
        max_batch_size=draw(st.sampled_from([None, 3, 16])),
        step_balance=draw(st.sampled_from(["attention", {"f": 1.0, "rounds": 3}, None])),
    )
    layout = Layout(
        draw(st.integers(1, 5)),
        draw(st.integers(1, 3)),
        draw(st.sampled_from(["split", "drop", "pad"])),
        draw(st.booleans()),
    )
    return shard_lengths, config, layout, draw(st.floats(0, 1))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_marking_from_the_yielded_batches_equals_the_full_replan(case):
    shard_lengths, config, layout, fraction = case
    n = sum(len(x) for x in shard_lengths)
    try:
        old = make_epoch_plan(shard_lengths, config, 1, layout)
    except ValueError:
        return  # a rank with no data to pad with: both planners refuse
    k = int(old.steps * fraction)
    assert len(old.equalised) == layout.world_size
    fast = Consumed(Lengths.of(shard_lengths), config, 1, EarlierRun(layout, old.steps, k, tuple(old.equalised)))
    slow = Consumed(Lengths.of(shard_lengths), config, 1, EarlierRun(layout, old.steps, k))
    oracle = np.zeros(n, dtype=bool)
    oracle[consumed_ids(old, k)] = True
    assert np.array_equal(fast[np.arange(n)], oracle)
    assert np.array_equal(slow[np.arange(n)], oracle)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(0, 60))
def test_the_split_rule_in_two_numbers_cuts_as_halve_largest(sizes, times):
    """Cut by the recorded (size, ties), batch by batch in stream order, the pieces are halve_largest's."""
    sizes_arr = np.array(sizes)
    times = min(times, int((sizes_arr - 1).sum()))  # no more cuts than the batches can take (as the planner)
    batches = [np.arange(n) + 1000 * i for i, n in enumerate(sizes)]
    want = list(batches)
    halve_largest(want, times)
    size, ties = split_rule(sizes_arr, times)
    from streambatch.plan.epoch import SlotEqualised
    from streambatch.plan.resume import PrefixOf

    eq = SlotEqualised(batches=len(want), cut_size=size, cut_ties=ties, take=len(want))
    prefix = PrefixOf(eq, len(want), np.random.default_rng(0))
    got = [p for b in batches for p in prefix._pieces(b)]
    assert [list(x) for x in got] == [list(x) for x in want]


def test_an_equalisation_round_trips_through_integers_and_a_checkpoint():
    old = make_epoch_plan([np.arange(1, 200) for _ in range(6)], BatchingConfig(budget=900.0), 0, Layout(3, 2))
    for eq in old.equalised:
        assert RankEqualised.of_ints(eq.to_ints()) == eq
    run = EarlierRun(Layout(3, 2), old.steps, old.steps // 2, tuple(old.equalised))
    back = EarlierRun.from_state(run.state_dict())
    assert back == run and back.rank(2) == old.equalised[2]
    older = run.state_dict()
    del older["equalised"]  # as a checkpoint of the previous version holds an earlier layout
    assert EarlierRun.from_state(older) == EarlierRun(Layout(3, 2), old.steps, old.steps // 2)


def test_an_equalisation_that_does_not_fit_the_layout_is_refused():
    import pytest

    old = make_epoch_plan([np.arange(1, 200) for _ in range(6)], BatchingConfig(budget=900.0), 0, Layout(3, 2))
    state = EarlierRun(Layout(3, 2), old.steps, 1, tuple(old.equalised)).state_dict()
    state["equalised"] = state["equalised"][:2]
    with pytest.raises(ValueError, match="does not fit"):
        EarlierRun.from_state(state)


def test_cut_largest_sizes_never_grow():
    """What split_rule rests on: the size cut each time never grows."""
    sizes = np.array([7, 3, 9, 9, 2])
    cuts = []
    for _ in range(12):
        cuts.append(int(sizes.max()))
        sizes, _ = cut_largest(sizes)
    assert cuts == sorted(cuts, reverse=True)


@settings(max_examples=60, deadline=None)
@given(cases(), st.integers(1, 4), st.integers(1, 3), st.floats(0, 1))
def test_a_chain_of_resumes_marks_from_yielded_batches_exactly(case, world, workers, fraction):
    """Two layouts before this one: the second's plan left out what the first consumed, and so must its
    prefix (the first layout's lazy mask is its ``prior``)."""
    shard_lengths, config, layout, first_fraction = case
    n = sum(len(x) for x in shard_lengths)
    second = Layout(world, workers, layout.even_batches, layout.hardest_first)
    try:
        one = make_epoch_plan(shard_lengths, config, 1, layout)
        k1 = int(one.steps * first_fraction)
        mask = np.zeros(n, dtype=bool)
        mask[consumed_ids(one, k1)] = True
        two = make_epoch_plan(shard_lengths, config, 1, second, mask)
    except ValueError:
        return
    k2 = int(two.steps * fraction)
    mask[consumed_ids(two, k2)] = True
    lengths = Lengths.of(shard_lengths)
    prior = Consumed(lengths, config, 1, EarlierRun(layout, one.steps, k1, tuple(one.equalised)))
    lazy = Consumed(lengths, config, 1, EarlierRun(second, two.steps, k2, tuple(two.equalised)), prior)
    assert np.array_equal(lazy[np.arange(n)], mask)


@settings(max_examples=100, deadline=None)
@given(cases(), st.integers(0, 2**16))
def test_asked_a_shard_at_a_time_the_mask_is_the_oracles(case, order_seed):
    """The planner asks about one piece of a shard at a time (what a resuming rank's own shards hold), in its own
    order: each answer, worked out from only the old slots those samples came from, is the oracle's."""
    shard_lengths, config, layout, fraction = case
    try:
        old = make_epoch_plan(shard_lengths, config, 1, layout)
    except ValueError:
        return
    k = int(old.steps * fraction)
    lengths = Lengths.of(shard_lengths)
    oracle = np.zeros(lengths.num_samples, dtype=bool)
    oracle[consumed_ids(old, k)] = True
    lazy = Consumed(lengths, config, 1, EarlierRun(layout, old.steps, k, tuple(old.equalised)))
    rng = np.random.default_rng(order_seed)
    for s in rng.permutation(lengths.num_shards).tolist():
        lo, hi = int(lengths.offsets[s]), int(lengths.offsets[s + 1])
        cut = int(rng.integers(lo, hi + 1))
        for a, b in ((cut, hi), (lo, cut)):
            assert np.array_equal(lazy[a:b], oracle[a:b])
        if hi > lo:
            gid = int(rng.integers(lo, hi))
            assert lazy[gid] == oracle[gid]


def test_a_resume_on_more_ranks_batches_about_what_a_fresh_plan_does(monkeypatch):
    """A rank resuming half an epoch saved on half as many ranks batches its own remaining samples and the
    consumed part of only the old slots its shards came from: about as many samples as a fresh plan of its slots
    (not its old rank's other slots too, which would make it 1.5 times as many)."""
    from streambatch.plan.batcher import BucketBatcher
    from streambatch.plan.epoch import plan_rank_local
    from streambatch.plan.resume import Resumed

    batched = [0]
    rounds = BucketBatcher.rounds

    def counted(self, *args, **kwargs):
        for flat, sizes in rounds(self, *args, **kwargs):
            batched[0] += int(np.sum(sizes))
            yield flat, sizes

    monkeypatch.setattr(BucketBatcher, "rounds", counted)
    rng = np.random.default_rng(7)
    shard_lengths = [rng.integers(50, 400, 100) for _ in range(120)]
    config = BatchingConfig(budget=2_000.0, buffer_size=40)
    old, new = Layout(2, 2), Layout(4, 2)
    saved = make_epoch_plan(shard_lengths, config, 1, old)
    lengths = Lengths.of(shard_lengths)
    for rank in range(new.world_size):
        batched[0] = 0
        plan_rank_local(lengths, config, 1, rank, new, lambda mine: [mine] * new.world_size)
        fresh = batched[0]
        batched[0] = 0
        done = Resumed(1, (EarlierRun(old, saved.steps, saved.steps // 2, tuple(saved.equalised)),))
        excluded = done.consumed(lengths, config)
        plan_rank_local(lengths, config, 1, rank, new, lambda mine: [mine] * new.world_size, excluded)
        assert batched[0] <= 1.2 * fresh


def test_a_resume_on_another_layout_holds_about_the_memory_of_a_fresh_plan():
    """Issue #47: a rank resuming on another world size needs at most 1.2 times a fresh plan's peak memory, also
    where the shard table is what costs (many small shards, few samples a rank): the old layout's deal of the
    shards is not held twice."""
    import tracemalloc

    from streambatch.plan.epoch import RankSummary, plan_rank, plan_rank_local, rank_raw_slots
    from streambatch.plan.resume import Resumed

    rng = np.random.default_rng(3)
    lengths = Lengths.of([rng.integers(50, 400, 2) for _ in range(60_000)])
    config = BatchingConfig(budget=2_000.0, buffer_size=40)
    old, new, rank = Layout(512, 2), Layout(256, 2), 100
    near = (2 * rank, 2 * rank + 1)  # the old ranks that held the resuming rank's shards
    counted = {r: rank_raw_slots(lengths, config, 1, r, old, counted=True) for r in near}
    steps = RankSummary.of(counted[near[0]]).batches
    eq = {r: plan_rank(counted[r], steps, old, config, 1, r, lengths).equalised for r in near}
    equalised = tuple(eq.get(r, eq[near[0]]) for r in range(old.world_size))
    done = Resumed(1, (EarlierRun(old, steps, steps // 2, equalised),))

    def peak(resumed):
        tracemalloc.start()
        excluded = done.consumed(lengths, config) if resumed else None
        plan_rank_local(lengths, config, 1, rank, new, lambda mine: [mine] * new.world_size, excluded)
        top = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return top

    peak(True)  # a first resume imports the modules it uses, which are not its plan's memory
    fresh, resumed = peak(False), peak(True)
    assert resumed <= 1.2 * fresh
