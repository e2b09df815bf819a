"""Two-length budgets: every batch holds ``n × max_len ≤ budget`` and ``n × max_output_len ≤ output_budget``,
planned and online alike, and the loader keeps both on real shards written with ``--output-length``."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streambatch import OptionError, StreamBatchLoader, plan_batches
from streambatch.plan.batcher import BucketBatcher
from streambatch.plan.config import BatchingConfig
from streambatch.synthetic import write_audio_corpus
from streambatch.write.writer import write_shards

SR = 8000


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3000),
    st.integers(0, 10_000),
    st.integers(1, 400),
    st.sampled_from([None, 3, 8]),
    st.sampled_from([1, 4]),
    st.sampled_from([None, 4]),
)
def test_both_budgets_hold_and_online_equals_plan(n, seed, buffer, max_bs, multiple, buckets):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(100, 20_000, n)
    outputs = np.maximum(1, (lengths / 100 * rng.lognormal(0, 0.5, n)).astype(int))
    budget, out_budget = 60_000.0, float(rng.integers(300, 3_000))
    multiple = min(multiple, max_bs or multiple)  # a multiple above the cap is refused (it could never hold)
    opts = dict(
        buffer_size=buffer, max_batch_size=max_bs, batch_size_multiple_of=multiple, num_buckets=buckets, seed=seed
    )
    plan = plan_batches(lengths, budget, output_lengths=outputs, output_budget=out_budget, **opts)
    for b in plan:
        assert len(b) * lengths[b].max() <= budget
        assert len(b) * outputs[b].max() <= out_budget
        assert max_bs is None or len(b) <= max_bs
    seen = np.concatenate([*plan, plan.skipped]) if len(plan) else plan.skipped
    assert sorted(seen.tolist()) == list(range(n))
    assert all(outputs[i] > out_budget for i in plan.skipped)  # only samples no batch can hold are left out
    config = BatchingConfig.make(budget, lengths, output_budget=out_budget, **opts)
    online = BucketBatcher(config, stream_length=n)
    got = [b for i in range(n) for b in online.push(i, lengths[i], outputs[i])] + online.flush()
    assert [b.tolist() for b in got] == [b.tolist() for b in plan]


def test_an_output_budget_costs_batches_only_where_it_binds():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1_600, 320_000, 20_000)
    outputs = np.maximum(1, (lengths / 16_000 * 15 * rng.lognormal(0, 0.3, 20_000)).astype(int))
    alone = plan_batches(lengths, 3_200_000, seed=1)
    loose = plan_batches(lengths, 3_200_000, output_lengths=outputs, output_budget=1e9, seed=1)
    # the same batches in size and place (batch-mates are traded only without an output budget: plan/mates.py)
    assert [len(b) for b in loose] == [len(b) for b in alone]
    assert sorted(np.concatenate(loose).tolist()) == sorted(np.concatenate(alone).tolist())
    tight = plan_batches(lengths, 3_200_000, output_lengths=outputs, output_budget=2_500, seed=1)
    assert len(tight) > len(alone)


@pytest.fixture(scope="module")
def transcribed(tmp_path_factory):
    root = tmp_path_factory.mktemp("twolen")
    write_audio_corpus(str(root / "audio"), 80, seed=6, sample_rate=SR)
    write_shards(str(root / "audio"), str(root / "ds"), max_count=15, output_length="chars", progress=False)
    return str(root / "ds")


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_keeps_both_budgets_on_real_shards(transcribed, workers):
    budget, out_budget = 8 * SR, 60
    loader = StreamBatchLoader(
        transcribed, budget=budget, output_budget=out_budget, num_workers=workers, buffer_size=20
    )
    steps = len(loader)
    batches = list(loader)
    assert len(batches) == steps
    keys = collections.Counter(k for b in batches for k in b["keys"])
    skipped = loader.plan(0).skipped_samples
    assert max(keys.values()) == 1 and len(keys) + skipped == 80
    for b in batches:
        n = len(b["keys"])
        assert n * int(b["lengths"].max()) <= budget
        assert n * max(b["output_length"]) <= out_budget


def test_output_budget_needs_output_lengths(tmp_path):
    write_audio_corpus(str(tmp_path / "audio"), 10, seed=1, sample_rate=SR)
    write_shards(str(tmp_path / "audio"), str(tmp_path / "ds"), progress=False)
    with pytest.raises(OptionError, match="output_budget=60 needs each sample's output length.*--output-length"):
        StreamBatchLoader(str(tmp_path / "ds"), budget=8 * SR, output_budget=60)  # where it is built, not at len()
