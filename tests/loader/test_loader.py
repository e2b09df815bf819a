"""StreamBatchLoader end to end over real shards written by `shardify write`."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import audio_dataset, text_dataset

from streambatch import IndexMismatch, ShardIndex, StreamBatchLoader, plan_batches

SR = 8000
BUDGET = 12 * SR  # 12 s of audio per batch


@pytest.fixture(scope="module")
def audio_ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio_ds")
    return audio_dataset(root, 160, 5, SR, max_count=25, shuffle=True, seed=1)


@pytest.fixture(scope="module")
def text_ds(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("text_ds"), 300, 0, with_text=True, max_count=40)


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
        assert torch.equal(b["padding_mask"], torch.arange(T)[None, :] >= b["lengths"][:, None])  # True on padding
        assert len(b["text"]) == B and all(isinstance(t, str) for t in b["text"])


def test_loader_batches_equal_plan_batches(audio_ds):
    """The loader forms exactly the batches plan_batches gives for its stream."""
    ix = ShardIndex.load(audio_ds)
    loader = StreamBatchLoader(audio_ds, budget=BUDGET, buffer_size=40, seed=9, shuffle=False)
    plan = loader.plan()
    (slot,) = plan.slots
    lengths = np.concatenate([ix.shards[p.shard].lengths[p.start : p.stop] for p in slot.pieces])
    expected = plan_batches(lengths, BUDGET, buffer_size=40, shuffle=False, seed=[9, 0, 0])
    got = [b["lengths"].tolist() for b in run(loader)]
    assert got == [lengths[b].tolist() for b in expected]


def test_deterministic_per_epoch_and_epochs_differ(audio_ds):
    a = StreamBatchLoader(audio_ds, budget=BUDGET, buffer_size=50, seed=1)
    b = StreamBatchLoader(audio_ds, budget=BUDGET, buffer_size=50, seed=1, num_workers=0)
    e0 = keys_of(run(a))
    assert [b_["keys"] for b_ in run(b)] == [
        x["keys"] for x in StreamBatchLoader(audio_ds, budget=BUDGET, buffer_size=50, seed=1)
    ]
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


def test_resume_mid_epoch_with_other_batching_options_is_refused(audio_ds):
    """The saved batches-consumed count means something only for the batches those options planned: another
    budget or window mid-epoch would lose or repeat samples, so it is a clear error; between epochs it is fine."""
    kw = dict(budget=BUDGET, buffer_size=50, seed=4)
    first = StreamBatchLoader(audio_ds, **kw)
    it = iter(first)
    next(it), next(it)
    state = json.loads(json.dumps(first.state_dict()))
    del it
    for change in ({"buffer_size": 60}, {"budget": BUDGET * 0.9}):
        with pytest.raises(ValueError, match=f"other batching options: {next(iter(change))}="):
            StreamBatchLoader(audio_ds, **{**kw, **change}).load_state_dict(state)
    done = StreamBatchLoader(audio_ds, **kw)
    for _ in done:
        pass
    end = done.state_dict()  # the end of an epoch: the next starts fresh with whatever options
    other = StreamBatchLoader(audio_ds, **{**kw, "budget": BUDGET * 0.9})
    other.load_state_dict(json.loads(json.dumps(end)))
    assert sum(len(b["keys"]) for b in other) == other.index.num_samples


def _run_ranks(audio_ds, world, kw, state=None, stop=None):
    """Every rank of a layout (explicit rank/world_size, no process group): its keys and its state after
    ``stop`` batches (all of them when None)."""
    keys, states = [], []
    for rank in range(world):
        loader = StreamBatchLoader(audio_ds, rank=rank, world_size=world, **kw)
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))
        it = iter(loader)
        got = [next(it)["keys"] for _ in range(stop)] if stop is not None else [b["keys"] for b in it]
        keys += [k for b in got for k in b]
        states.append(loader.state_dict())
        del it
    return keys, states


def test_resume_chain_on_other_world_sizes_sees_every_sample_once(audio_ds):
    """2 ranks stop after 2 batches, 3 ranks resume and stop after 1 more, 1 rank finishes the epoch: every
    sample once, and the checkpoint stays small (layouts and a few integers per slot, not per-sample masks)."""
    kw = dict(budget=BUDGET, buffer_size=30, seed=2, num_workers=2)
    n = ShardIndex.load(audio_ds).num_samples
    first, states = _run_ranks(audio_ds, 2, kw, stop=2)
    assert states[0]["steps"] and states[0]["batches_consumed"] == 2
    second, states = _run_ranks(audio_ds, 3, kw, state=states[0], stop=1)
    assert len(states[0]["earlier_layouts"]) == 1 and states[0]["excluded"] is None
    assert len(json.dumps(states[0])) < 1_000 + 40 * (2 * 2 + 3 * 2)  # the equalisation: 7 integers a slot
    assert len(states[0]["earlier_layouts"][0]["equalised"]) == 2 and len(states[0]["equalised"]) == 3
    third, states = _run_ranks(audio_ds, 1, kw, state=states[0])
    seen = first + second + third
    assert len(seen) == len(set(seen)) == n
    assert states[0]["epoch"] == 1 and states[0]["earlier_layouts"] == []


def test_a_state_saved_with_a_consumed_mask_still_resumes(audio_ds):
    """States written before the layouts were saved carry a mask of consumed samples and no step count."""
    from streambatch.loader.state import pack_mask

    kw = dict(budget=BUDGET, buffer_size=30, seed=2)
    index = ShardIndex.load(audio_ds)
    loader = StreamBatchLoader(audio_ds, **kw)
    batches = [b["keys"] for b in loader]
    slot = loader.plan(0).slots[0]  # one rank, one worker: the batches in plan order
    mask = np.zeros(index.num_samples, dtype=bool)
    for b in slot.batches[:3]:
        mask[slot.gids[b]] = True
    done = [k for b in batches[:3] for k in b]
    order = [k for b in batches for k in b]
    old = {
        "epoch": 0,
        "batches_consumed": 0,
        "seed": 2,
        "world_size": 1,
        "num_workers": 1,
        "even_batches": "split",
        "num_samples": index.num_samples,
        "excluded": pack_mask(mask),
    }
    rest, _ = _run_ranks(audio_ds, 2, kw, state=old)
    assert int(mask.sum()) == len(done)
    assert sorted(rest + done) == sorted(order)


def test_text_input_ids_padded(text_ds):
    loader = StreamBatchLoader(text_ds, budget=1000, pad_to_multiple_of=8, seed=0)
    total = 0
    for b in loader:
        ids = b["input_ids"]
        assert ids.dtype == torch.int64 and ids.shape[1] % 8 == 0
        assert ids.numel() <= 1000
        assert torch.equal(b["padding_mask"], torch.arange(ids.shape[1])[None, :] >= b["lengths"][:, None])
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
    feats = next(
        iter(StreamBatchLoader(audio_ds, budget=BUDGET, decode=lambda s: np.ones((s["json"]["length"] // 80, 4))))
    )
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
    with pytest.raises(IndexMismatch, match="does not match"):
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
        loader = StreamBatchLoader(
            urls, budget=BUDGET, rank=rank, world_size=2, batches_per_epoch=7, num_workers=2, buffer_size=30
        )
        assert len(loader) == 7
        batches = run(loader)
        assert len(batches) == 7  # every rank steps exactly batches_per_epoch times
        assert all(b["audio"].numel() <= BUDGET for b in batches)
        per_rank.append(keys_of(batches))
    # a nominal epoch: the ranks start on different shards (exactly-once needs an index)
    assert per_rank[0][:3] != per_rank[1][:3]


# ---- budgets and epochs that would give no batches (issue 14, item 4) --------------------------------
def test_budget_smaller_than_every_sample_names_the_shortest(audio_ds):
    from streambatch.errors import BudgetError

    shortest = int(ShardIndex.load(audio_ds).lengths.min())
    with pytest.raises(BudgetError) as e:
        StreamBatchLoader(audio_ds, budget=shortest - 1)
    msg = str(e.value)
    assert f"budget {shortest - 1:,} samples" in msg and f"shortest sample, {shortest:,} samples" in msg
    assert f"({shortest / SR:.3g} s)" in msg and audio_ds in msg and "\n" not in msg
    assert len(StreamBatchLoader(audio_ds, budget=shortest)) > 0  # one that fits alone is accepted


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), 0, -5, "nan", "-1s", "lots", [1]])
def test_budget_not_a_positive_finite_number_is_an_error(audio_ds, budget):
    from streambatch.errors import BudgetError

    with pytest.raises(BudgetError, match="budget") as e:
        StreamBatchLoader(audio_ds, budget=budget)
    assert repr(budget) in str(e.value) or str(budget) in str(e.value)


def test_budget_as_a_duration_string_matches_the_cli(audio_ds, text_ds):
    from streambatch.errors import BudgetError

    want = [b["keys"] for b in StreamBatchLoader(audio_ds, budget=BUDGET, seed=2)]
    for text in ("12s", "12 s", "12000ms", "0.2min", f"{BUDGET} samples", str(BUDGET)):
        loader = StreamBatchLoader(audio_ds, budget=text, seed=2)
        assert loader.config.budget == BUDGET
        assert [b["keys"] for b in loader] == want
    with pytest.raises(BudgetError, match="seconds only make sense for audio, this dataset's lengths are in tokens"):
        StreamBatchLoader(text_ds, budget="60s")
    with pytest.raises(BudgetError, match="'12 tokens': 'tokens' is not this dataset's unit, samples"):
        StreamBatchLoader(audio_ds, budget="12 tokens")


def test_max_length_filtering_everything_is_an_error_not_an_empty_epoch(audio_ds):
    from streambatch.errors import EmptyEpochError

    loader = StreamBatchLoader(audio_ds, budget=BUDGET, max_length=100)
    with pytest.raises(
        EmptyEpochError,
        match=r"epoch 0 has no batches: of the 160 samples, 160 skipped \(lengths .*max_length=100 samples",
    ):
        len(loader)
    with pytest.raises(EmptyEpochError):
        next(iter(loader))


def test_drop_last_dropping_everything_is_an_error(audio_ds):
    from streambatch.errors import EmptyEpochError

    loader = StreamBatchLoader(audio_ds, budget=BUDGET * 1000, drop_last=True, buffer_size=500)
    with pytest.raises(EmptyEpochError, match="of the 160 samples, 160 dropped by drop_last=True"):
        len(loader)


def test_without_index_an_epoch_of_skipped_samples_is_an_error(audio_ds):
    from streambatch.errors import EmptyEpochError

    urls = sorted(os.path.join(audio_ds, f) for f in os.listdir(audio_ds) if f.endswith(".tar"))
    loader = StreamBatchLoader(urls, budget=10)  # no index: the lengths are known only once read
    with pytest.raises(EmptyEpochError, match=f"epoch 0 yielded no batches from {len(urls)} shards"):
        run(loader)
    # a nominal epoch cycles the shards until it has its batches: a pass that accepts nothing must end it
    nominal = StreamBatchLoader(urls, budget=10, batches_per_epoch=3, num_workers=2)
    with pytest.raises(EmptyEpochError, match="a whole pass over its .* shards gave no sample the batcher accepts"):
        run(nominal)
    with pytest.raises(ValueError, match="a duration needs the dataset's unit"):
        StreamBatchLoader(urls, budget="12s")


# ---- len(), consumed and remaining after a resume (issue 14, item 7) -----------------------------------
def _stopped_after(audio_ds, k, kw, **layout):
    loader = StreamBatchLoader(audio_ds, **kw, **layout)
    it = iter(loader)
    for _ in range(k):
        next(it)
    assert (loader.consumed, loader.remaining) == (k, len(loader) - k)
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    return state


@pytest.mark.parametrize("layout", [dict(num_workers=0), dict(num_workers=2)], ids=["same", "other-workers"])
def test_len_after_a_resume_counts_the_whole_epoch(audio_ds, layout):
    """Resumed on the same or on another layout, len() is the epoch's steps as this run counts them (consumed
    included) and ``remaining`` the batches still to come, which is what the next pass yields."""
    kw = dict(budget=BUDGET, buffer_size=50, seed=4)
    full = len(StreamBatchLoader(audio_ds, **kw))
    state = _stopped_after(audio_ds, 5, kw, num_workers=0)
    resumed = StreamBatchLoader(audio_ds, **kw, **layout)
    resumed.load_state_dict(state)
    assert resumed.consumed == 5
    remaining = resumed.remaining
    assert len(resumed) == 5 + remaining
    if layout["num_workers"] == 0:
        assert len(resumed) == full
    steps = 0
    for _ in resumed:
        steps += 1
        assert resumed.consumed == 5 + steps and resumed.remaining == remaining - steps
    assert steps == remaining
    fresh = StreamBatchLoader(audio_ds, **kw, **layout)
    fresh.set_epoch(1)
    assert resumed.epoch == 1 and resumed.consumed == 0 and resumed.remaining == len(resumed) == len(fresh)


def test_len_after_resumes_on_other_world_sizes_adds_every_earlier_layout(audio_ds):
    """2 ranks stop after 2 batches, 3 ranks resume and stop after 1 more, 1 rank resumes: every rank's len()
    counts the 2 + 1 batches consumed before it, and yields exactly ``remaining``."""
    kw = dict(budget=BUDGET, buffer_size=30, seed=2, num_workers=2)
    _, states = _run_ranks(audio_ds, 2, kw, stop=2)
    for rank in range(3):
        loader = StreamBatchLoader(audio_ds, rank=rank, world_size=3, **kw)
        loader.load_state_dict(states[0])
        assert loader.consumed == 2 and len(loader) == 2 + loader.remaining
    _, states = _run_ranks(audio_ds, 3, kw, state=states[0], stop=1)
    last = StreamBatchLoader(audio_ds, **kw)
    last.load_state_dict(states[0])
    remaining = last.remaining
    assert last.consumed == 3 and len(last) == 3 + remaining
    assert len(run(last)) == remaining


def test_too_few_samples_for_every_rank_is_an_error(audio_ds):
    """Three samples kept (max_length), four ranks: a rank without a batch means no rank steps at all."""
    from streambatch.errors import EmptyEpochError

    cap = float(np.sort(ShardIndex.load(audio_ds).lengths)[2])
    for even in ("split", "drop"):
        loader = StreamBatchLoader(audio_ds, budget=BUDGET, max_length=cap, rank=0, world_size=4, even_batches=even)
        with pytest.raises(
            EmptyEpochError,
            match=f"157 skipped .*; the rest too few for every rank to get a batch "
            rf"\(4 × 1 \(rank, worker\) slots, even_batches='{even}'\).* or use fewer ranks",
        ):
            len(loader)
    assert len(StreamBatchLoader(audio_ds, budget=BUDGET, max_length=cap)) == 1  # one rank: the three samples batch


def test_a_resume_from_a_state_without_equalisation_yields_the_same_batches(audio_ds):
    """A state of this version holds every rank's equalisation and a resume on another layout marks what the
    old ranks consumed from the batches they yielded; a state of the previous version holds none and re-plans
    them in full: both give every new rank the same batches."""
    kw = dict(budget=BUDGET, buffer_size=30, seed=2, num_workers=2, hardest_first=True)
    _, states = _run_ranks(audio_ds, 2, kw, stop=3)
    older = {k: v for k, v in states[0].items() if k != "equalised"}
    for rank in range(3):
        new, old = (StreamBatchLoader(audio_ds, rank=rank, world_size=3, **kw) for _ in range(2))
        new.load_state_dict(json.loads(json.dumps(states[0])))
        old.load_state_dict(json.loads(json.dumps(older)))
        assert new._resumed.layouts[0].equalised and not old._resumed.layouts[0].equalised
        assert [b["keys"] for b in new] == [b["keys"] for b in old]
