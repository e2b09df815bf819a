"""Speed perturbation planned inside the budget: each sample's factor comes from (seed, epoch, global id) at plan
time, the plan batches the perturbed lengths, and the emitted tensors keep the budget and have the planned lengths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hypothesis import given, settings
from hypothesis import strategies as st

from streambatch import StreamBatchLoader
from streambatch.plan.perturb import SpeedPerturb, perturbed_samples
from streambatch.write.writer import write_shards

SR = 8000
BUDGET = 5 * SR

#: three length distributions (seconds): short and uniform, log-normal with a long tail, two modes
DISTRIBUTIONS = {
    "uniform": lambda rng, n: rng.uniform(0.1, 2.0, n),
    "lognormal": lambda rng, n: np.clip(rng.lognormal(np.log(1.2), 0.6, n), 0.05, 6.0),
    "bimodal": lambda rng, n: np.where(rng.random(n) < 0.7, rng.normal(0.8, 0.1, n), rng.normal(4.2, 0.3, n)).clip(
        0.05
    ),
}


def write_dataset(folder: Path, seconds: np.ndarray, rng: np.random.Generator) -> str:
    """Noise utterances of these durations written as WAV, then shardified."""
    (folder / "audio").mkdir(parents=True)
    for i, s in enumerate(seconds):
        wav = (0.1 * rng.standard_normal(max(1, int(round(s * SR))))).astype(np.float32)
        sf.write(folder / "audio" / f"u{i:04d}.wav", wav, SR, subtype="PCM_16")
    write_shards(str(folder / "audio"), str(folder / "shards"), max_count=12, shuffle=True, seed=0, progress=False)
    return str(folder / "shards")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("speed")
    rng = np.random.default_rng(11)
    return {name: write_dataset(root / name, draw(rng, 60), rng) for name, draw in DISTRIBUTIONS.items()}


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emitted_batches_keep_the_budget_and_the_planned_lengths(datasets, dist, seed):
    factors = (0.9, 1.0, 1.1)
    speed = factors if seed != 1 else (factors, (1, 2, 1))
    loader = StreamBatchLoader(datasets[dist], budget=BUDGET, seed=seed, buffer_size=20, speed_perturb=speed)
    seen, used = 0, set()
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        steps, planned = 0, len(loader)
        for b in loader:
            steps += 1
            assert b["audio"].shape[0] * b["audio"].shape[1] <= BUDGET
            n = np.round(np.array(b["duration"]) * SR)  # the index length of each sample, in samples
            f = b["speed"].numpy().astype(np.float64)
            assert set(np.round(f, 4)) <= set(factors)
            assert np.all(np.abs(b["lengths"].numpy() - n / f) <= 1), (
                "a sample's length is not its length over its factor"
            )
            seen += len(b["keys"])
            used |= set(np.round(f, 4).tolist())
        assert steps == planned
    assert used == set(factors) and seen > 0


def test_factors_follow_seed_epoch_and_id_and_differ_by_epoch(datasets):
    path = datasets["uniform"]
    runs = {}
    for epoch in (0, 0, 1):
        loader = StreamBatchLoader(path, budget=BUDGET, seed=5, speed_perturb=(0.9, 1.0, 1.1), num_workers=2)
        loader.set_epoch(epoch)
        got = {k: f for b in loader for k, f in zip(b["keys"], b["speed"].tolist())}
        runs.setdefault(epoch, []).append(got)
    assert runs[0][0] == runs[0][1]
    common = set(runs[0][0]) & set(runs[1][0])
    assert sum(runs[0][0][k] != runs[1][0][k] for k in common) > len(common) // 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10**12), min_size=1, max_size=50), st.integers(0, 2**31), st.integers(0, 1000))
def test_a_factor_depends_on_the_sample_alone(gids, seed, epoch):
    """Whichever samples are planned together (another slot, rank or world size), each gets the same factor."""
    sp = SpeedPerturb.make((0.9, 1.0, 1.1))
    whole = sp.factors_of(seed, epoch, np.array(gids))
    alone = [sp.factors_of(seed, epoch, np.array([g]))[0] for g in gids]
    assert whole.tolist() == alone


def test_weights_are_honoured():
    sp = SpeedPerturb.make({0.9: 1, 1.0: 2, 1.1: 1})
    f = sp.factors_of(3, 0, np.arange(200_000))
    share = [(f == x).mean() for x in (0.9, 1.0, 1.1)]
    assert share == pytest.approx([0.25, 0.5, 0.25], abs=0.01)


def test_planned_length_is_what_the_resampler_gives():
    import soxr

    rng = np.random.default_rng(0)
    for n in (1, 7, 399, 8000, 12345):
        for f in (0.9, 1.1, 1.25):
            assert len(soxr.resample(rng.standard_normal(n).astype(np.float32), SR * f, SR)) == perturbed_samples(n, f)


@pytest.mark.parametrize("bad", [(0.9, -1.0), (0.9, float("nan")), ((0.9, 1.1), (1.0,)), ((0.9, 1.1), (0, 0))])
def test_bad_factors_or_weights_are_an_error(datasets, bad):
    with pytest.raises(ValueError, match="speed_perturb"):
        StreamBatchLoader(datasets["uniform"], budget=BUDGET, speed_perturb=bad)


def test_speed_perturb_needs_audio(tmp_path):
    import json

    with open(tmp_path / "t.jsonl", "w") as fh:
        for i in range(5):
            fh.write(json.dumps({"id": f"s{i}", "input_ids": list(range(1, 5 + i))}) + "\n")
    write_shards(str(tmp_path / "t.jsonl"), str(tmp_path / "shards"), progress=False)
    with pytest.raises(ValueError, match="audio lengths in samples"):
        StreamBatchLoader(str(tmp_path / "shards"), budget=100, speed_perturb=(0.9, 1.1))


def test_a_repeated_sample_draws_again_and_the_first_draw_is_unchanged():
    """A mixture that repeats a sample within an epoch passes its repeat number: repeat 0 is the plain draw."""
    sp, gids = SpeedPerturb.make((0.9, 1.0, 1.1)), np.arange(3000)
    plain = sp.factors_of(4, 2, gids)
    assert np.array_equal(sp.factors_of(4, 2, gids, np.zeros(3000, dtype=np.int64)), plain)
    again = sp.factors_of(4, 2, gids, np.ones(3000, dtype=np.int64))
    assert 0.5 < (again != plain).mean() < 0.8  # independent draws of 3 equally likely factors differ 2/3 of the time
