"""StreamBatchLoader end to end over real shards written by `shardify write`."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from streambatch import ShardIndex, StreamBatchLoader, plan_batches
from streambatch.synthetic import write_audio_corpus
from streambatch.write.writer import write_shards

SR = 8000
BUDGET = 12 * SR  # 12 s of audio per batch


@pytest.fixture(scope="module")
def audio_ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio_ds")
    write_audio_corpus(str(root / "audio"), 160, seed=5, sample_rate=SR)
    write_shards(str(root / "audio"), str(root / "shards"), max_count=25, shuffle=True, seed=1, progress=False)
    return str(root / "shards")


@pytest.fixture(scope="module")
def text_ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_ds")
    rng = np.random.default_rng(0)
    with open(root / "text.jsonl", "w") as f:
        for i in range(300):
            ids = rng.integers(1, 1000, size=int(rng.integers(1, 120))).tolist()
            f.write(json.dumps({"id": f"s{i}", "input_ids": ids, "text": " ".join(map(str, ids))}) + "\n")
    write_shards(str(root / "text.jsonl"), str(root / "shards"), max_count=40, progress=False)
    return str(root / "shards")


def run(loader):
    return [b for b in loader]


def keys_of(batches):
    return [k for b in batches for k in b["keys"]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_audio_batches_exactly_once_under_budget(audio_ds, num_workers):
    ix = ShardIndex.load(audio_ds)
    loader = StreamBatchLoader(audio_ds, budget=BUDGET, num_workers=num_workers, buffer_size=50, seed=3)
    n = len(loader)
    batches = run(loader)
    assert len(batches) == n  # len() is exact, known before the epoch
    keys = keys_of(batches)
    assert len(keys) == len(set(keys)) == ix.num_samples
    for b in batches:
        B, T = b["audio"].shape
        assert b["audio"].dtype == torch.float32
        assert B * T <= BUDGET
        assert int(b["lengths"].max()) == T
        assert b["padding_mask"].shape == (B, T)
        assert (b["padding_mask"].sum(1) == T - b["lengths"]).all()
        assert len(b["text"]) == B and all(isinstance(t, str) for t in b["text"])


def test_loader_batches_equal_plan_batches(audio_ds):
    """The loader forms exactly the batches plan_batches gives for its stream."""
    ix = ShardIndex.load(audio_ds)
    loader = StreamBatchLoader(audio_ds, budget=BUDGET, buffer_size=40, seed=9, shuffle=False)
    plan = loader.plan()
    (slot,) = plan.slots
    lengths = np.concatenate([ix.shards[p.shard].lengths[p.start:p.stop] for p in slot.pieces])
    expected = plan_batches(lengths, BUDGET, buffer_size=40, shuffle=False, seed=[9, 0, 0])
    got = [b["lengths"].tolist() for b in run(loader)]
    assert got == [lengths[b].tolist() for b in expected]


def test_deterministic_per_epoch_and_epochs_differ(audio_ds):
    a = StreamBatchLoader(audio_ds, budget=BUDGET, buffer_size=50, seed=1)
    b = StreamBatchLoader(audio_ds, budget=BUDGET, buffer_size=50, seed=1, num_workers=0)
    e0 = keys_of(run(a))
    assert [b_["keys"] for b_ in run(b)] == [x["keys"] for x in StreamBatchLoader(audio_ds, budget=BUDGET, buffer_size=50, seed=1)]
    e1 = keys_of(run(a))  # the loader moved to epoch 1 by itself
    assert a.epoch == 2
    assert e0 != e1 and sorted(e0) == sorted(e1)
    c = StreamBatchLoader(audio_ds, budget=BUDGET, buffer_size=50, seed=1)
    c.set_epoch(1)
    assert keys_of(run(c)) == e1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_gives_the_remaining_batches(audio_ds, num_workers):
    kw = dict(budget=BUDGET, buffer_size=50, seed=4, num_workers=num_workers)
    full = [b["keys"] for b in StreamBatchLoader(audio_ds, **kw)]
    first = StreamBatchLoader(audio_ds, **kw)
    it = iter(first)
    head = [next(it)["keys"] for _ in range(5)]
    state = first.state_dict()
    del it
    assert state["batches_consumed"] == 5
    resumed = StreamBatchLoader(audio_ds, **kw)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    assert len(resumed) == len(full)
    tail = [b["keys"] for b in resumed]
    assert head + tail == full


def test_text_input_ids_padded(text_ds):
    loader = StreamBatchLoader(text_ds, budget=1000, pad_to_multiple_of=8, seed=0)
    total = 0
    for b in loader:
        ids = b["input_ids"]
        assert ids.dtype == torch.int64 and ids.shape[1] % 8 == 0
        assert ids.numel() <= 1000
        for row, n, text in zip(ids, b["lengths"].tolist(), b["text"]):
            assert row[:n].tolist() == [int(x) for x in text.split()]
            assert (row[n:] == 0).all()
        total += len(b["keys"])
    assert total == 300


def test_without_index_lengths_come_from_json(audio_ds):
    urls = sorted(os.path.join(audio_ds, f) for f in os.listdir(audio_ds) if f.endswith(".tar"))
    pattern = os.path.join(audio_ds, "shard-{000000..%06d}.tar" % (len(urls) - 1))
    loader = StreamBatchLoader(pattern, budget=BUDGET, buffer_size=50, num_workers=2)
    with pytest.raises(TypeError, match="index"):
        len(loader)
    batches = run(loader)
    keys = keys_of(batches)
    assert len(keys) == len(set(keys)) == ShardIndex.load(audio_ds).num_samples
    assert all(b["audio"].numel() <= BUDGET for b in batches)
    # a list of URLs works the same
    assert sorted(keys_of(run(StreamBatchLoader(urls, budget=BUDGET, buffer_size=50)))) == sorted(keys)


def test_decode_none_and_callable(audio_ds):
    raw = next(iter(StreamBatchLoader(audio_ds, budget=BUDGET, decode="none")))
    assert "audio" not in raw and isinstance(raw["samples"][0]["flac"], bytes)
    feats = next(iter(StreamBatchLoader(audio_ds, budget=BUDGET, decode=lambda s: np.ones((s["json"]["length"] // 80, 4)))))
    assert feats["inputs"].shape[2] == 4 and feats["inputs"].shape[0] == len(feats["keys"])


def test_overlong_samples_skipped_and_counted(audio_ds):
    ix = ShardIndex.load(audio_ds)
    cap = float(np.percentile(ix.lengths, 90))
    loader = StreamBatchLoader(audio_ds, budget=BUDGET, max_length=cap)
    keys = keys_of(run(loader))
    assert len(keys) == int((ix.lengths <= cap).sum())
    assert loader.plan(0).skipped_samples == int((ix.lengths > cap).sum())


def test_stale_index_is_a_clear_error(audio_ds, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(audio_ds, copy)
    ix = ShardIndex.load(str(copy))
    ix.shards[0].lengths = ix.shards[0].lengths + 1
    ix.save(str(copy))
    with pytest.raises(RuntimeError, match="does not match"):
        run(StreamBatchLoader(str(copy), budget=BUDGET * 2))


def test_missing_index_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no index.json"):
        StreamBatchLoader(str(tmp_path), budget=100)
    with pytest.raises(ValueError, match="budget"):
        StreamBatchLoader(str(tmp_path), budget=0)


def test_without_index_ddp_needs_a_nominal_epoch(audio_ds):
    urls = sorted(os.path.join(audio_ds, f) for f in os.listdir(audio_ds) if f.endswith(".tar"))
    with pytest.raises(ValueError, match="batches_per_epoch"):
        StreamBatchLoader(urls, budget=BUDGET, rank=0, world_size=2)
    per_rank = []
    for rank in (0, 1):
        loader = StreamBatchLoader(urls, budget=BUDGET, rank=rank, world_size=2, batches_per_epoch=7,
                                   num_workers=2, buffer_size=30)
        assert len(loader) == 7
        batches = run(loader)
        assert len(batches) == 7  # every rank steps exactly batches_per_epoch times
        assert all(b["audio"].numel() <= BUDGET for b in batches)
        per_rank.append(keys_of(batches))
    # a nominal epoch: the ranks start on different shards (exactly-once needs an index)
    assert per_rank[0][:3] != per_rank[1][:3]
