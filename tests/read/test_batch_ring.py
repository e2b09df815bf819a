"""Workers make batches in reused shared-memory buffers (read/ring.py): a batch the training loop still holds,
or any view of it, is never written over, however long it is kept; stopping a pass early loses no buffer."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from conftest import audio_dataset

from streambatch import StreamBatchLoader

BUDGET = 16_000 * 3  # 3 s of 16 kHz audio: ~40 batches from 120 clips


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return audio_dataset(tmp_path_factory.mktemp("ring"), 120, corpus_seed=5, max_count=20)


def _rows(batches) -> dict[str, torch.Tensor]:
    """Each clip's audio (a copy), from batches made in the main process."""
    return {key: b["audio"][i, : int(b["lengths"][i])].clone() for b in batches for i, key in enumerate(b["keys"])}


def _check(batch, reference) -> None:
    """Every row of the batch is its clip's audio, then zeros, and the mask marks exactly the zeros."""
    width = batch["audio"].shape[1]
    for i, key in enumerate(batch["keys"]):
        clip, n = reference[key], int(batch["lengths"][i])
        assert n == len(clip) and torch.equal(batch["audio"][i, :n], clip), key
        assert not batch["audio"][i, n:].any(), key
        assert torch.equal(batch["padding_mask"][i], torch.arange(width) >= n), key


@pytest.mark.parametrize(
    "kw", [dict(), dict(micro_batches=2), dict(persistent_workers=True)], ids=["plain", "micro-batches", "persistent"]
)
def test_batches_the_loop_keeps_are_never_written_over(ds, kw):
    # the same planned batches, made in the main process: what every batch must still hold at the end
    reference = _rows(StreamBatchLoader(ds, budget=BUDGET, seed=1, num_workers=0))
    loader = StreamBatchLoader(ds, budget=BUDGET, seed=1, num_workers=2, **kw)
    kept, views, seen, ptrs = [], [], 0, set()
    for epoch in range(2):
        loader.set_epoch(0)  # the same batches again: the second pass runs on buffers the first one left held
        keys = set()
        for j, batch in enumerate(loader):
            _check(batch, reference)
            keys.update(batch["keys"])
            ptrs.add(batch["audio"].data_ptr())
            seen += 1
            if j % 4 == 0:
                kept.append(batch)  # a whole batch, kept for logging
            elif j % 4 == 1:
                views.append((batch["keys"][0], batch["audio"][0, :50]))  # a view of one row
        assert keys == set(reference)
    assert len(ptrs) < seen  # the buffers were reused, so the promise below was put to the test
    for batch in kept:
        _check(batch, reference)
    for key, view in views:
        assert torch.equal(view, reference[key][:50])


def test_a_pass_stopped_early_leaves_no_buffer_held(ds):
    loader = StreamBatchLoader(ds, budget=BUDGET, seed=1, num_workers=2)
    for j, batch in enumerate(loader):
        if j == 2:
            break
    held = batch  # still held by the loop: its buffer stays out of reach of the next pass
    reference = _rows(StreamBatchLoader(ds, budget=BUDGET, seed=1, num_workers=0))
    for batch in loader:  # a new pass: the buffers filled for batches that never arrived are free again
        _check(batch, reference)
    _check(held, reference)
    del batch, held
    assert int(loader._ring.flags.sum()) == 0


def _resident(ptr: int) -> int:
    """Bytes of the mapping holding address ``ptr`` resident in this process (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {ptr:#x}")


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/smaps; the pages are dropped on Linux"
)
def test_the_main_process_keeps_only_the_batches_it_holds_resident(ds):
    # a loop that reads every batch whole, as a training step does, and keeps none: the ring's buffers are
    # resident in the workers that fill them, and in the main process only while a batch is held, so the
    # resident sets of the processes (what top and RSS-summing job accounting add up) count the ring once
    loader = StreamBatchLoader(ds, budget=BUDGET, seed=1, num_workers=2)
    reference = _rows(StreamBatchLoader(ds, budget=BUDGET, seed=1, num_workers=0))
    most = 0
    for batch in loader:
        _check(batch, reference)  # reads the audio and the mask of every row
        most = max(most, _resident(loader._ring.data.data_ptr()))
    ring = loader._ring
    assert ring.num_workers * ring.slots >= 6  # more buffers than a loop holds at once, so the promise is tested
    assert most <= 2 * ring.slot_bytes  # the batch in hand, and the one before it until its name is rebound
    del batch
    gc.collect()
    assert _resident(ring.data.data_ptr()) == 0
