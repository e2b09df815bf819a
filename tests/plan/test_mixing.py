"""Several datasets in one run: per-epoch counts exactly as the weights say, no replacement across epochs
before a repeat, ``batch["dataset"]``, and every guarantee (equal steps, exact resume on the same and on
another world size) over real shards and real torchrun ranks."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrun_jobs import batches, kill_when_stopped, read_logs, torchrun, wait

from streambatch import EmptyEpochError, StreamBatchLoader
from streambatch.plan.mixing import CyclePermutation, DatasetDraw
from streambatch.synthetic import write_audio_corpus
from streambatch.write.writer import write_shards

SR = 8000
BUDGET = 10 * SR
SIZES = {"big": 60, "mid": 40, "small": 30}
WEIGHTS = {"big": 2.0, "mid": 1.0, "small": 0.3}


def expected_counts(name: str) -> int:
    return round(WEIGHTS[name] * SIZES[name])


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Path:
    """Three real audio datasets and a mixture file naming them with weights (2, 1, 0.3)."""
    root = tmp_path_factory.mktemp("mix")
    for i, (name, n) in enumerate(SIZES.items()):
        write_audio_corpus(str(root / f"{name}-audio"), n, seed=10 + i, sample_rate=SR)
        write_shards(str(root / f"{name}-audio"), str(root / name), max_count=9, shuffle=True, seed=i, progress=False)
    spec = {"datasets": [{"name": n, "path": n, "weight": w} for n, w in WEIGHTS.items()]}
    (root / "mix.json").write_text(json.dumps(spec))
    return root


def epoch_counts(batches_of_epoch) -> collections.Counter:
    """(dataset, key) → times seen, over some batches (dicts with keys and dataset lists)."""
    return collections.Counter((d, k) for b in batches_of_epoch for k, d in zip(b["keys"], b["dataset"]))


def check_weights(counts: collections.Counter) -> None:
    """Each dataset contributes round(w·N) samples: w = 2 every sample exactly twice, w = 1 once, w < 1 distinct."""
    per = collections.Counter()
    for (d, _), c in counts.items():
        per[d] += c
    assert dict(per) == {n: expected_counts(n) for n in SIZES}
    assert {c for (d, _), c in counts.items() if d == "big"} == {2}
    assert len([1 for d, _ in counts if d == "big"]) == SIZES["big"]
    assert {c for (d, _), c in counts.items() if d != "big"} == {1}


def test_each_epoch_takes_exactly_what_the_weights_say(mixture):
    loader = StreamBatchLoader(str(mixture / "mix.json"), budget=BUDGET, num_workers=2, buffer_size=20)
    taken = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        steps = len(loader)
        out = list(loader)
        assert len(out) == steps
        counts = epoch_counts(out)
        check_weights(counts)
        for b in out:
            assert len(b["dataset"]) == b["audio"].shape[0]
        taken.append({k for (d, k) in counts if d == "small"})
    # 9 of 30 per epoch: three epochs see 27 different samples before any repeats
    assert len(taken[0] | taken[1] | taken[2]) == 3 * expected_counts("small")


def test_plan_reports_each_datasets_share(mixture):
    loader = StreamBatchLoader({n: str(mixture / n) for n in SIZES}, weights=WEIGHTS, budget=BUDGET)
    report = loader.plan().datasets
    assert {n: r["samples"] for n, r in report.items()} == {n: expected_counts(n) for n in SIZES}
    assert math.isclose(sum(r["share"] for r in report.values()), 1.0)
    assert all(r["hours"] > 0 for r in report.values())


def test_resume_mid_epoch_is_exact_on_another_world_size(mixture):
    """Two ranks stop after 3 steps; three ranks resume: the epoch's multiset is exactly the weights'."""
    src = str(mixture / "mix.json")
    old = [StreamBatchLoader(src, budget=BUDGET, rank=r, world_size=2, buffer_size=20, seed=3) for r in range(2)]
    before, states = [], []
    for loader in old:
        it = iter(loader)
        before += [next(it) for _ in range(3)]
        states.append(loader.state_dict())
    new = [StreamBatchLoader(src, budget=BUDGET, rank=r, world_size=3, buffer_size=20, seed=3) for r in range(3)]
    after = []
    for r, loader in enumerate(new):
        loader.load_state_dict(states[r % 2])
        after += list(loader)
    assert len({len(loader) for loader in new}) == 1
    check_weights(epoch_counts(before) + epoch_counts(after))


def test_mixture_errors_are_clear(mixture, tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"id": f"t{i}", "text": "ab" * (i + 1)}) + "\n" for i in range(5)))
    write_shards(str(text), str(tmp_path / "text"), progress=False)
    with pytest.raises(ValueError, match="'big'.*'text'.*different length units"):
        StreamBatchLoader({"big": str(mixture / "big"), "text": str(tmp_path / "text")}, budget=BUDGET)
    with pytest.raises(ValueError, match="unknown datasets: nope"):
        StreamBatchLoader({"big": str(mixture / "big")}, weights={"nope": 1.0}, budget=BUDGET)
    with pytest.raises(ValueError, match=r"weights\['big'\] must be at least 0, got -1"):
        StreamBatchLoader({"big": str(mixture / "big")}, weights={"big": -1}, budget=BUDGET)
    loader = StreamBatchLoader(str(mixture / "mix.json"), budget=BUDGET)
    next(iter(loader))  # mid-epoch: other weights would take other samples (between epochs only the start counts)
    state = loader.state_dict()
    other = StreamBatchLoader({n: str(mixture / n) for n in SIZES}, weights={**WEIGHTS, "small": 0.5}, budget=BUDGET)
    with pytest.raises(ValueError, match="mixture"):
        other.load_state_dict(state)


def test_an_empty_epoch_of_a_filtered_mixture_says_why(mixture):
    """The message said "where=... keeps 856 of the dataset's 3 samples" (the filter's count over every dataset
    beside the weighted draw's) and sent the user to fewer ranks on one rank."""
    shortest = min(StreamBatchLoader(str(mixture / "small"), budget=BUDGET).index.shard_table()["min_length"])
    datasets = {n: str(mixture / n) for n in ("big", "small")}
    where = f"length < {int(shortest)}"  # keeps none of small's samples
    loader = StreamBatchLoader(datasets, weights={"big": 0, "small": 1}, budget=BUDGET, where=where)
    with pytest.raises(EmptyEpochError) as got:
        len(loader)
    kept, total, text = loader.filter.kept, SIZES["big"] + SIZES["small"], str(got.value)
    assert f"(where={where!r} keeps {kept:,} of the datasets' {total:,} samples)" in text
    assert "loosen where=, weigh the datasets it keeps" in text


def test_a_rank_no_sample_reached_says_why():
    """A rank-locally planned epoch of 3 samples on 4 ranks: the rank that got none said "of this rank's 0
    samples, ;"."""
    from types import SimpleNamespace

    from streambatch.loader.messages import empty_epoch_message

    loader = SimpleNamespace(
        index=SimpleNamespace(num_samples=3), world_size=4, num_workers=0, name="ds", filter=None, even_batches="split"
    )
    sched = SimpleNamespace(epoch=0, skipped=0, dropped=0, planned_samples=0)
    text = empty_epoch_message(loader, sched, local=True)
    assert text == (
        "ds: epoch 0 has no batches: none reached this rank: the epoch's samples are too few for every rank to get a "
        "batch (4 × 1 (rank, worker) slots, even_batches='split'); use fewer ranks/workers"
    )


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.integers(0, 2**31), st.integers(0, 5))
def test_cycle_permutation_is_a_bijection(n, seed, cycle):
    pos = CyclePermutation(n, (seed, 0, cycle))(np.arange(n))
    assert sorted(pos.tolist()) == list(range(n))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.floats(0.05, 3.5), st.integers(0, 1000))
def test_draws_take_round_w_n_and_cover_before_repeating(n, w, seed):
    draw = DatasetDraw.of(n, w, seed, 1)
    ids = np.arange(n)
    seen = np.zeros(n, dtype=np.int64)
    for epoch in range(4):
        occ = draw.occurrences(ids, epoch)
        assert occ.sum() == draw.take
        assert occ.max() <= draw.copies
        seen += occ
        # epochs walk through whole permutations: no sample is taken a (k+1)-th time before every sample was
        # taken k times, so after any number of epochs the counts differ by at most one
        assert seen.max() - seen.min() <= 1


@pytest.mark.cluster
@pytest.mark.parametrize("batch_by", [None, "dataset"])
def test_torchrun_mixture_equal_steps_exact_counts_and_resume(mixture, tmp_path, batch_by):
    """Real torchrun ranks over the 3-dataset mixture: equal steps and exact per-dataset counts in each epoch,
    a kill and resume mid-epoch on the same world size, then a resume on another one (``batch_by="dataset"``:
    every batch of every rank from one dataset)."""
    common = [
        "--data",
        str(mixture / "mix.json"),
        "--budget",
        str(BUDGET),
        *(["--batch-by", batch_by] if batch_by else []),
        "--epochs",
        "2",
    ]
    out = tmp_path / "same"
    out.mkdir()
    kill_when_stopped(torchrun([*common, "--out", str(out), "--stop-after", "3"], 2), out, 2)
    wait(torchrun([*common, "--out", str(out), "--resume"], 2))
    logs = read_logs(out)
    for epoch in (0, 1):
        steps = {r: len(batches(log, epoch)) for r, log in logs.items()}
        assert len(set(steps.values())) == 1, steps
        check_weights(epoch_counts(b for log in logs.values() for b in batches(log, epoch)))
        if batch_by:
            assert all(len(set(b["dataset"])) == 1 for log in logs.values() for b in batches(log, epoch))

    out = tmp_path / "other"
    out.mkdir()
    kill_when_stopped(torchrun([*common[:-2], "--out", str(out), "--stop-after", "4"], 2), out, 2)
    before = [b for log in read_logs(out).values() for b in batches(log)]
    for f in out.glob("log-rank*.jsonl"):
        f.rename(f.with_suffix(".before"))
    (out / "ckpt-rank2.pt").write_bytes((out / "ckpt-rank0.pt").read_bytes())
    wait(torchrun([*common[:-2], "--out", str(out), "--resume"], 3))
    logs = read_logs(out)
    assert len({len(batches(log)) for log in logs.values()}) == 1
    after = [b for log in logs.values() for b in batches(log)]
    check_weights(epoch_counts(before) + epoch_counts(after))
    if batch_by:
        assert all(len(set(b["dataset"])) == 1 for b in before + after)
