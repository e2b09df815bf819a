"""Local shards read by position (the index's byte spans) give exactly the batches a stream gives."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import audio_dataset

from streambatch import StreamBatchLoader

SR = 8000
BUDGET = 13 * SR  # the longest synthetic clip is 12 s: every sample fits


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("direct_ds")
    return audio_dataset(root, 120, 3, SR, max_count=20, shuffle=True, seed=4)


def _batches(ds, **kw):
    return [
        (b["keys"], b["audio"], b["lengths"], b["text"]) for b in StreamBatchLoader(ds, budget=BUDGET, seed=9, **kw)
    ]


def _same(a, b):
    assert [x[0] for x in a] == [x[0] for x in b]
    for (_, audio_a, len_a, text_a), (_, audio_b, len_b, text_b) in zip(a, b):
        assert torch.equal(audio_a, audio_b) and torch.equal(len_a, len_b) and text_a == text_b


@pytest.mark.parametrize("kw", [{}, {"num_workers": 2}, {"hardest_first": True, "pad_to_multiple_of": 320}])
def test_read_by_position_gives_the_streamed_batches(ds, kw):
    direct = _batches(ds, **kw)
    streamed = _batches(ds, read_by_position=False, **kw)  # every shard streamed through the tar parser
    _same(direct, streamed)
    assert sum(len(k) for k, *_ in direct) == 120


def test_resume_reads_by_position_too(ds):
    full = _batches(ds)
    loader = StreamBatchLoader(ds, budget=BUDGET, seed=9)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    again = StreamBatchLoader(ds, budget=BUDGET, seed=9)
    again.load_state_dict(state)
    _same([(b["keys"], b["audio"], b["lengths"], b["text"]) for b in again], full[3:])


def test_a_shard_that_changed_after_planning_is_counted_bad(ds, tmp_path):
    import shutil

    copy = str(tmp_path / "ds")
    shutil.copytree(ds, copy)
    loader = StreamBatchLoader(copy, budget=BUDGET, seed=9, max_bad_shards=2)
    planned = len(loader)
    path = os.path.join(copy, "shard-000002.tar")
    with open(path, "r+b") as f:  # a payload byte: same size, another sha256, every header intact
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x55]))
    batches = list(loader)
    assert len(batches) == planned
    assert all(int(b["lengths"].max()) * len(b["keys"]) <= BUDGET for b in batches)
    assert loader.fault_stats()["bad_shard_urls"] == [path]


def test_samples_of_a_shard_found_bad_later_are_not_redrawn():
    """Read by position, a shard's hash may come out wrong after some of its samples were emitted; those must
    leave the re-draw pool (a later lost sample is replaced by a good one), as they do from a stream."""
    import numpy as np

    from streambatch.plan.slot import SlotEpoch
    from streambatch.read.execute import _DirectExecutor

    class Shards:  # two shards of two samples each; shard 0 turns out bad once its samples were emitted
        urls = ["bad.tar", "good.tar"]
        bad: set = set()

        def check_hashes(self):
            pass

        def sample(self, shard, i):
            if shard in self.bad or (shard, i) == (1, 1):  # (1, 1): lost, to be re-drawn
                return None
            return {"__key__": f"k{shard}{i}", "__url__": self.urls[shard]}

    shards = Shards()
    plan = SlotEpoch([], np.arange(4), [np.array([0]), np.array([2]), np.array([3])])
    lengths = np.array([6, 5, 4, 6])  # k00 fits the lost k11's place better than k10
    ex = _DirectExecutor(shards, plan, 0, lengths.astype(float), np.array([0, 2, 4]), None, 8, lengths)
    got = []
    for b in plan.batches:
        ex.gather(b, 0)
        got.append([s["__key__"] for s in ex.form(b)])
        shards.bad = {0}  # the hash of shard 0 came out wrong after its sample k00 was emitted
    assert got == [["k00"], ["k10"], ["k10"]]  # the lost k11 is replaced by k10, never by k00
