"""The default window (``buffer_size`` left out): sized in batches of the mean length, capped by stored bytes."""

from __future__ import annotations

import json

import numpy as np
from conftest import audio_dataset

from streambatch import StreamBatchLoader
from streambatch.plan.batcher import plan_batches, sorted_oracle
from streambatch.plan.buckets import DEFAULT_BUFFER, WINDOW_BATCHES, WINDOW_BYTES
from streambatch.plan.config import BatchingConfig
from streambatch.synthetic import librispeech_like, text_like

TEXT_BUDGET = 16_384


def test_text_packs_within_two_percent_of_a_global_sort_at_the_default_window():
    """What the default is for: a text batch holds hundreds of sequences, and the window holds enough of them."""
    lengths = text_like(200_000, seed=4)
    plan = plan_batches(lengths, TEXT_BUDGET, seed=1)
    assert all(len(b) * lengths[b].max() <= TEXT_BUDGET for b in plan)
    assert np.array_equal(np.sort(np.concatenate(list(plan))), np.arange(len(lengths)))
    assert len(plan) <= 1.02 * len(sorted_oracle(lengths, TEXT_BUDGET))
    # the same text at the old fixed 2,000-sample window: visibly more batches
    assert len(plan_batches(lengths, TEXT_BUDGET, seed=1, buffer_size=DEFAULT_BUFFER)) > 1.05 * len(plan)


def test_window_holds_batches_of_the_mean_length_and_never_fewer_than_the_floor():
    text = text_like(50_000, seed=0)
    per_batch = TEXT_BUDGET // text.mean()
    assert BatchingConfig.make(TEXT_BUDGET, text).buffer_size == int(WINDOW_BATCHES * per_batch)
    speech = librispeech_like(50_000, seed=0)  # ~16 utterances a batch: 64 batches are fewer than the floor
    assert BatchingConfig.make(200 * 16000, speech).buffer_size == DEFAULT_BUFFER
    assert BatchingConfig(budget=TEXT_BUDGET).buffer_size == DEFAULT_BUFFER  # nothing known of the lengths
    assert BatchingConfig.make(TEXT_BUDGET, text, buffer_size=777).buffer_size == 777  # asked for: kept


def test_loader_caps_the_window_by_the_bytes_it_may_hold(tmp_path):
    """A budget of many utterances a batch would ask for a window of many thousand; the loader holds at most
    WINDOW_BYTES of stored samples (from the index's bytes), and the floor where the index does not say them."""
    ds = audio_dataset(tmp_path, 60, corpus_seed=5)
    budget = 20 * 60 * 16000  # 20 minutes of audio a batch
    loader = StreamBatchLoader(ds, budget=budget)
    per_sample = loader.index.total_bytes / loader.index.num_samples
    assert loader.config.buffer_size == max(DEFAULT_BUFFER, int(WINDOW_BYTES / per_sample))
    assert loader.config.buffer_size < BatchingConfig.make(budget, loader.index.lengths).buffer_size
    header = json.loads((tmp_path / "shards" / "index.json").read_text())
    del header["total_bytes"]  # as an index written before the header carried its bytes
    (tmp_path / "shards" / "index.json").write_text(json.dumps(header))
    assert StreamBatchLoader(ds, budget=budget).config.buffer_size == DEFAULT_BUFFER


def test_the_cli_plan_report_uses_the_loaders_window(tmp_path):
    """`shardify inspect --plan` predicts the loader's epoch, so it sizes the window as the loader does (a text
    index of 30,000 lengths: its default window is several times the 2,000 floor, and the plans differ)."""
    from streambatch.cli.inspect import planned_epoch
    from streambatch.format.index import ShardIndex
    from streambatch.format.shards import ShardInfo

    lengths = text_like(30_000, seed=2)
    shards = [
        ShardInfo(f"shard-{i:06d}.tar", 1000, 3 * 1024 * 1000, lengths[i * 1000 : (i + 1) * 1000]) for i in range(30)
    ]
    ShardIndex(shards, unit="tokens", sample_rate=None).save(str(tmp_path / "index.json"))
    index = ShardIndex.load(str(tmp_path))
    loader = StreamBatchLoader(str(tmp_path), budget=TEXT_BUDGET)  # only planned here: no shard is read
    assert loader.config.buffer_size > 4 * DEFAULT_BUFFER
    report = planned_epoch(index, TEXT_BUDGET, 1, 1)  # one rank, one worker: a loader with 0 workers
    assert report["steps"] == len(loader)
    assert report["steps"] != planned_epoch(index, TEXT_BUDGET, 1, 1, buffer_size=DEFAULT_BUFFER)["steps"]
