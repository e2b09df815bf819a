"""The epoch plan over many DDP layouts, without processes: exactly once, equal steps, resumption."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streambatch.plan.config import BatchingConfig
from streambatch.plan.epoch import consumed_ids, interleave, make_epoch_plan, per_worker
from streambatch.plan.layout import Layout
from streambatch.synthetic import librispeech_like

BUDGET = 200 * 16000


def shards(num_shards, per_shard, seed=0):
    lengths = librispeech_like(num_shards * per_shard, seed=seed)
    return [lengths[i * per_shard : (i + 1) * per_shard] for i in range(num_shards)]


def rank_batches(plan, rank):
    """Global-id batches of a rank in the order its DataLoader yields them."""
    out = []
    for w, i in plan.rank_order(rank):
        sp = plan.slots[rank * plan.num_workers + w]
        out.append(sp.gids[sp.batches[i]])
    return out


@pytest.mark.parametrize("even", ["split", "drop", "pad"])
@pytest.mark.parametrize("layout", [(2, 2, 8), (3, 2, 4), (4, 1, 1), (2, 2, 1), (5, 3, 7)])
def test_equal_steps_and_exactly_once(even, layout):
    world, workers, nshards = layout
    sl = shards(nshards, 60)
    cfg = BatchingConfig(budget=BUDGET, buffer_size=50, seed=3)
    plan = make_epoch_plan(sl, cfg, epoch=0, layout=Layout(world, workers, even))
    n = sum(len(x) for x in sl)
    lengths = np.concatenate(sl)
    per_rank = [rank_batches(plan, r) for r in range(world)]
    assert all(len(b) == plan.steps for b in per_rank)  # equal steps, known before the epoch
    assert plan.steps > 0
    ids = np.concatenate([g for bs in per_rank for g in bs])
    for bs in per_rank:
        for g in bs:
            assert len(g) * lengths[g].max() <= BUDGET
    if even in ("pad", "split"):
        assert len(np.unique(ids)) == n  # nothing lost; repeats (split: what splits cannot reach) are counted
        assert len(ids) - n == plan.repeated_samples and plan.surplus_samples == 0
    else:
        assert len(np.unique(ids)) == len(ids)  # never twice
        assert len(ids) + plan.surplus_samples == n  # all but the counted surplus


def test_surplus_differs_between_epochs():
    sl = shards(11, 60)
    cfg = BatchingConfig(budget=BUDGET, buffer_size=50, seed=1)
    left_out = []
    for epoch in range(3):
        plan = make_epoch_plan(sl, cfg, epoch, Layout(3, 2, "drop"))
        seen = np.concatenate([g for r in range(3) for g in rank_batches(plan, r)])
        left_out.append(set(range(660)) - set(seen.tolist()))
        assert len(left_out[-1]) == plan.surplus_samples
    assert left_out[0] != left_out[1] or left_out[1] != left_out[2]


def test_fewer_shards_than_slots_splits_inside_shards():
    sl = shards(1, 200)
    cfg = BatchingConfig(budget=BUDGET, buffer_size=50)
    plan = make_epoch_plan(sl, cfg, 0, Layout(3, 2, "split"))
    assert all(len(s.pieces) == 1 for s in plan.slots)  # every slot got a piece of the one shard
    ids = np.concatenate([g for r in range(3) for g in rank_batches(plan, r)])
    assert sorted(ids.tolist()) == list(range(200))


def test_round_robin_order_and_consumed_split():
    assert interleave([2, 3, 1]) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (1, 2)]
    assert per_worker([2, 3, 1], 4) == [2, 1, 1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=7), st.data())
def test_consumed_split_follows_the_round_robin_order(counts, data):
    """per_worker counts without listing the order (a rank's epoch has 10^5 steps): it must agree with it."""
    consumed = data.draw(st.integers(0, sum(counts) + 2))
    start = data.draw(st.integers(0, max(0, len(counts) - 1)))
    expected = [0] * len(counts)
    for w, _ in interleave(counts, start)[:consumed]:
        expected[w] += 1
    assert per_worker(counts, consumed, start) == expected


@pytest.mark.parametrize("new_layout", [(2, 2), (3, 1), (1, 2), (4, 3)])
def test_replanned_resume_on_other_layout_loses_and_repeats_nothing(new_layout):
    sl = shards(6, 70)
    n = 420
    cfg = BatchingConfig(budget=BUDGET, buffer_size=40, seed=5)
    old = make_epoch_plan(sl, cfg, 2, Layout(2, 2, "split"))
    k = old.steps // 2
    done = consumed_ids(old, k)
    seen_before = np.concatenate([g for r in range(2) for g in rank_batches(old, r)[:k]])
    assert sorted(seen_before.tolist()) == sorted(done.tolist())
    mask = np.zeros(n, dtype=bool)
    mask[done] = True
    new = make_epoch_plan(sl, cfg, 2, Layout(*new_layout, "split"), excluded=mask)
    after = np.concatenate([g for r in range(new_layout[0]) for g in rank_batches(new, r)])
    both = np.concatenate([seen_before, after])
    assert len(both) == len(np.unique(both)) == n  # none twice, none lost
    assert all(len(rank_batches(new, r)) == new.steps for r in range(new_layout[0]))


def test_default_bucket_count_scales_with_the_number_of_samples():
    """Each default bucket holds at least two full batches of median samples: 60 samples at 32 per batch get
    no boundaries; more data gets more buckets, up to the capacity spread's count (at most 64)."""
    from streambatch.plan.buckets import default_num_buckets, estimate_boundaries, suggest_budget

    lengths = librispeech_like(200_000, seed=3)
    budget = 32 * float(np.median(lengths))
    counts = [default_num_buckets(lengths[:n], budget) for n in (60, 500, 2_000, 20_000, 200_000)]
    assert counts[0] == 1 and len(estimate_boundaries(lengths[:60], budget)) == 0
    assert counts == sorted(counts) and counts[-1] > counts[1] > 1
    assert counts[1] * 2 * 30 <= 500 and 8 <= counts[-1] <= 64  # ~31 samples per batch at 500; capped by spread
    assert 1 < len(estimate_boundaries(lengths, budget)) <= counts[-1] - 1  # snapped edges may merge
    assert len(estimate_boundaries(lengths[:60], suggest_budget(lengths[:60]), 5)) == 4  # asked for: given


def test_budget_parser_shared_by_the_loader_and_the_cli():
    from streambatch.errors import BudgetError
    from streambatch.plan.config import parse_budget

    assert parse_budget("60s", "samples", 16000) == 960_000
    assert parse_budget("500ms", "samples", 16000) == 8_000
    assert parse_budget("1.5min", "seconds") == 90
    assert parse_budget("300 tokens", "tokens") == parse_budget("300", "tokens") == parse_budget(300.0) == 300
    assert parse_budget("1e5 samples", "samples", 8000) == 100_000
    for bad, says in [
        ("60s", "seconds only make sense for audio"),
        ("nan", "positive finite"),
        ("-1", "positive finite"),
        ("0 tokens", "positive finite"),
        ("12 parsecs", "'parsecs' is not"),
    ]:
        with pytest.raises(BudgetError, match=says):
            parse_budget(bad, "tokens")
    with pytest.raises(BudgetError, match="a duration needs the dataset's unit"):
        parse_budget("60s")
    for bad in (float("inf"), float("nan"), 0, -3, None, True, "x"):
        with pytest.raises(BudgetError, match="budget"):
            parse_budget(bad, "samples", 16000)
