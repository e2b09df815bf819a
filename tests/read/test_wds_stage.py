"""streambatch.wds.BudgetBatches, the budget-batching webdataset stage: every batch holds the budget, every sample
that can fit leaves exactly once per pass and one that cannot is skipped and counted (or raises in strict mode), as
property tests over random streams; then over real shards through a real ``wds.WebDataset`` pipeline with two
DataLoader workers (``split_by_worker``) and two ranks (``split_by_node``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from conftest import audio_dataset
from hypothesis import given, settings
from hypothesis import strategies as st

from streambatch.errors import OptionError, SampleError, SampleTooLongError
from streambatch.plan.cost import resolve_cost
from streambatch.wds import BudgetBatches, collate


def _samples(lengths: list[float], raw: bool) -> list[dict]:
    """Samples as webdataset yields them: a ``.json`` member with the length, raw bytes or decoded."""
    out = []
    for i, n in enumerate(lengths):
        meta = {"length": n}
        out.append({"__key__": f"k{i:05d}", "json": json.dumps(meta).encode() if raw else meta})
    return out


def _meta(sample: dict) -> dict:
    return sample["json"] if isinstance(sample["json"], dict) else json.loads(sample["json"])


@st.composite
def cases(draw):
    n = draw(st.integers(0, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    lengths = np.round(rng.lognormal(draw(st.floats(1, 6)), draw(st.floats(0.1, 1.5)), n)) + 1
    budget = float(draw(st.sampled_from([1, 2, 8, 40])) * np.median(lengths) if n else 100)
    options = dict(
        buffer_size=draw(st.integers(1, 120)),
        refill=draw(st.integers(0, 60)),
        max_batch_size=draw(st.sampled_from([None, 1, 3, 16])),
        seed=draw(st.integers(0, 100)),
        cost=draw(st.sampled_from(["padded", "quadratic"])),
    )
    if options["cost"] == "quadratic":
        options["quadratic_factor"] = float(draw(st.sampled_from([10, 500])))
    return lengths.tolist(), budget, options, draw(st.booleans())


@settings(max_examples=200, deadline=None)
@given(cases())
def test_every_batch_holds_the_budget_and_every_sample_leaves_once(case):
    lengths, budget, options, raw = case
    stage = BudgetBatches(budget, **options)
    cost, _ = resolve_cost(options["cost"], options.get("quadratic_factor"))
    fits = [float(cost.cost(1, n)) <= budget for n in lengths]
    for epoch in range(2):  # a second pass, as webdataset's repeat() or the next epoch runs it
        stage.set_epoch(epoch)
        seen: Counter[str] = Counter()
        for batch in stage(iter(_samples(lengths, raw))):
            longest = max(_meta(s)["length"] for s in batch)
            assert batch and float(cost.cost(len(batch), longest)) <= budget
            assert options["max_batch_size"] is None or len(batch) <= options["max_batch_size"]
            seen.update(s["__key__"] for s in batch)
        expected = {f"k{i:05d}" for i, ok in enumerate(fits) if ok}
        assert set(seen) == expected and all(c == 1 for c in seen.values())
    assert stage.skipped == 2 * fits.count(False)  # counted, never emitted (as the loader does)


def test_a_sample_over_the_budget_alone_is_skipped_or_raises_in_strict_mode():
    samples = _samples([5, 50, 5, 7], raw=False)
    stage = BudgetBatches(20)
    keys = [s["__key__"] for b in stage(iter(samples)) for s in b]
    assert sorted(keys) == ["k00000", "k00002", "k00003"] and stage.skipped == 1
    with pytest.raises(SampleTooLongError, match="50"):
        list(BudgetBatches(20, strict=True)(iter(samples)))


def test_a_user_length_function_and_clear_errors():
    samples = [{"__key__": str(i), "tokens": list(range(n))} for i, n in enumerate([3, 9, 4, 12, 1])]
    batches = list(BudgetBatches(12, length=lambda s: len(s["tokens"]))(iter(samples)))
    assert sorted(s["__key__"] for b in batches for s in b) == ["0", "1", "2", "3", "4"]
    assert all(len(b) * max(len(s["tokens"]) for s in b) <= 12 for b in batches)
    with pytest.raises(SampleError, match="has no 'length' in its .json"):
        list(BudgetBatches(12)(iter(samples)))
    with pytest.raises(SampleError, match="not JSON"):
        list(BudgetBatches(12)(iter([{"__key__": "x", "json": b"{oops"}])))
    for bad in (dict(batch_order="ascending"), dict(batch_by="dataset"), dict(num_buckets=4)):
        with pytest.raises(OptionError):
            BudgetBatches(12, **bad)


@pytest.mark.parametrize("length", ["7", float("nan"), -3, float("inf"), None, True, [4]])
def test_a_json_length_that_is_not_one_names_the_sample(length):
    """A shard is data: a ``.json`` length the budget cannot be kept by (text, NaN, negative, infinite) is one
    error naming the sample and the value, not a numpy error or a batch cut by NaN."""
    samples = [{"__key__": "good", "json": {"length": 3}}, {"__key__": "bad", "json": {"length": length}}]
    with pytest.raises(SampleError, match=r"sample 'bad': its .json length .* is not a length"):
        list(BudgetBatches(12)(iter(samples)))


def _pipeline(shards: str, stage: BudgetBatches, **splitters) -> wds.WebDataset:
    """A plain webdataset pipeline over the shards, the stage composed onto it, batches padded by ``collate``."""
    urls = sorted(str(p) for p in Path(shards).glob("*.tar"))
    return wds.WebDataset(urls, shardshuffle=False, **splitters).decode().compose(stage).map(collate)


def _keys_and_check(dataset: wds.WebDataset, budget: float) -> list[str]:
    """Every key the pipeline yields through a DataLoader with two workers; each padded batch within the budget."""
    keys = []
    for batch in torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2):
        b, t = batch["audio"].shape
        assert b * t <= budget and batch["padding_mask"].shape == (b, t)
        keys += batch["keys"]
    return keys


def test_real_shards_through_webdataset_with_two_workers(tmp_path, monkeypatch):
    shards = audio_dataset(tmp_path, 40, corpus_seed=3, max_count=8)  # 5 shards
    plain = wds.WebDataset(str(Path(shards) / "shard-{000000..000004}.tar"), shardshuffle=False)
    every = sorted(s["__key__"] for s in plain)
    budget = 16000 * 20
    stage = BudgetBatches(budget, buffer_size=12)
    keys = _keys_and_check(_pipeline(shards, stage, workersplitter=wds.split_by_worker), budget)
    assert sorted(keys) == every  # each sample once, across the two workers
    by_rank = []
    for rank in range(2):  # two ranks (as torchrun's variables say), each with two workers: a quarter of the shards
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        pipeline = _pipeline(shards, stage, nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker)
        by_rank.append(_keys_and_check(pipeline, budget))
    assert sorted(by_rank[0] + by_rank[1]) == every and not set(by_rank[0]) & set(by_rank[1])


def test_the_stage_checks_its_own_arguments_where_it_is_built():
    with pytest.raises(OptionError, match="epoch must be at least 0"):
        BudgetBatches(12, epoch=-1)
    with pytest.raises(OptionError, match="length must be a callable"):
        BudgetBatches(12, length="json.length")
    stage = BudgetBatches(12)
    with pytest.raises(OptionError, match="epoch must be a whole number"):
        stage.set_epoch(1.5)


def _soundfile_audio(key: str, data: bytes):
    """A pipeline's own audio decoder, as a webdataset handler: float32 numpy ``[T]`` from any audio member."""
    import io

    import soundfile

    if key.rsplit(".", 1)[-1] not in ("flac", "wav"):
        return None
    audio, _ = soundfile.read(io.BytesIO(data), dtype="float32")
    return audio


def _tensor_audio(key: str, data: bytes):
    """The same, as torch tensors with a (frames, sample rate) pair, as webdataset's ``torch_audio`` returns."""
    import io

    import soundfile

    if key.rsplit(".", 1)[-1] not in ("flac", "wav"):
        return None
    audio, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return torch.from_numpy(audio.T.copy()), rate  # [channels, frames], as torchaudio.load gives


@pytest.mark.parametrize("decoder", [_soundfile_audio, _tensor_audio])
def test_collate_after_a_pipeline_that_decodes_its_own_audio(tmp_path, decoder):
    """A pipeline that decodes audio itself (its own webdataset handler: numpy arrays, or tensors with their rate)
    gets the same padded batch from ``collate`` as one that leaves the bytes to streambatch."""
    shards = audio_dataset(tmp_path, 12, corpus_seed=5, max_count=6)
    urls = sorted(str(p) for p in Path(shards).glob("*.tar"))
    budget = 16000 * 30
    ours = [collate(b) for b in wds.WebDataset(urls, shardshuffle=False).decode().compose(BudgetBatches(budget))]
    decoded = wds.WebDataset(urls, shardshuffle=False).decode(decoder, "torch").compose(BudgetBatches(budget))
    theirs = list(torch.utils.data.DataLoader(decoded.map(collate), batch_size=None, num_workers=1))
    assert [b["keys"] for b in theirs] == [b["keys"] for b in ours] and sum(len(b["keys"]) for b in ours) == 12
    for mine, got in zip(ours, theirs):
        assert got["audio"].dtype == torch.float32 and got["audio"].shape == mine["audio"].shape
        assert torch.equal(got["lengths"], mine["lengths"]) and torch.equal(got["padding_mask"], mine["padding_mask"])
        assert torch.allclose(got["audio"], mine["audio"], atol=1e-6)


def test_collate_resamples_decoded_audio_by_its_own_rate(tmp_path):
    """``sample_rate=`` resamples audio the pipeline decoded (its rate from the pair, or the ``.json``) as it
    resamples the shard's bytes; decoded audio whose rate nobody knows is refused, naming the sample."""
    shards = audio_dataset(tmp_path, 6, corpus_seed=7, max_count=6)
    urls = sorted(str(p) for p in Path(shards).glob("*.tar"))
    raw = list(wds.WebDataset(urls, shardshuffle=False).decode())
    ours = collate(raw, sample_rate=8000)
    for decoder in (_tensor_audio, _soundfile_audio):
        got = collate(list(wds.WebDataset(urls, shardshuffle=False).decode(decoder)), sample_rate=8000)
        assert got["audio"].shape == ours["audio"].shape and torch.equal(got["lengths"], ours["lengths"])
        assert torch.allclose(got["audio"], ours["audio"], atol=1e-4)
    unknown = [{**s, "json": {}} for s in wds.WebDataset(urls, shardshuffle=False).decode(_soundfile_audio)]
    with pytest.raises(SampleError, match="without its sample rate"):
        collate(unknown, sample_rate=8000)
