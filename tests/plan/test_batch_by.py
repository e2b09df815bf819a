"""``batch_by="dataset"``: every batch from one dataset of a mixture, with every guarantee of the mixture kept —
the batcher never mixes group keys (planned and online alike), the rank-local plans equal the global oracle,
and on real shards each batch names one dataset, per-epoch counts are exact and a resume is exact."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from conftest import audio_dataset
from hypothesis import given, settings
from hypothesis import strategies as st

from streambatch import StreamBatchLoader, plan_batches
from streambatch.plan.batcher import BucketBatcher
from streambatch.plan.config import BatchingConfig
from streambatch.plan.epoch import RankSchedule, RankSummary, make_epoch_plan, plan_rank_local, rank_raw_slots
from streambatch.plan.layout import Layout
from streambatch.plan.lengths import Lengths
from streambatch.plan.shards import plan_slots
from streambatch.plan.slot import apply_adjust, plan_slot

SR = 8000
BUDGET = 10 * SR
SIZES = {"en": 40, "de": 30, "fr": 20}
WEIGHTS = {"en": 2.0, "de": 1.0, "fr": 0.5}


# ---- the batcher ----------------------------------------------------------------------------------------------
@st.composite
def streams(draw):
    n = draw(st.integers(0, 2500))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    lengths = rng.integers(100, 20_000, n)
    keys = rng.integers(0, draw(st.integers(1, 4)), n)
    opts = dict(
        buffer_size=draw(st.integers(1, 300)),
        seed=draw(st.integers(0, 5)),
        max_batch_size=draw(st.sampled_from([None, 3, 16])),
        batch_size_multiple_of=draw(st.sampled_from([1, 4])),
        num_buckets=draw(st.sampled_from([None, 3])),
        packed=draw(st.booleans()),
        drop_last=draw(st.booleans()),
    )
    if opts["max_batch_size"] is not None:  # a multiple above the cap is refused (it could never hold)
        opts["batch_size_multiple_of"] = min(opts["batch_size_multiple_of"], opts["max_batch_size"])
    if opts["packed"]:
        opts["num_buckets"] = None  # packed batches are cut by sum, in no bucket (refused beside packed=True)
    elif draw(st.booleans()):
        opts["output_budget"] = float(rng.integers(300, 3_000))
    return lengths, keys, opts


@settings(max_examples=80, deadline=None)
@given(streams())
def test_no_batch_mixes_keys_every_sample_once_budget_holds(case):
    lengths, keys, opts = case
    n, budget = len(lengths), 60_000.0
    outputs = np.maximum(1, lengths // 100)
    plan = plan_batches(lengths, budget, batch_by="dataset", groups=keys, output_lengths=outputs, **opts)
    for b in plan:
        assert len(set(keys[b].tolist())) == 1
        if opts["packed"]:
            assert lengths[b].sum() <= budget
        else:
            assert len(b) * lengths[b].max() <= budget
        if "output_budget" in opts:
            assert len(b) * outputs[b].max() <= opts["output_budget"]
    seen = np.concatenate([*plan, plan.skipped, plan.dropped]) if n else np.zeros(0)
    assert sorted(seen.tolist()) == list(range(n))
    # the online path: the same batcher fed one sample at a time forms the same batches
    config = BatchingConfig.make(budget, lengths, batch_by="dataset", **opts)
    online = BucketBatcher(config, stream_length=n)
    got = [b for i in range(n) for b in online.push(i, lengths[i], outputs[i], keys[i])] + online.flush()
    assert [b.tolist() for b in got] == [b.tolist() for b in plan]
    # one key: exactly the batches without batch_by
    one = plan_batches(
        lengths, budget, batch_by="dataset", groups=np.zeros(n, dtype=np.int64), output_lengths=outputs, **opts
    )
    assert one == plan_batches(lengths, budget, output_lengths=outputs, **opts)


def test_batch_by_needs_group_keys_and_knows_one_grouping():
    with pytest.raises(ValueError, match="group key"):
        plan_batches([100, 200], 1_000, batch_by="dataset")
    with pytest.raises(ValueError, match="batch_by must be None or one of 'dataset'"):
        BatchingConfig(budget=1_000.0, batch_by="speaker")


# ---- the planner: rank-local == the global oracle ------------------------------------------------------------
@st.composite
def layouts(draw):
    num_shards = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    shard_lengths = [rng.integers(1, 400, int(rng.integers(0, 60))) for _ in range(num_shards)]
    groups = rng.integers(0, draw(st.integers(1, 3)), num_shards)
    config = BatchingConfig(
        budget=float(draw(st.sampled_from([400, 1_000, 3_000]))),
        buffer_size=draw(st.integers(1, 80)),
        seed=draw(st.integers(0, 3)),
        batch_by="dataset",
    )
    world, workers = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    return shard_lengths, groups, config, world, workers, draw(st.sampled_from(["split", "drop", "pad"]))


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(0, 2))
def test_rank_local_plans_equal_the_global_plan_and_never_mix_datasets(case, epoch):
    shard_lengths, groups, config, world, workers, even = case
    try:
        oracle = make_epoch_plan(Lengths.of(shard_lengths, groups), config, epoch, Layout(world, workers, even))
    except ValueError:
        return  # a rank without data cannot pad (tested in test_plan)
    shard_of = np.repeat(np.arange(len(shard_lengths)), [len(x) for x in shard_lengths])
    for slot in oracle.slots:
        assert all(len(set(groups[shard_of[slot.gids[b]]].tolist())) <= 1 for b in slot.batches)
    for rank in range(world):
        lengths = Lengths.of(shard_lengths, groups)

        def gather(mine):
            return [
                [
                    (s := RankSummary.of(rank_raw_slots(lengths, config, epoch, r, Layout(world, workers)))).batches,
                    s.spare,
                ]
                for r in range(world)
            ]

        local = plan_rank_local(lengths, config, epoch, rank, Layout(world, workers, even), gather)
        want = RankSchedule.of(oracle, rank)
        assert (local.steps, local.start, local.adjust) == (want.steps, want.start, want.adjust)
        for w, s in enumerate(oracle.rank_slots(rank)):  # what each worker does with its own slot
            own = plan_slots(lengths, world * workers, config.seed, epoch, config.shuffle, slots=range(s, s + 1))[s]
            raw = plan_slot(own, lengths, lengths.offsets, config, epoch, s)
            got = apply_adjust(
                raw, local.adjust[w], config.seed, epoch, s, lengths[raw.gids], config.cost, config.balance
            )
            assert [raw.gids[b].tolist() for b in got.batches] == [
                oracle.slots[s].gids[b].tolist() for b in oracle.slots[s].batches
            ]


# ---- the loader on real shards ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
    """Three real audio datasets (one per language) in shards of 7 samples."""
    root = tmp_path_factory.mktemp("batchby")
    return {
        name: audio_dataset(root / name, n, 20 + i, SR, max_count=7, shuffle=True, seed=i)
        for i, (name, n) in enumerate(SIZES.items())
    }


def per_dataset(batches) -> collections.Counter:
    return collections.Counter(d for b in batches for d in b["dataset"])


@pytest.mark.parametrize("workers", [0, 2])
def test_every_batch_from_one_dataset_with_exact_counts_and_len(datasets, workers):
    loader = StreamBatchLoader(
        datasets, weights=WEIGHTS, budget=BUDGET, batch_by="dataset", num_workers=workers, buffer_size=16
    )
    for epoch in range(2):
        loader.set_epoch(epoch)
        steps = len(loader)
        out = list(loader)
        assert len(out) == steps
        assert all(len(set(b["dataset"])) == 1 for b in out)
        assert dict(per_dataset(out)) == {n: round(WEIGHTS[n] * SIZES[n]) for n in SIZES}
        for b in out:
            assert b["audio"].shape[0] * int(b["lengths"].max()) <= BUDGET


def test_resume_mid_epoch_yields_the_remaining_batches_exactly(datasets):
    def make() -> StreamBatchLoader:
        return StreamBatchLoader(
            datasets, weights=WEIGHTS, budget=BUDGET, batch_by="dataset", num_workers=2, buffer_size=16, seed=5
        )

    full = [(b["keys"], b["dataset"]) for b in make()]
    first = make()
    it = iter(first)
    head = [next(it) for _ in range(4)]
    state = first.state_dict()
    del it
    again = make()
    again.load_state_dict(state)
    assert (len(again), again.remaining) == (len(full), len(full) - 4)
    rest = [(b["keys"], b["dataset"]) for b in again]
    assert [(b["keys"], b["dataset"]) for b in head] + rest == full


def test_batch_by_needs_a_mixture(datasets):
    with pytest.raises(ValueError, match="batch_by='dataset' keeps every batch within one dataset of a mixture"):
        StreamBatchLoader(datasets["en"], budget=BUDGET, batch_by="dataset")


def test_without_batch_by_batches_mix_datasets(datasets):
    """The check above can fail: without batch_by some batches hold samples of several datasets."""
    loader = StreamBatchLoader(datasets, weights=WEIGHTS, budget=BUDGET, buffer_size=16)
    assert any(len(set(b["dataset"])) > 1 for b in loader)
